"""specbatch from Python, for orchestrators and notebooks: run a job from a dict, a YAML file or
a JobConfig and get its manifest back; read a finished job's committed rows as a pyarrow table
or a Ray dataset.

    from pipeline import api

    result = api.run({"input_uri": "prompts", "output_uri": "out", "model": {"path": "models/target"}})
    if result.status == "succeeded":
        table = api.read_outputs("out")

`run` ends as `specbatch run` does, with the same status and exit code (schemas.EXIT_CODES):
a refused job, a lost lease or a failed one is a result to read, not an exception; only an
error specbatch does not name (a bug) is raised.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional, Union

import pyarrow as pa

from pipeline.config import JobConfig, StorageConfig, load_config, parse_config
from pipeline.job.manifest import plain_text
from pipeline.job.plan import RunOptions
from schemas import EXIT_CODES, JobManifest

TABLES = ("outputs", "errors", "stats")
log = logging.getLogger("specbatch")


@dataclasses.dataclass
class JobResult:
    """How a run ended: `status` as `_job.json` and the CLI say it (succeeded,
    completed_with_errors, failed, refused, fenced, interrupted), its exit code, the manifest
    (None when the job was refused before it wrote one) and the reason of a run that did not
    succeed."""

    status: str
    exit_code: int
    manifest: Optional[JobManifest] = None
    error: Optional[str] = None


def job_config(
    config: Union[JobConfig, dict[str, Any], str, os.PathLike], output_uri: Optional[str] = None
) -> JobConfig:
    """A JobConfig from a dict (validated as a YAML file is), a file's path or URI, or itself;
    `output_uri` replaces the config's."""
    if isinstance(config, JobConfig):
        return config.model_copy(update={"output_uri": output_uri}) if output_uri else config
    if isinstance(config, dict):
        return parse_config({**config, **({"output_uri": output_uri} if output_uri else {})})
    return load_config(os.fspath(config), {"output_uri": output_uri} if output_uri else None)


def run(
    config: Union[JobConfig, dict[str, Any], str, os.PathLike],
    output_uri: Optional[str] = None,
    clock=None,
    command: Optional[str] = None,
    **options,
) -> JobResult:
    """Runs (or resumes) the job. `options`: the run's flags as `specbatch run` has them
    (pipeline/job/plan.RunOptions: restart, take_over, retry_errors, address, progress, ...).
    A job that ends with its rows generated gets its data set card (OUTPUT_URI/README.md,
    pipeline/tools/data_card.py), naming `command` as what made it."""
    from pipeline.job.runner import run_job

    flags = RunOptions(**{"progress": False, **options})
    location = None
    try:
        config = job_config(config, output_uri)
        location = _location(config.output_uri, config.storage, must_exist=False)
        manifest = run_job(config, clock=clock, **dataclasses.asdict(flags))
        if manifest.status in ("succeeded", "completed_with_errors"):
            _card(config, command or f"pipeline.api.run(<config of job {config.job_name}>)")
    except KeyboardInterrupt:  # the attempt recorded how far it got, when it had begun
        manifest = (
            JobManifest.model_validate(location.read_manifest()) if location and location.has_manifest() else None
        )
        return JobResult(
            "interrupted",
            EXIT_CODES["interrupted"],
            manifest if manifest and manifest.status == "interrupted" else None,
            "interrupted (Ctrl-C, SIGINT); run it again to resume",
        )
    except Exception as exc:
        status = ending_status(exc)
        if status is None:
            raise
        cause = getattr(exc, "cause", None)  # an actor's error, as Ray carries it
        return JobResult(
            status, EXIT_CODES[status], error=plain_text(str(cause if isinstance(cause, BaseException) else exc))
        )
    return JobResult(manifest.status, EXIT_CODES.get(manifest.status, EXIT_CODES["failed"]), manifest, manifest.error)


def _card(config: JobConfig, command: str) -> None:
    """The data set card; one that cannot be written is said, and the job's status stays."""
    from pipeline.tools.data_card import write_data_card

    try:
        write_data_card(config, command)
    except Exception as exc:  # the rows are committed and _job.json says so: the card is a summary of them
        log.warning(
            "the data set card (README.md) was not written to %s: %s: %s", config.output_uri, type(exc).__name__, exc
        )


def ending_status(exc: BaseException) -> Optional[str]:
    """The status an error ends a run with (refused, fenced, failed), or None for an error
    specbatch does not name."""
    from pipeline.cluster import SchedulingStalled
    from pipeline.commit.lease import LeaseLost
    from pipeline.job.breaker import TooManyErrors
    from pipeline.job.plan import REFUSALS
    from pipeline.job.watch import EnginesKeepFailing, JobStalled
    from pipeline.speculation.guard import AcceptanceTooLow
    from pipeline.storage import StorageUnavailable

    endings = [
        (REFUSALS, "refused"),
        ((LeaseLost,), "fenced"),
        (
            (StorageUnavailable, TooManyErrors, AcceptanceTooLow, SchedulingStalled, JobStalled, EnginesKeepFailing),
            "failed",
        ),
    ]
    return next((status for types, status in endings if isinstance(exc, types)), None)


def read_outputs(
    output_uri: str, table: str = "outputs", storage: Optional[Union[StorageConfig, dict]] = None
) -> pa.Table:
    """A job's committed rows of `table` (outputs, errors or stats) as one pyarrow table: files
    of units no commit marker names (a run that died mid-write) are not read."""
    return _location(output_uri, storage).read_table(_table(table))


def read_dataset(output_uri: str, table: str = "outputs", storage: Optional[Union[StorageConfig, dict]] = None):
    """A job's committed rows of `table` as a Ray dataset, read by Ray Data from the committed
    files only (for what does not fit one process's memory)."""
    import pyarrow.fs as pafs
    import ray

    location = _location(output_uri, storage)
    files = location.committed_files(table) if _table(table) != "stats" else []
    if not files:  # stats, or nothing committed yet
        return ray.data.from_arrow(location.read_table(table))
    fs, _ = location.storage.fs(files[0])
    return ray.data.read_parquet(
        [location.storage.fs(uri)[1] for uri in files], filesystem=pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    )


def _table(table: str) -> str:
    if table not in TABLES:
        raise ValueError(f"table {table!r}: one of {', '.join(TABLES)}")
    return table


def _location(output_uri: str, storage, must_exist: bool = True):
    from pipeline.commit.outputs import OutputLocation
    from pipeline.storage import Storage

    if isinstance(storage, dict):
        storage = StorageConfig.model_validate(storage)
    location = OutputLocation(Storage.from_config(storage or StorageConfig()), output_uri)
    if must_exist and not location.has_manifest():
        raise FileNotFoundError(
            f"{output_uri}: no _job.json; not a specbatch output location (or the job never started)"
        )
    return location
