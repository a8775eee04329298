"""`specbatch report`: figures checked against values computed by hand for small synthetic
jobs (local and on moto's S3), the files written, and the HTML page in a real headless Chromium."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.commit.outputs import OutputLocation
from pipeline.storage import Storage
from pipeline.tools.cost import JobData, ReportError, build_report, busy_seconds
from pipeline.tools.prices import Prices
from pipeline.tools.report import default_report_uri
from pipeline.tools.report import main as report_main
from pipeline.tools.report_tables import terminal_summary
from schemas import JobManifest, UnitStats
from schemas.report import CalibrationReport, CalibrationRow, CostReport

SHA_TARGET, SHA_OTHER = "a" * 64, "b" * 64
PRICES = "currency: USD\ngpu:\n  test-gpu: 2.0\ncpu:\n  test-node: 0.36\n"


def manifest(
    job_id, *, accelerator, replicas, gpus, wall, speculative, k=3, sha=SHA_TARGET, input_rows=0, verdict=None
):
    return JobManifest(
        speculation=verdict,
        job_id=job_id,
        status="succeeded",
        started_at="2026-11-29T00:00:00+00:00",
        config={
            "resources": {"replicas": replicas, "gpus_per_replica": gpus, "accelerator": accelerator},
            "speculative": {
                "enabled": speculative,
                "num_speculative_tokens": k,
                "drafter": "/m/d" if speculative else None,
            },
        },
        versions={"specbatch": "t", "vllm": None, "ray": "t", "torch": None, "python": "3"},
        model={"path": "/m/target", "config_sha256": sha, "architectures": []},
        drafter={"path": "/m/d", "config_sha256": "c" * 64, "architectures": []} if speculative else None,
        accelerator=accelerator,
        input_files=[],
        totals={"input_rows": input_rows, "wall_seconds": wall},
        **({"results_fingerprint": "f" * 64} if "results_fingerprint" in JobManifest.model_fields else {}),
    ).model_dump(mode="json")


def unit(
    unit_id, actor, started, engine, gen, prompt, drafts=0, draft_tokens=0, per_pos=(), out=10, err=0, k=0, cached=0
):
    return UnitStats(
        unit_id=unit_id,
        source="s",
        first_row=0,
        actor_id=actor,
        node_id="n",
        rows=out + err,
        output_rows=out,
        error_rows=err,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        generated_tokens=gen,
        started_at=started,
        wall_seconds=engine + 1,
        engine_seconds=engine,
        tokens_per_second=gen / engine,
        speculative=k > 0,
        num_speculative_tokens=k,
        num_drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=sum(per_pos),
        acceptance_rate=None,
        mean_acceptance_length=None,
        accepted_per_position=list(per_pos),
    ).model_dump()


def write_job(storage: Storage, uri: str, manifest_doc: dict, units: list[dict], uncommitted: list[dict] = ()):
    location = OutputLocation(storage, uri)
    location.write_manifest(manifest_doc)
    for row in units:
        location.commit(row["unit_id"], {"outputs": pa.table({"id": ["x"]})}, UnitStats(**row))
    for row in uncommitted:  # a unit that died before its commit marker: must not count
        location.write_files(row["unit_id"], {"outputs": pa.table({"id": ["x"]})}, UnitStats(**row))


# Job A: spec k=2, 2 replicas x 1 GPU, 1800 s -> 1.0 GPU-hour, $2.00.
#   actor a1: [1000,1100] and [1050,1150] overlap -> 150 s; actor a2: [1000,1090] and [1200,1260] -> 150 s.
#   generated 1,000,000, prompt 250,000 (100,000 from the prefix cache); drafts 200, draft tokens 400,
#   accepted 200 = 125 + 75.
JOB_A = [
    unit("a-1", "a1", 1000, 100, 400_000, 100_000, 100, 200, (70, 50), err=1, k=2, cached=60_000),
    unit("a-2", "a1", 1050, 100, 300_000, 50_000, 50, 100, (30, 10), k=2, cached=40_000),
    unit("a-3", "a2", 1000, 90, 200_000, 50_000, 50, 100, (25, 15), out=8, err=2, k=2),
    unit("a-4", "a2", 1200, 60, 100_000, 50_000, 0, 0, (0, 0), k=2),
]
# Job B: same model and accelerator, speculation off, 1 replica x 2 GPUs, 900 s -> 0.5 GPU-hour, $1.00.
#   [2000,2100] and [2100,2200] touch -> 200 s busy x 2 GPUs.
JOB_B = [unit("b-1", "b1", 2000, 100, 200_000, 50_000), unit("b-2", "b1", 2100, 100, 200_000, 50_000)]
# Job C: CPU-only, another model, 3 replicas x 1 node, 3600 s -> 3 node-hours x $0.36 = $1.08.
JOB_C = [unit("c-1", "c1", 5000, 50, 90_000, 10_000, 10, 30, (8, 5, 2), k=3)]


CALIBRATION = CalibrationReport(
    config_uri="job.yaml",
    measured_at="2026-11-28T00:00:00+00:00",
    accelerator="test-gpu",
    gpus_per_replica=1.0,
    currency="USD",
    price_per_gpu_hour=2.0,
    max_num_seqs=8,
    sample_requested=16,
    sample_measured=16,
    concurrencies=[8],
    recommended_depth=2,
    config_snippet="",
    rows=[
        CalibrationRow(
            concurrency=8,
            depth=d,
            prompts=16,
            prompt_tokens=160,
            generated_tokens=1000,
            seconds=s,
            tokens_per_second=1000 / s,
            tokens_per_second_per_gpu=1000 / s,
            speedup_vs_off=2.0 / s,
            num_drafts=0,
            draft_tokens=0,
            accepted_tokens=0,
            acceptance_rate=None,
            mean_acceptance_length=None,
            accepted_per_position=[],
            cost_per_million_generated_tokens=None,
            cost_per_million_total_tokens=None,
            recommended=d == 2,
        )
        for d, s in ((0, 2.0), (2, 1.0))
    ],
)


@pytest.fixture(scope="module")
def three_jobs(tmp_path_factory, s3_endpoint):
    """Jobs A and B on local disk, job C on moto's S3; one combined report under --out."""
    root = tmp_path_factory.mktemp("report")
    local, s3 = Storage(), Storage(endpoint_url=s3_endpoint)
    uris = [str(root / "out" / "2026-11-28"), str(root / "out" / "2026-11-29"), "s3://specbatch/report-test/cpu-job"]
    calibration = Path(uris[0]) / "calibration" / "calibration.json"  # what job A's verdict rests on
    calibration.parent.mkdir(parents=True)
    calibration.write_text(CALIBRATION.model_dump_json())
    judged = {
        "floor": 1.3,
        "mean_acceptance_length": 2.0,
        "below_floor": False,
        "cost_more_than_saved": False,
        "flags": [],
        "source": "calibration",
        "source_detail": f"the calibration of T in {calibration.parent} measured depth 2 at 8 "
        "sequences at once at 1.20x the speed of speculation off",
        "calibration_uri": str(calibration),
    }
    unknown = {
        "floor": 1.3,
        "mean_acceptance_length": 2.5,
        "below_floor": False,
        "cost_more_than_saved": None,
        "flags": [],
        "cost_unknown_because": "the job ran no speculation trial; no calibration of this target and drafter in S",
        "source": "none",
        "source_detail": "the job ran no speculation trial; no calibration of this target and drafter in S",
    }
    write_job(
        local,
        uris[0],
        manifest(
            "job-a",
            accelerator="test-gpu",
            replicas=2,
            gpus=1,
            wall=1800,
            speculative=True,
            k=2,
            input_rows=41,
            verdict=judged,
        ),
        JOB_A,
        uncommitted=[unit("a-dead", "a1", 1100, 500, 9_999_999, 1, k=2)],
    )
    write_job(
        local,
        uris[1],
        manifest("job-b", accelerator="test-gpu", replicas=1, gpus=2, wall=900, speculative=False, input_rows=20),
        JOB_B,
    )
    write_job(
        s3,
        uris[2],
        manifest(
            "job-c",
            accelerator="test-node",
            replicas=3,
            gpus=0,
            wall=3600,
            speculative=True,
            k=3,
            sha=SHA_OTHER,
            verdict=unknown,
        ),
        JOB_C,
    )
    prices = root / "prices.yaml"
    prices.write_text(PRICES)
    out = root / "combined"
    code = report_main([*uris, "--prices", str(prices), "--out", str(out), "--endpoint-url", s3_endpoint])
    assert code == 0
    return out, CostReport.model_validate_json((out / "report.json").read_text())


