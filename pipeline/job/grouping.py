"""Whether a job's rows are grouped by shared prompt prefix, decided once and recorded in
`_job.json` (schemas.PrefixGrouping): `resources.group_prefixes` true or false, or auto, which
groups when sorting by prefix shares at least 5% more of the prompt text than the input's own
order (pipeline/inputs/prefixes.py). A resume keeps the recorded decision and the grouped copy
its units were planned over; it never mixes grouped and ungrouped units."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from pipeline.commit.outputs import OutputLocation
from pipeline.config import JobConfig
from pipeline.inputs.prefixes import group_order, grouping_pays, measure_sharing, read_keys
from pipeline.inputs.shape import RowShape
from schemas import InputFile, JobManifest, PrefixGrouping


class GroupingChanged(ValueError):
    """The output location holds units of the other grouping decision, or its grouped copy is gone."""


@dataclasses.dataclass
class GroupingPlan:
    """The decision, and when the copy is still to be written, the order to write it in."""

    record: PrefixGrouping
    order: Optional[np.ndarray] = None
    kinds: Optional[np.ndarray] = None

    @property
    def copy_to_write(self) -> bool:
        return self.record.grouped and not self.record.files


def _setting(config: JobConfig) -> str:
    value = config.resources.group_prefixes
    return value if isinstance(value, str) else str(value).lower()


def plan_grouping(
    config: JobConfig,
    location: OutputLocation,
    previous: Optional[JobManifest],
    input_files: list[InputFile],
    committed: set[str],
) -> GroupingPlan:
    setting = _setting(config)
    recorded = previous.grouping if previous else None
    if committed:  # the units committed so far decide: a resume keeps their plan
        if recorded is None:  # begun by a specbatch without grouping: its units are the input's
            return GroupingPlan(
                PrefixGrouping(setting=setting, grouped=False, reason="the job began before rows were grouped")
            )
        if setting != "auto" and (setting == "true") != recorded.grouped:
            raise GroupingChanged(
                f"resources.group_prefixes: {setting}, but {location.uri} holds units of job {previous.job_id} planned "
                f"{'over its grouped copy' if recorded.grouped else 'over the input as it is'}; resuming would mix "
                f"them. Set it back to {str(recorded.grouped).lower()} (or auto), use a new output_uri, or rerun with "
                "--restart."
            )
        return GroupingPlan(recorded)
    if setting == "false":
        return GroupingPlan(PrefixGrouping(setting=setting, grouped=False, reason="resources.group_prefixes is false"))
    keys = read_keys(location.storage, input_files, RowShape.for_job(config))
    order = group_order(keys)
    sharing = measure_sharing(keys, order, config.engine.max_num_seqs)
    pays, reason = grouping_pays(sharing)
    grouped = pays or setting == "true"
    if grouped and not pays:
        reason = f"resources.group_prefixes is true ({reason})"
    record = PrefixGrouping(setting=setting, grouped=grouped, reason=reason, sharing=sharing)
    return GroupingPlan(record, order, keys.kinds) if grouped else GroupingPlan(record)


def refuse_a_lost_copy(location: OutputLocation, recorded: PrefixGrouping) -> None:
    """Units left to run over a grouped copy whose files are gone or rewritten (one listing)."""
    folders = {f.uri.rsplit("/", 1)[0] for f in recorded.files}
    listed = {
        uri: info for folder in folders for uri, info in location.storage.list_details(folder, ".parquet").items()
    }
    lost = [f.uri for f in recorded.files if (listed.get(f.uri) or {}).get("size") != f.size]
    if lost:
        raise GroupingChanged(
            f"{location.uri}: {len(lost)} file(s) of the job's grouped input copy are gone or changed (e.g. "
            f"{lost[0]}); its units left to run cannot be read. Rerun with --restart to start over."
        )
