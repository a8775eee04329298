"""The calibration store: what `specbatch calibrate` measured, kept for every later job that it
is valid for.

A calibration is valid for a job with the same target and drafter (config and weight files),
accelerator, engine settings that change speed (dtype, max_num_seqs, tensor_parallel_size,
max_model_len) and specbatch version: its CalibrationKey. The store is a folder or URI
(speculative.calibrations; default $SPECBATCH_CALIBRATIONS, else ~/.cache/specbatch/calibrations
on the machine that drives the job, which on a cluster is its head node) holding one JSON file
per key, under a folder per target and drafter:

    STORE/<target and drafter>/<key>.json      (schemas.StoredCalibration)

A job finds its calibration with one GET when there is one; when there is none it lists its
models' folder (one LIST, a few GETs) to name a calibration of the same models that differs,
and in which field, rather than use it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

from pipeline.commit.outputs import OutputLocation
from pipeline.config import JobConfig
from pipeline.storage import Storage
from schemas import ModelFingerprint, utc_timestamp
from schemas.report import CalibrationKey, CalibrationReport, StoredCalibration

log = logging.getLogger("specbatch")
STORE_ENV = "SPECBATCH_CALIBRATIONS"
NAMED_MISMATCHES = 20  # entries of the same models read to name how they differ


def store_uri(config: JobConfig) -> str:
    return (
        config.speculative.calibrations
        or os.environ.get(STORE_ENV)
        or str(Path.home() / ".cache" / "specbatch" / "calibrations")
    ).rstrip("/")


def model_identity(fingerprint: ModelFingerprint) -> str:
    """The model's config and files, wherever it is read from."""
    files = json.dumps(sorted(fingerprint.files.items()))
    return hashlib.sha256(f"{fingerprint.config_sha256}|{files}".encode()).hexdigest()


def specbatch_version() -> str:
    try:
        return metadata.version("specbatch")
    except metadata.PackageNotFoundError:
        return "dev"


def calibration_key(config: JobConfig, target: ModelFingerprint, drafter: ModelFingerprint) -> CalibrationKey:
    engine = config.engine
    return CalibrationKey(
        target=model_identity(target),
        drafter=model_identity(drafter),
        accelerator=config.resources.accelerator,
        dtype=engine.dtype,
        max_num_seqs=engine.max_num_seqs,
        tensor_parallel_size=engine.tensor_parallel_size,
        max_model_len=engine.max_model_len,
        specbatch=specbatch_version(),
    )


def _folder(store: str, key: CalibrationKey, storage: Storage) -> str:
    models = hashlib.sha256(f"{key.target}|{key.drafter}".encode()).hexdigest()[:16]
    return storage.join(store, models)


def entry_uri(store: str, key: CalibrationKey, storage: Storage) -> str:
    settings = hashlib.sha256(key.model_dump_json().encode()).hexdigest()[:16]
    return storage.join(_folder(store, key, storage), f"{settings}.json")


def save_calibration(
    storage: Storage, store: str, key: CalibrationKey, report: CalibrationReport, config_uri: str
) -> str:
    """Writes the calibration for its key (a later one for the same key replaces it); returns its URI."""
    uri = entry_uri(store, key, storage)
    stored = StoredCalibration(
        key=key,
        stored_at=utc_timestamp(),
        config_uri=config_uri,
        report=report,
    )
    storage.write_bytes(uri, (stored.model_dump_json(indent=2) + "\n").encode())
    return uri


@dataclass
class CalibrationLookup:
    """What a job found in the store: its calibration, or why none is used."""

    store: str
    found: Optional[StoredCalibration] = None
    uri: Optional[str] = None
    not_used: list[str] = field(default_factory=list)  # calibrations of the same models that do not match, and how

    def describe(self) -> str:
        if self.found:
            return f"the calibration of {self.found.report.measured_at} in {self.uri} (from {self.found.config_uri})"
        if self.not_used:
            return f"no calibration in {self.store} matches this job: " + "; ".join(self.not_used)
        return f"no calibration of this target and drafter in {self.store}"


def find_calibration(storage: Storage, store: str, key: CalibrationKey) -> CalibrationLookup:
    lookup = CalibrationLookup(store)
    uri = entry_uri(store, key, storage)
    try:
        lookup.found, lookup.uri = StoredCalibration.model_validate_json(storage.read_bytes(uri)), uri
        return lookup
    except FileNotFoundError:
        pass
    except ValueError as exc:  # another version's or a damaged entry: named, not used
        lookup.not_used.append(f"{uri} is not a calibration this version reads ({str(exc).splitlines()[0]})")
        return lookup
    for other in storage.list_files(_folder(store, key, storage), ".json")[:NAMED_MISMATCHES]:
        try:
            stored = StoredCalibration.model_validate_json(storage.read_bytes(other))
        except (FileNotFoundError, ValueError):
            continue
        lookup.not_used.append(f"{other} was measured with {differences(stored.key, key)}: not used")
    return lookup