def test_busy_time_is_the_union_per_actor():
    assert busy_seconds(JOB_A) == pytest.approx(300.0)
    assert busy_seconds(JOB_B) == pytest.approx(200.0)


def test_job_figures_match_hand_computed_values(three_jobs):
    _, report = three_jobs
    a, b, c = report.jobs
    assert (a.job_id, b.job_id, c.job_id) == ("job-a", "job-b", "job-c")

    assert a.units == 4 and a.output_rows == 38 and a.failed_rows == 3 and a.input_rows == 41
    assert (a.generated_tokens, a.prompt_tokens) == (1_000_000, 250_000)  # the uncommitted unit is not counted
    assert (a.cached_prompt_tokens, a.computed_prompt_tokens, a.prefix_cache_hit_rate) == (
        100_000,
        150_000,
        pytest.approx(0.4),
    )
    assert (b.cached_prompt_tokens, b.computed_prompt_tokens, b.prefix_cache_hit_rate) == (0, 100_000, 0.0)
    assert a.gpu_hours == pytest.approx(1.0) and a.busy_seconds == pytest.approx(300.0)
    assert a.busy_gpu_hours == pytest.approx(300 / 3600) and a.utilization == pytest.approx(1 / 12)
    assert a.price_per_gpu_hour == 2.0 and a.cost == pytest.approx(2.0)
    assert a.cost_per_million_generated_tokens == pytest.approx(2.0)
    assert a.cost_per_million_total_tokens == pytest.approx(1.6)
    assert a.tokens_per_second_per_gpu == pytest.approx(1e6 / 3600)
    assert a.busy_tokens_per_second_per_gpu == pytest.approx(1e6 / 300)
    assert (a.num_drafts, a.draft_tokens, a.accepted_tokens) == (200, 400, 200)
    assert a.acceptance_rate == pytest.approx(0.5) and a.mean_acceptance_length == pytest.approx(2.0)
    assert a.accepted_per_position == pytest.approx([0.625, 0.375])
    assert a.speculative and a.num_speculative_tokens == 2

    assert b.gpu_hours == pytest.approx(0.5) and b.cost == pytest.approx(1.0) and b.gpus_per_replica == 2
    assert b.busy_gpu_hours == pytest.approx(2 * 200 / 3600)
    assert b.cost_per_million_generated_tokens == pytest.approx(
        2.5
    ) and b.cost_per_million_total_tokens == pytest.approx(2.0)
    assert b.tokens_per_second_per_gpu == pytest.approx(400_000 / 1800)
    assert b.acceptance_rate is None and b.mean_acceptance_length is None and b.accepted_per_position == []
    assert not b.speculative and b.num_speculative_tokens == 0

    assert c.gpus_per_replica == 1.0 and c.gpu_hours == pytest.approx(3.0) and c.cost == pytest.approx(1.08)
    assert c.cost_per_million_generated_tokens == pytest.approx(
        12.0
    ) and c.cost_per_million_total_tokens == pytest.approx(10.8)
    assert c.mean_acceptance_length == pytest.approx(2.5) and c.accepted_per_position == pytest.approx([0.8, 0.5, 0.2])


