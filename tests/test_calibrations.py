"""The calibration store (pipeline/speculation/calibrations.py) without an engine: a calibration
found by its key with one GET, one of the same models measured with other settings named and not
used, on local files and moto's S3; and the setting a job takes from it. A real calibrate and the
job that uses it: tests/test_calibrate.py."""

from __future__ import annotations

import pytest

from pipeline.config import parse_config
from pipeline.job.plan import model_fingerprint
from pipeline.speculation.calibrations import (
    JobCalibration,
    calibrated_setting,
    calibration_key,
    find_calibration,
    job_calibration,
    save_calibration,
    store_uri,
)
from schemas.report import CalibrationReport
from tests.conftest import calibration_report, job_config, record_s3_requests
from tinykit import kit_paths

KIT = kit_paths()
TINY_KIT = {"target": KIT["target"], "drafter": KIT["drafter_eagle31"]}


def report(recommended_depth: int = 2, schedule=None) -> CalibrationReport:
    return calibration_report([], recommended_depth=recommended_depth, recommended_schedule=schedule)


def config_of(**engine):
    return parse_config(job_config("in", "out", TINY_KIT, engine=engine))


def test_the_store_finds_its_key_and_names_what_differs_in_another(location, monkeypatch):
    storage, store = location.storage, location.storage.join(location.uri, "calibrations")
    config = config_of()
    target, drafter = model_fingerprint(KIT["target"]), model_fingerprint(KIT["drafter_eagle31"])
    key = calibration_key(config, target, drafter)
    assert find_calibration(storage, store, key).describe() == f"no calibration of this target and drafter in {store}"

    uri = save_calibration(storage, store, key, report(), "jobs/daily.yaml")
    requests = record_s3_requests(monkeypatch) if store.startswith("s3://") else None
    found = find_calibration(storage, store, key)
    assert (
        found.found.report.recommended_depth == 2 and found.uri == uri and found.found.config_uri == "jobs/daily.yaml"
    )
    assert "2026-12-07T00:00:00+00:00" in found.describe() and uri in found.describe()
    if requests is not None:
        assert [op for op, _ in requests] == ["get_object"], requests  # one GET when it is there

    wider = config_of(max_num_seqs=64)
    other = find_calibration(storage, store, calibration_key(wider, target, drafter))
    assert other.found is None and len(other.not_used) == 1
    assert f"{uri} was measured with engine.max_num_seqs 32 (this job: 64): not used" in other.describe()
    # another drafter: its own folder, nothing of this one's named
    alone = calibration_key(config, target, model_fingerprint(KIT["drafter_eagle3"]))
    assert find_calibration(storage, store, alone).not_used == []


def test_a_job_finds_the_stores_calibration_before_its_own_locations(tmp_path, monkeypatch):
    from pipeline.commit.outputs import OutputLocation
    from pipeline.storage import Storage

    monkeypatch.setenv("SPECBATCH_CALIBRATIONS", str(tmp_path / "store"))
    config = config_of()
    assert store_uri(config) == str(tmp_path / "store")
    assert (
        store_uri(
            config.model_copy(
                update={"speculative": config.speculative.model_copy(update={"calibrations": "s3://b/c/"})}
            )
        )
        == "s3://b/c"
    )
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    target, drafter = model_fingerprint(KIT["target"]), model_fingerprint(KIT["drafter_eagle31"])
    assert job_calibration(config, location, target, None).report is None
    (tmp_path / "out" / "pilot" / "calibration").mkdir(parents=True)  # the pilot's: found when calibrate's is not
    (tmp_path / "out" / "pilot" / "calibration" / "calibration.json").write_text(report(2).model_dump_json())
    pilot = job_calibration(config, location, target, drafter)
    assert pilot.report.recommended_depth == 2 and pilot.uri.endswith("out/pilot/calibration/calibration.json")
    (tmp_path / "out" / "calibration").mkdir(parents=True)
    (tmp_path / "out" / "calibration" / "calibration.json").write_text(report(1).model_dump_json())
    own = job_calibration(config, location, target, drafter)
    assert own.report.recommended_depth == 1 and own.where.endswith("out/calibration/calibration.json")
    save_calibration(Storage(), store_uri(config), calibration_key(config, target, drafter), report(4), "daily.yaml")
    stored = job_calibration(config, location, target, drafter)
    assert stored.report.recommended_depth == 4 and str(tmp_path / "store") in stored.where


@pytest.mark.parametrize(
    "recommended, schedule, expected",
    [
        (4, None, (True, 4, None)),
        (0, None, (False, 3, None)),
        (3, [(1, 8, 3), (9, 32, 1)], (True, 3, [(1, 8, 3), (9, 32, 1)])),
    ],
)
def test_the_calibrated_setting_is_the_recommended_depth_schedule_or_off(recommended, schedule, expected):
    config = config_of()
    calibrated, said = calibrated_setting(config, JobCalibration(report(recommended, schedule), "the calibration X"))
    spec = calibrated.speculative
    assert (spec.enabled, spec.num_speculative_tokens, spec.depth_schedule) == expected
    assert "the calibration X" in said
    unchanged, said = calibrated_setting(config, JobCalibration(None, "no calibration of this target and drafter in S"))
    assert unchanged == config and "k=3" in said and "no calibration of this target and drafter in S" in said
