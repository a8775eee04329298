"""What a run or a resume at an output location would do, read without writing anything: the
previous manifest and the refusal of results that would change, the model fingerprints, the input
check, the work units and those left to run (JobPlan), the run's flags (RunOptions), and the
refusals a run exits 2 with."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Optional

import pyarrow as pa

from pipeline.commit.lease import LeaseHeld
from pipeline.commit.outputs import LayoutMismatch, ManifestInvalid, OutputLocation
from pipeline.inputs.units import WorkUnit, plan_units
from pipeline.config import ConfigError, JobConfig
from pipeline.inputs import InputError, InputReport
from pipeline.inputs.ids import TooManyDuplicateIds, find_duplicate_ids
from pipeline.inputs.openai_batch import inspect_job_inputs
from pipeline.inputs.shape import RowShape
from pipeline.job.chain import chained_inputs
from pipeline.job.grouping import GroupingChanged, GroupingPlan, plan_grouping, refuse_a_lost_copy
from pipeline.job.preflight import check_before_engines
from pipeline.speculation.drafter_check import DrafterMismatch, check_drafter
from pipeline.speculation.probe import DrafterRejected
from pipeline.speculation.trial import head_units
from pipeline.stages.stats import error_units
from pipeline.storage import Storage, is_local
from pipeline.storage.model_cache import remote_files
from schemas import HeadUnits, IdCheck, InputJob, JobManifest, ModelFingerprint

log = logging.getLogger("specbatch")


# Files of a model directory whose change changes the results: weights, their index, the
# tokenizer and the configs. Fingerprinted by size and mtime, or size and ETag in object
# storage (hashing GBs of weights would cost minutes per run).
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".txt", ".tiktoken", ".jinja")


def model_fingerprint(
    path: str, storage: Optional[Storage] = None, config_name: str = "config.json", field: Optional[str] = None
) -> ModelFingerprint:
    """sha256 of the model's config.json in canonical form, and of each weight, index and
    tokenizer file its size and version: the mtime for a local folder, the ETag for a folder in
    object storage (from one listing; nothing is downloaded, and the ETags are what each node's
    model cache copies and checks). Refuses a path without a config.json (`config_name`: a LoRA
    adapter's adapter_config.json), naming the config `field` it came from."""
    where = f"{field}: {path}" if field else path
    expected = f"a local folder with {config_name}, or an s3:// URI"
    if not is_local(path):
        storage = storage or Storage()
        try:
            listed = remote_files(path, storage)
        except FileNotFoundError:
            raise FileNotFoundError(f"{where}: no such folder, nothing is stored under it ({expected})") from None
        if config_name not in listed:
            raise FileNotFoundError(f"{where}: no {config_name} in it ({expected}; models are never read from a hub)")
        config = json.loads(storage.read_bytes(f"{path.rstrip('/')}/{config_name}"))
        files = {
            name: f"{info['size']}:{info['etag']}"
            for name, info in listed.items()
            if name.endswith(MODEL_FILE_SUFFIXES)
        }
    else:
        root = Path(path[len("file://") :] if path.startswith("file://") else path)
        config_file = root / config_name
        if not root.exists():
            raise FileNotFoundError(f"{where}: no such directory ({expected})")
        if not root.is_dir():
            raise FileNotFoundError(f"{where}: not a directory ({expected})")
        if not config_file.is_file():
            raise FileNotFoundError(f"{where}: no {config_name} in it ({expected}; models are never read from a hub)")
        config = json.loads(config_file.read_text())
        files = {}
        for file in sorted(root.iterdir()):
            if file.is_file() and file.name.endswith(MODEL_FILE_SUFFIXES):
                stat = file.stat()
                files[file.name] = f"{stat.st_size}:{stat.st_mtime_ns}"
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return ModelFingerprint(
        path=path,
        config_sha256=hashlib.sha256(canonical).hexdigest(),
        architectures=config.get("architectures", []),
        files=files,
    )


def model_id(fingerprint: ModelFingerprint) -> str:
    return f"{Path(fingerprint.path.rstrip('/')).name}@{fingerprint.config_sha256[:12]}"


class ResultsChanged(ValueError):
    """The output location holds results of a different model, drafter, sampling or input."""


# What a run refuses before it starts, with exit 2 (`specbatch: refused: ...`; the dry run says the same).
REFUSALS = (
    ConfigError,
    InputError,
    DrafterMismatch,
    DrafterRejected,
    ResultsChanged,
    GroupingChanged,
    LayoutMismatch,
    ManifestInvalid,
    LeaseHeld,
    FileNotFoundError,
    TooManyDuplicateIds,
)


def results_decisive(config: JobConfig, target: ModelFingerprint, drafter: Optional[ModelFingerprint]) -> dict:
    """What decides the generated text, and which rows make a unit: a resume must not mix
    results of two settings."""
    decisive = {
        "model": target.config_sha256,
        "model files": target.files,
        "drafter": drafter.config_sha256 if drafter else None,
        "drafter files": drafter.files if drafter else None,
        "sampling": config.sampling.model_dump(mode="json"),
        "chat": config.chat.model_dump(mode="json"),
        "lora": _adapter_fingerprints(config),
        "engine.max_model_len": config.engine.max_model_len,
        "engine.dtype": config.engine.dtype,
        "engine.seed": config.engine.seed,
        "resources.rows_per_unit": config.resources.rows_per_unit,
    }
    if not config.rows.is_default:  # left out when default: the jobs before the section keep their fingerprint
        decisive["rows"] = config.rows.model_dump(mode="json")
    return decisive


def _adapter_fingerprints(config: JobConfig) -> Optional[dict]:
    if not config.lora:
        return None
    storage = Storage.from_config(config.storage)
    return {
        name: model_fingerprint(path, storage, "adapter_config.json", f"lora.adapters.{name}").model_dump(
            exclude={"path", "architectures"}
        )
        for name, path in sorted(config.lora.adapters.items())
    }


def results_fingerprint(config: JobConfig, target: ModelFingerprint, drafter: Optional[ModelFingerprint]) -> str:
    return hashlib.sha256(json.dumps(results_decisive(config, target, drafter), sort_keys=True).encode()).hexdigest()


def _changes(before: dict, after: dict) -> list[str]:
    """Human-readable differences of two `results_decisive` dicts, naming files and fields."""
    changed = []
    for key in after:
        old, new = before.get(key), after[key]
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            names = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
            changed.append(f"{key}: " + ", ".join(names))
        else:
            changed.append(f"{key}: {old!r} -> {new!r}")
    return changed


def _refuse_changes(
    config: JobConfig,
    previous: JobManifest,
    target: ModelFingerprint,
    drafter: Optional[ModelFingerprint],
    location: OutputLocation,
) -> None:
    """A location holding results of other settings is refused, naming what changed; one
    where nothing was committed yet is not (the earlier attempt left nothing to mix with)."""
    now = results_decisive(config, target, drafter)
    if previous.results_fingerprint == results_fingerprint(config, target, drafter):
        return
    if not location.committed_units():
        log.info(
            "settings changed since attempt %d, which committed nothing: starting with the new ones",
            len(previous.attempts),
        )
        return
    before = results_decisive(JobConfig.model_validate(previous.config), previous.model, previous.drafter)
    what = "; ".join(_changes(before, now)) or "the settings that decide the results"
    raise ResultsChanged(
        f"{config.output_uri} holds results of job {previous.job_id} made with other settings ({what}); resuming "
        "would mix them. Use a new output_uri, or rerun with --restart to start over (it deletes those results)."
    )


def _refuse_changed_inputs(config: JobConfig, previous: JobManifest, inputs: InputReport) -> None:
    """An input file rewritten in place would make new units beside the committed old ones."""
    now = {f.uri: f for f in inputs.files}
    changed = [
        f"{f.uri} (size {f.size} -> {now[f.uri].size}, version {f.version} -> {now[f.uri].version})"
        for f in previous.input_files
        if f.uri in now and (f.size, f.version) != (now[f.uri].size, now[f.uri].version)
    ]
    if changed:
        raise ResultsChanged(
            f"input files changed since job {previous.job_id} started at {config.output_uri}: "
            + "; ".join(changed)
            + ". Use a new output_uri, or rerun with --restart to start over."
        )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """A run's choices beside its config (the command line's flags). `restart` wipes the
    location first; `take_over` takes the lease of a run known to be dead; `address` is the Ray
    cluster to join (default RAY_ADDRESS, else a Ray of its own)."""

    job_id: Optional[str] = None
    progress: bool = True
    restart: bool = False
    take_over: bool = False
    retry_errors: bool = False
    verbose: bool = False
    address: Optional[str] = None


@dataclasses.dataclass
class JobPlan:
    """What a run or resume at `config.output_uri` would do, read without writing anything."""

    location: OutputLocation
    previous: Optional[JobManifest]
    job_id: str
    target: ModelFingerprint
    drafter: Optional[ModelFingerprint]
    inputs: InputReport
    grouping: GroupingPlan  # units are row ranges of its copy once written (pipeline/graph/regroup.py)
    ids: IdCheck  # rows whose id an earlier row has: their rows' errors (pipeline/inputs/ids.py)
    units: list[WorkUnit]
    committed: set[str]
    done: Optional[pa.Table]  # the committed units' stats rows
    again: set[str]  # committed units that run again (their error rows)
    todo: list[WorkUnit]
    input_job: Optional[InputJob] = None  # a chained job: the job whose outputs are its input (pipeline/job/chain.py)
    head: Optional[HeadUnits] = (
        None  # the job's first rows in smaller units, for its trial (pipeline/speculation/trial.py)
    )

    @property
    def attempt_number(self) -> int:
        return len(self.previous.attempts) + 1 if self.previous else 1


def plan_job(
    config: JobConfig,
    job_id: Optional[str] = None,
    restart: bool = False,
    retry_errors: bool = False,
    scratch: Optional[str] = None,
) -> JobPlan:
    """The plan of a run: the previous run's manifest (a resume is refused if the results
    would change), the input check, the units and the ones left to run. Reads only; an
    OpenAI batch input is converted to Parquet under the output location first (into
    `scratch` instead, for a dry run)."""
    storage = Storage.from_config(config.storage)
    location = OutputLocation(storage, config.output_uri)
    previous, target, drafter = _previous_and_models(config, location, restart)
    known = previous.input_files if previous else None
    chained = chained_inputs(config, storage, known)  # input_uri names a finished job's output location
    inputs = chained[0] if chained else inspect_job_inputs(config, storage, known, scratch)
    if previous:
        _refuse_changed_inputs(config, previous, inputs)
    committed = set() if restart else location.committed_units()
    grouping = plan_grouping(config, location, previous, inputs.files, committed)
    ids = _check_ids(config, storage, inputs, previous)
    head = previous.head_units if previous else head_units(config, inputs.rows)  # a job's units never change
    units = plan_units(grouping.record.unit_files(inputs.files), config.resources.rows_per_unit, head)
    done = location.stats_table(committed) if committed else None  # read once: units to retry, and a rerun's totals
    again = error_units(done, retryable_only=not retry_errors) if done is not None else set()
    todo = [u for u in units if u.unit_id not in committed or u.unit_id in again]
    if todo and grouping.record.files:
        refuse_a_lost_copy(location, grouping.record)
    job_id = previous.job_id if previous else job_id or _new_job_id(config)
    return JobPlan(
        location,
        previous,
        job_id,
        target,
        drafter,
        inputs,
        grouping,
        ids,
        units,
        committed,
        done,
        again,
        todo,
        chained[1] if chained else None,
        head,
    )


def _previous_and_models(
    config: JobConfig, location: OutputLocation, restart: bool
) -> tuple[Optional[JobManifest], ModelFingerprint, Optional[ModelFingerprint]]:
    """The previous run's manifest (none with `restart`) and the models' fingerprints; a resume
    is refused when the models changed."""
    _refuse_a_file(location)
    previous = None if restart else location.job_manifest()
    target = model_fingerprint(config.model.path, location.storage, field="model.path")
    _refuse_missing_tokenizer(config)
    drafter = None
    if config.speculative.enabled:
        drafter = model_fingerprint(config.speculative.drafter, location.storage, field="speculative.drafter")
    if previous:
        _refuse_changes(config, previous, target, drafter, location)
    return previous, target, drafter


def _check_ids(config: JobConfig, storage: Storage, inputs: InputReport, previous: Optional[JobManifest]) -> IdCheck:
    """The ids checked unique across the input; a resume on the same files keeps the check it recorded."""
    identity = lambda files: sorted((f.uri, f.size, f.version) for f in files)  # noqa: E731
    if previous and previous.ids is not None and identity(previous.input_files) == identity(inputs.files):
        return previous.ids
    return IdCheck(rows=inputs.rows, duplicates=find_duplicate_ids(storage, inputs.files, RowShape.for_job(config)))


def check_before_any_engine(config: JobConfig, plan: JobPlan) -> list[str]:
    """Refuses what one rendering pass and the configs reveal, and a drafter of another
    target; returns the drafter checks downgraded to warnings."""
    storage = plan.location.storage
    check_before_engines(config, plan.inputs, storage)
    if not config.speculative.enabled:
        return []
    spec = config.speculative
    return check_drafter(config.model.path, spec.drafter, spec.checks_as_warnings, storage=storage).warnings


def _refuse_missing_tokenizer(config: JobConfig) -> None:
    """A local model.tokenizer that is not there (one in object storage is read, and refused by
    name, before any engine starts: pipeline/job/preflight.py)."""
    path = config.model.tokenizer
    if not path or not is_local(path):
        return
    root = Path(path[len("file://") :] if path.startswith("file://") else path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"model.tokenizer: {path}: {'not a directory' if root.exists() else 'no such directory'} (a local folder "
            "with the tokenizer's files, or an s3:// URI); leave model.tokenizer out to use model.path's tokenizer"
        )


def _refuse_a_file(location: OutputLocation) -> None:
    fs, path = location.storage.fs(location.uri)
    if location.storage.retrying(f"info {location.uri}", lambda: fs.isfile(path)):
        raise ConfigError(
            f"output_uri {location.uri!r} is a file; set output_uri to a folder (or prefix) for the job's outputs"
        )


def _new_job_id(config: JobConfig) -> str:
    return f"{config.job_name}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