def test_overall_figures_and_speculation_saving(three_jobs):
    _, report = three_jobs
    o = report.overall
    assert (o.jobs, o.generated_tokens, o.prompt_tokens, o.failed_rows) == (3, 1_490_000, 360_000, 3)
    assert o.gpu_hours == pytest.approx(4.5) and o.cost == pytest.approx(4.08)
    assert o.cost_per_million_generated_tokens == pytest.approx(4.08 / 1.49)
    assert o.cost_per_million_total_tokens == pytest.approx(4.08 / 1.85)
    assert o.tokens_per_second_per_gpu == pytest.approx(1.49e6 / (4.5 * 3600))
    # Only A and B share a model and an accelerator: k=2 at $2.00 against off at $2.50 per 1M.
    (s,) = report.speculation
    assert (s.accelerator, s.num_speculative_tokens, s.jobs_on, s.jobs_off) == ("test-gpu", 2, ["job-a"], ["job-b"])
    assert s.cost_per_million_generated_tokens_on == pytest.approx(2.0)
    assert s.cost_per_million_generated_tokens_off == pytest.approx(2.5)
    assert s.saving_per_million_generated_tokens == pytest.approx(0.5) and s.saving_fraction == pytest.approx(0.2)
    # Acceptance pooled over every job's drafts, as each job's own: A 200 drafts / 200 accepted, C 10 / 15.
    assert (o.num_drafts, o.draft_tokens, o.accepted_tokens) == (210, 430, 215)
    assert o.mean_acceptance_length == pytest.approx(1 + 215 / 210) and o.acceptance_rate == pytest.approx(215 / 430)
    overall_row = terminal_summary(report).splitlines()[2 + len(report.jobs)]
    assert overall_row.startswith("overall") and f"{1 + 215 / 210:.2f}" in overall_row.split()
    assert report.warnings == []
    assert (
        report.prices["gpu"]["test-gpu"] == 2.0 and report.prices["gpu"]["nvidia-h100-80gb"] == 4.0
    )  # --prices adds to the defaults