def differences(measured: CalibrationKey, job: CalibrationKey) -> str:
    names = {
        "max_num_seqs": "engine.max_num_seqs",
        "dtype": "engine.dtype",
        "tensor_parallel_size": "engine.tensor_parallel_size",
        "max_model_len": "engine.max_model_len",
        "accelerator": "resources.accelerator",
        "specbatch": "specbatch",
    }
    return (
        ", ".join(
            f"{label} {getattr(measured, name)} (this job: {getattr(job, name)})"
            for name, label in names.items()
            if getattr(measured, name) != getattr(job, name)
        )
        or "the same settings"
    )


@dataclass
class JobCalibration:
    """The calibration a job judges its speculation by (`report`), and `where` names it; without
    one, `where` says why."""

    report: Optional[CalibrationReport]
    where: str
    uri: Optional[str] = None


def job_calibration(
    config: JobConfig, location: OutputLocation, target: ModelFingerprint, drafter: Optional[ModelFingerprint]
) -> JobCalibration:
    """The store's calibration for the job's models and settings, else the one `specbatch
    calibrate` wrote to the job's own output location (OUTPUT_URI/calibration), else the one
    `specbatch pilot` wrote there (OUTPUT_URI/pilot/calibration). The run, its dry run and its
    pilot all find the same one here."""
    lookup = None
    if drafter is not None:
        lookup = find_calibration(location.storage, store_uri(config), calibration_key(config, target, drafter))
        if lookup.found:
            return JobCalibration(lookup.found.report, lookup.describe(), lookup.uri)
    for folder in OWN_CALIBRATIONS:
        own = read_calibration(location, folder)
        if own is not None:
            uri = location.storage.join(location.uri, folder, "calibration.json")
            return JobCalibration(own, f"the calibration of {own.measured_at} in {uri}", uri)
    return JobCalibration(None, lookup.describe() if lookup else "the job runs no drafter")


# Where `specbatch calibrate` and `specbatch pilot` write a job's calibration, under its output location.
OWN_CALIBRATIONS = ("calibration", "pilot/calibration")


def read_calibration(location: OutputLocation, folder: str = "calibration") -> Optional[CalibrationReport]:
    """`specbatch calibrate`'s report for this job, when it wrote it to the job's output."""
    uri = location.storage.join(location.uri, folder, "calibration.json")
    try:
        return CalibrationReport.model_validate_json(location.storage.read_bytes(uri))
    except FileNotFoundError:
        return None
    except ValueError as exc:  # another version's or a damaged report: say so, decide without it
        log.warning("%s: not read (%s)", uri, str(exc).splitlines()[0])
        return None


def calibrated_setting(config: JobConfig, calibration: JobCalibration) -> tuple[JobConfig, str]:
    """The job's config with the depth its calibration recommends (speculative.depth_from:
    calibration): a depth schedule, a single depth, or speculation off; and the line that says so.
    Without a calibration the configured depth stays, and the line says why."""
    spec, report = config.speculative, calibration.report
    if report is None:
        return config, (
            f"speculation k={spec.num_speculative_tokens}: speculative.depth_from is calibration, but "
            f"{calibration.where}: the configured depth runs"
        )
    if report.recommended_schedule:
        schedule = [tuple(r) for r in report.recommended_schedule]
        update = {"depth_schedule": schedule, "num_speculative_tokens": max(k for *_, k in schedule)}
        setting = "the depth schedule " + ", ".join(f"{lo}-{hi}: k={k}" for lo, hi, k in schedule)
    elif report.recommended_depth == 0:
        return config.without_speculation(), f"speculation off: {calibration.where} measured off fastest"
    else:
        update = {"depth_schedule": None, "num_speculative_tokens": report.recommended_depth}
        setting = f"k={report.recommended_depth}"
    return (
        config.model_copy(update={"speculative": spec.model_copy(update=update)}),
        f"speculation {setting}: recommended by {calibration.where}",
    )


def read_any_calibration(storage: Storage, uri: str) -> Optional[CalibrationReport]:
    """The report at `uri`: a store's entry or a calibration.json; None when gone or unreadable."""
    try:
        data = storage.read_bytes(uri)
    except FileNotFoundError:
        return None
    for kind in (StoredCalibration, CalibrationReport):
        try:
            parsed = kind.model_validate_json(data)
        except ValueError:
            continue
        return parsed.report if isinstance(parsed, StoredCalibration) else parsed
    return None