def test_files_written_csv_and_markdown(three_jobs):
    out, report = three_jobs
    assert sorted(p.name for p in out.iterdir()) == ["report.csv", "report.html", "report.json", "report.md"]
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert [r["job_id"] for r in rows] == ["job-a", "job-b", "job-c"]
    assert float(rows[0]["cost_per_million_total_tokens"]) == pytest.approx(1.6)
    assert rows[0]["accepted_per_position"] == "0.625;0.375" and rows[1]["acceptance_rate"] == ""
    markdown = (out / "report.md").read_text()
    assert "| job-a | succeeded | test-gpu | 2 x 1 | k=2 |" in markdown
    assert "| 250,000 | 40% | 150,000 |" in markdown  # prompt tokens, prefix cache hit rate, prefill computed
    assert rows[0]["cached_prompt_tokens"] == "100000" and float(rows[0]["prefix_cache_hit_rate"]) == pytest.approx(0.4)
    assert "| job-c | succeeded | test-node | 3 replicas, CPU | k=3 |" in markdown  # gpus_per_replica 0: no "x 1" GPU
    assert rows[2]["cpu_only"] == "True" and rows[0]["cpu_only"] == "False"
    assert "+20.0%" in markdown  # the saving of k=2 over off
    # what the console and `specbatch status` say of each verdict, and where each price came from
    assert "| job-a | k=2 | speculation paid, by a calibration: the calibration of T in " in markdown
    assert (
        "| job-c | k=3 | whether speculation paid is not known: the job ran no speculation trial; no calibration"
        in markdown
    )
    prices = f"--prices {out.parent / 'prices.yaml'}"
    assert (
        f"| test-gpu | GPU-hour | 2.0000 | {prices} |" in markdown
        and f"| test-node | node-hour | 0.3600 | {prices} |" in markdown
    )


def test_single_job_report_goes_under_its_output_and_missing_price_is_a_warning(tmp_path, capsys):
    uri = str(tmp_path / "job")
    write_job(
        Storage(),
        uri,
        manifest("job-x", accelerator="unpriced-gpu", replicas=1, gpus=1, wall=60, speculative=False),
        JOB_B,
    )
    assert report_main([uri]) == 0
    report = CostReport.model_validate_json((tmp_path / "job" / "report" / "report.json").read_text())
    (job,) = report.jobs
    assert job.cost is None and job.cost_per_million_generated_tokens is None and report.overall.cost is None
    assert job.tokens_per_second_per_gpu == pytest.approx(400_000 / 60)
    assert any("'unpriced-gpu'" in w for w in report.warnings)
    captured = capsys.readouterr()
    assert "job-x" in captured.out and "unpriced-gpu" in captured.err


def test_a_report_of_cpu_jobs_bills_node_hours(tmp_path, capsys):
    """Replicas without a GPU: no "GPU" in the Markdown, the HTML or the terminal (it said
    "GPU-hours" and "tokens/s per GPU" on a CPU job); a report with a GPU job keeps GPU-hours."""
    uri = str(tmp_path / "job")
    write_job(
        Storage(), uri, manifest("job-cpu", accelerator="cpu", replicas=1, gpus=0, wall=60, speculative=False), JOB_B
    )
    assert report_main([uri]) == 0
    out = tmp_path / "job" / "report"
    markdown, html, terminal = (
        (out / "report.md").read_text(),
        (out / "report.html").read_text(),
        capsys.readouterr().out,
    )
    for text in (markdown, html, terminal):
        assert "GPU" not in text, [line for line in text.splitlines() if "GPU" in line][:3]
    assert "| jobs | generated tokens | prompt tokens | node-hours | busy node-hours |" in markdown
    assert "per node-hour" in markdown and "tokens/s per node" in markdown and "tok/s/node" in terminal


def test_the_throughput_plot_draws_each_attempt_apart():
    """A job resumed after a gap: one line per attempt, named by it (one line was drawn
    through the gap, with nothing marking it)."""
    from pipeline.tools.report_plots import throughput_series

    doc = manifest("job-r", accelerator="cpu", replicas=1, gpus=0, wall=100, speculative=False)
    doc["attempts"] = [
        {"number": 1, "started_at": "1970-01-01T00:16:00+00:00", "status": "interrupted", "skipped_rows": 0},
        {"number": 2, "started_at": "1970-01-01T01:00:00+00:00", "status": "succeeded", "skipped_rows": 20},
    ]
    rows = [unit(f"u{i}", "a", started, 5, 100, 10) for i, started in enumerate((1000, 1010, 3700, 3710, 3720))]
    series = throughput_series(JobData("uri", JobManifest.model_validate(doc), rows))
    assert [(name, [x for x, _ in points]) for name, points in series] == [
        ("job-r, attempt 1", [0, 10]),
        ("job-r, attempt 2", [2700, 2710, 2720]),
    ]
    doc["attempts"] = doc["attempts"][1:]  # one attempt: one line, named by the job
    assert [name for name, _ in throughput_series(JobData("uri", JobManifest.model_validate(doc), rows))] == ["job-r"]


def test_job_whose_drafter_was_turned_off_midway_is_left_out_of_the_comparison():
    guarded = [unit("d-1", "d1", 0, 10, 1000, 100, 10, 20, (5, 3), k=2), unit("d-2", "d1", 10, 10, 1000, 100)]
    jobs = [
        JobData(
            "mem://d",
            JobManifest.model_validate(
                manifest("job-d", accelerator="test-gpu", replicas=1, gpus=1, wall=60, speculative=True, k=2)
            ),
            guarded,
        ),
        JobData(
            "mem://b",
            JobManifest.model_validate(
                manifest("job-b", accelerator="test-gpu", replicas=1, gpus=2, wall=900, speculative=False)
            ),
            JOB_B,
        ),
    ]
    report = build_report(jobs, Prices(gpu={"test-gpu": 2.0}))
    assert report.jobs[0].cost == pytest.approx(2.0 / 60) and report.jobs[1].cost == pytest.approx(1.0)  # both priced
    assert (report.jobs[0].units, report.jobs[0].speculative_units) == (2, 1)
    assert report.speculation == []
    assert any("job-d: the drafter ran for 1 of 2 units" in w for w in report.warnings)


def test_jobs_on_other_prompts_or_sampling_are_not_compared_and_the_report_says_why():
    """A k=2 job and an off job on the same model and accelerator, but on other input files or
    with another sampling: no on/off figure, a warning naming the difference. The same files
    under another folder are the same prompts, and compare."""

    def with_inputs(job_id, speculative, files, sampling):
        doc = manifest(job_id, accelerator="test-gpu", replicas=1, gpus=1, wall=600, speculative=speculative, k=2)
        doc["input_files"] = [
            {"uri": uri, "size": size, "version": "v", "rows": 10, "text_column": "prompt"} for uri, size in files
        ]
        doc["config"]["sampling"] = sampling
        return JobManifest.model_validate(doc)

    greedy, sampled = {"max_tokens": 64, "temperature": 0.0}, {"max_tokens": 64, "temperature": 0.8}
    on = JobData("mem://on", with_inputs("job-on", True, [("s3://a/in/p.parquet", 100)], greedy), JOB_A)
    elsewhere = with_inputs("job-off", False, [("/copies/p.parquet", 100)], greedy)  # the same file, copied
    other_prompts = with_inputs("job-off", False, [("s3://a/in/q.parquet", 100)], greedy)
    other_sampling = with_inputs("job-off", False, [("s3://a/in/p.parquet", 100)], sampled)
    prices = Prices(gpu={"test-gpu": 2.0})

    report = build_report([on, JobData("mem://off", elsewhere, JOB_B)], prices)
    assert [(c.jobs_on, c.jobs_off) for c in report.speculation] == [(["job-on"], ["job-off"])]
    assert report.jobs[0].inputs_sha256 == report.jobs[1].inputs_sha256 and len(report.jobs[0].inputs_sha256) == 64
    for off, differ in ((other_prompts, "prompts (input files)"), (other_sampling, "sampling")):
        report = build_report([on, JobData("mem://off", off, JOB_B)], prices)
        assert report.speculation == []
        assert report.warnings == [
            f"job-on (k=2) is not compared with job-off (speculation off): their {differ} differ, "
            "so their costs do not compare"
        ]
        assert not any("cost" in flag for flag in report.jobs[0].speculation_flags)


def test_missing_job_output_is_refused(tmp_path, capsys):
    assert report_main([str(tmp_path / "nothing")]) == 2
    assert "no _job.json" in capsys.readouterr().err


def test_default_location_for_several_outputs():
    assert (
        default_report_uri(["s3://b/out/daily/2026-11-28/", "s3://b/out/daily/2026-11-29"]) == "s3://b/out/daily/report"
    )
    assert default_report_uri(["/data/x/job"]) == "/data/x/job/report"
    with pytest.raises(ReportError, match="--out"):
        default_report_uri(["s3://one/out", "s3://two/out"])
    with pytest.raises(ReportError, match="--out"):
        default_report_uri(["s3://one/out", "/local/out"])


# ---------------------------------------------------------------- the HTML page in a real browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Browser:
    """Headless Chromium driven through the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self):
        if not os.path.exists(CHROMIUM):
            pytest.fail(f"{CHROMIUM} missing: `make test` installs Debian's chromium")
        self.profile = tempfile.mkdtemp(prefix="specbatch-chromium-")
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-dev-shm-usage",
                f"--user-data-dir={self.profile}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        for _ in range(600):  # Chromium writes its port here once it listens
            if port_file.exists() and port_file.read_text().strip():
                break
            if self.process.poll() is not None:
                pytest.fail(f"chromium exited with {self.process.returncode}")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def load(self, url: str, script: str, width: int | None = None) -> tuple[list[str], object]:
        """Open `url` in a new tab (a window `width` px wide, if given); (console errors and
        uncaught exceptions, value of `script`)."""
        return asyncio.run(self._load(url, script, width))

    async def _load(self, url: str, script: str, width: int | None):
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as response:
                target = await response.json(content_type=None)
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                errors, next_id = [], 0

                async def call(method, **params):
                    nonlocal next_id
                    next_id += 1
                    await ws.send_json({"id": next_id, "method": method, "params": params})
                    while True:
                        message = await asyncio.wait_for(ws.receive_json(), timeout=60)
                        if message.get("id") == next_id:
                            return message.get("result", {})
                        collect(message)

                def collect(message):
                    method, params = message.get("method"), message.get("params", {})
                    if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                        errors.append(
                            "console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                        )
                    elif method == "Runtime.exceptionThrown":
                        details = params["exceptionDetails"]
                        errors.append(
                            "exception: " + details.get("exception", {}).get("description", details.get("text", ""))
                        )
                    elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                        errors.append("log: " + params["entry"]["text"])
                    elif method == "Page.loadEventFired":
                        loaded.append(True)

                loaded: list[bool] = []
                await call("Page.enable")
                await call("Runtime.enable")
                await call("Log.enable")
                if width:
                    await call(
                        "Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False
                    )
                await call("Page.navigate", url=url)
                while not loaded:
                    collect(await asyncio.wait_for(ws.receive_json(), timeout=60))
                result = await call("Runtime.evaluate", expression=script, returnByValue=True)
                # Anything logged while the page settled arrives before this round trip's answer.
                await call("Runtime.evaluate", expression="1")
                return errors, result.get("result", {}).get("value")


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


PLOTS_ON_PAGE = """JSON.stringify([...document.querySelectorAll('svg.plot')].map(svg => {
  const box = svg.getBoundingClientRect();
  return {plot: svg.dataset.plot, width: box.width, height: box.height,
          points: svg.querySelectorAll('circle.point').length, bars: svg.querySelectorAll('rect.bar').length,
          lines: svg.querySelectorAll('path.series').length, visible: getComputedStyle(svg).display !== 'none'};
}))"""


def test_html_report_loads_without_console_errors_and_shows_its_plots(three_jobs, browser):
    out, _ = three_jobs
    html = (out / "report.html").read_text()
    assert "<script" not in html and "http://" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )  # self-contained
    errors, value = browser.load((out / "report.html").as_uri(), PLOTS_ON_PAGE)
    assert errors == []
    plots = {p["plot"]: p for p in json.loads(value)}
    # job A's verdict rests on a calibration: it is drawn; job C's on none
    assert set(plots) == {"acceptance", "throughput", "cost", "calibration-speed-job-a", "calibration-positions-job-a"}
    assert all(p["width"] > 100 and p["height"] > 100 and p["visible"] for p in plots.values())
    assert plots["acceptance"]["points"] == 2 + 3 and plots["acceptance"]["lines"] == 2  # jobs A and C, k=2 and k=3
    assert plots["throughput"]["points"] == 4 + 2 + 1 and plots["throughput"]["lines"] == 3  # one point per unit
    assert plots["cost"]["bars"] == 3  # one bar per job


def test_browser_check_sees_console_errors(tmp_path, browser):
    """The harness itself: a page that logs an error and throws is caught."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><html><head><link rel='icon' href='data:,'></head><body>"
        "<script>console.error('deliberate'); undefinedFunction();</script></body></html>"
    )
    errors, _ = browser.load(page.as_uri(), "1")
    assert any("deliberate" in e for e in errors) and any("undefinedFunction" in e for e in errors)


TABLES_ON_PAGE = """JSON.stringify(Object.fromEntries([...document.querySelectorAll('h2')]\
.filter(h => h.nextElementSibling
  && h.nextElementSibling.tagName === 'TABLE').map(h => {
  const table = h.nextElementSibling;
  const header = [...table.querySelectorAll('thead th')].map(th => th.textContent);
  return [h.textContent, [...table.querySelectorAll('tbody tr')].map(tr =>
    Object.fromEntries([...tr.querySelectorAll('td')].map((td, i) => [header[i], td.textContent])))];
})))"""


def test_html_tables_show_cpu_replicas_and_the_overall_acceptance(three_jobs, browser):
    out, report = three_jobs
    errors, value = browser.load((out / "report.html").as_uri(), TABLES_ON_PAGE)
    assert errors == []
    tables = json.loads(value)
    jobs = {row["job"]: row for row in tables["Jobs"]}
    assert jobs["job-a"]["replicas x GPUs"] == "2 x 1" and jobs["job-b"]["replicas x GPUs"] == "1 x 2"
    assert jobs["job-c"]["replicas x GPUs"] == "3 replicas, CPU"
    (overall,) = tables["Overall"]
    assert (
        overall["mean acceptance length"] == f"{1 + 215 / 210:.3f}" and overall["acceptance rate"] == f"{215 / 430:.3f}"
    )


LONG_ID = "2026-11-29-nightly-llama-3.3-70b-instruct-eagle31-depth-3-on-the-cpu-pool-of-cluster-east"

LEGENDS_ON_PAGE = """JSON.stringify([...document.querySelectorAll('svg.plot')].map(svg => {
  const box = svg.getBoundingClientRect();
  return {plot: svg.dataset.plot, left: box.left, right: box.right, top: box.top, bottom: box.bottom,
          entries: [...svg.querySelectorAll('g.legend-entry')].map(entry => {
            const text = entry.querySelector('text.legend'), r = text.getBoundingClientRect();
            return {label: entry.querySelector('title').textContent, shown: text.textContent,
                    left: r.left, right: r.right, top: r.top, bottom: r.bottom};
          }),
          bar_labels: [...svg.querySelectorAll('text.bar-label')].map(text => {
            const r = text.getBoundingClientRect();
            return {shown: text.textContent, left: r.left, right: r.right, top: r.top, bottom: r.bottom};
          })};
}))"""


def long_id_report(tmp_path) -> None:
    """The report of a job with a long id and job A, in tmp_path/report."""
    uris = [str(tmp_path / "long"), str(tmp_path / "a")]
    write_job(
        Storage(),
        uris[0],
        manifest(LONG_ID, accelerator="test-node", replicas=1, gpus=0, wall=3600, speculative=True, k=3),
        JOB_C,
    )
    write_job(
        Storage(),
        uris[1],
        manifest("job-a", accelerator="test-gpu", replicas=2, gpus=1, wall=1800, speculative=True, k=2),
        JOB_A,
    )
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    assert report_main([*uris, "--prices", str(prices), "--out", str(tmp_path / "report")]) == 0


def test_legend_labels_are_whole_and_inside_their_chart(tmp_path, browser):
    """A job id longer than the legend's old 170 px: the chart widens (or the label wraps) so that
    every label shows in full, inside the chart, in a real browser's layout."""
    long_id_report(tmp_path)
    html = (tmp_path / "report" / "report.html").read_text()
    assert "1 replica, CPU" in html and "…" not in html
    errors, value = browser.load((tmp_path / "report" / "report.html").as_uri(), LEGENDS_ON_PAGE)
    assert errors == []
    charts = {chart["plot"]: chart for chart in json.loads(value)}
    assert set(charts) == {"acceptance", "throughput", "cost"}
    labels = {e["label"] for chart in charts.values() for e in chart["entries"]}
    assert {f"{LONG_ID} (k=3)", "job-a (k=2)", LONG_ID, "job-a", "speculation k=3", "speculation k=2"} <= labels
    for chart in charts.values():
        assert chart["entries"], chart["plot"]
        for entry in chart["entries"]:
            assert entry["shown"].replace(" ", "") == entry["label"].replace(" ", ""), entry  # whole, not cut short
            assert chart["left"] <= entry["left"] and entry["right"] <= chart["right"], (chart["plot"], entry)
            assert chart["top"] <= entry["top"] and entry["bottom"] <= chart["bottom"], (chart["plot"], entry)
    assert charts["acceptance"]["right"] - charts["acceptance"]["left"] > 640  # the legend area grew to fit
    bar_labels = charts["cost"]["bar_labels"]  # the bars' own labels on the left: whole too
    assert sorted(b["shown"] for b in bar_labels) == sorted([LONG_ID, "job-a"])
    for label in bar_labels:
        assert charts["cost"]["left"] <= label["left"] and label["right"] <= charts["cost"]["right"], label
        assert charts["cost"]["top"] <= label["top"] and label["bottom"] <= charts["cost"]["bottom"], label


WIDEST_ON_PAGE = """JSON.stringify({page: document.documentElement.scrollWidth, window: window.innerWidth,
  tables: [...document.querySelectorAll('table')].map(t => [t.previousElementSibling.textContent, \
t.getBoundingClientRect().right])})"""


def test_every_table_of_a_report_fits_a_1280_px_window(tmp_path, browser):
    """The report of a job with a long id, in a window 1,280 px wide: no table runs past its right
    edge and the page needs no horizontal scroll bar (its Jobs table once did)."""
    long_id_report(tmp_path)
    errors, value = browser.load((tmp_path / "report" / "report.html").as_uri(), WIDEST_ON_PAGE, width=1280)
    assert errors == []
    page = json.loads(value)
    assert page["window"] == 1280 and page["page"] <= 1280, page
    assert all(right <= 1280 for _, right in page["tables"]), page["tables"]
