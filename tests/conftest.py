"""Shared, session-scoped fixtures: real Ray, real moto S3 server on loopback, tiny models.

Engines are the expensive part (about 20-40 s each on CPU): tests that need generation share
the job runs below instead of starting their own. A test that starts a vLLM engine (in a job,
a Ray worker, a `specbatch` subprocess or its own process) is marked `engine`, so that
`pytest -m "not engine"` is the quick selection; the engine spotter below fails a test of that
selection that starts one without the mark (in a whole run, it warns).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas.report import CalibrationReport
from tests.ray_cluster import free_port  # noqa: F401 (the tests import it from here)

# The calibration store of the tests' own (pipeline/speculation/calibrations.py), one per test
# process and inherited by its Ray workers and subprocesses: never the user's ~/.cache.
os.environ["SPECBATCH_CALIBRATIONS"] = tempfile.mkdtemp(prefix="specbatch-calibrations-")

# Dummy credentials for moto's S3 server, from the environment like real ones; set before Ray
# starts so that its workers inherit them. No real endpoint is ever contacted.
os.environ.update(
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_DEFAULT_REGION="us-east-1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    RAY_DATA_DISABLE_PROGRESS_BARS="1",
    VLLM_HOST_IP="127.0.0.1",
    # The suite runs in two processes (pytest-xdist), each starting engines; vLLM's default
    # binding ("auto") pins every engine worker on the machine to the same first core
    VLLM_CPU_OMP_THREADS_BIND="nobind",
)


def ray_head_command(gcs_port: int, dashboard_port: int, *extra: str, agent_port: int = 0) -> list[str]:
    """`ray start --head` on 127.0.0.1 (plain `ray start` would turn it into the machine's
    outward address; see tests/ray_cluster.py), with ports of its own: the session's Ray (below)
    already holds the default ones. `agent_port`: the dashboard agent's (0: a free one)."""
    from tests.ray_cluster import LOOPBACK_START

    return [
        sys.executable,
        "-c",
        LOOPBACK_START,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        "--include-dashboard=true",
        "--num-cpus=4",
        "--disable-usage-stats",
        f"--dashboard-agent-listen-port={agent_port or free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        *extra,
    ]


def stop_ray_head(temp_dir: str) -> None:
    """Stop only the Ray started by a test (its processes name its temp dir). `ray stop`
    would stop every Ray on the machine, the test session's own among them."""
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    for proc in procs:
        proc.terminate()
    # Most go within a second; some of Ray's daemons outlive SIGTERM by far longer, and a test's
    # head has nothing to save (waiting 5 s here was most of a stop)
    _, alive = psutil.wait_procs(procs, timeout=1)
    for proc in alive:
        proc.kill()


@pytest.fixture(scope="session")
def ray_head():
    """A Ray head on 127.0.0.1 started with `ray start --head`, for `ray job submit`, with token
    authentication on as a real cluster runs it: the token comes from the environment
    (RAY_AUTH_TOKEN). `env` is what a client needs: RAY_ADDRESS (the Jobs API), RAY_AUTH_MODE
    and the token. Ready when it yields: the head has run a first job (its job agent comes up a
    few seconds after `ray start`). Shared by tests/test_ray_job_submit.py and test_readme.py."""
    import secrets
    import shutil
    import subprocess
    import tempfile
    import time
    from types import SimpleNamespace

    from ray.job_submission import JobSubmissionClient

    gcs_port, dashboard_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        subprocess.run(
            ray_head_command(gcs_port, dashboard_port, f"--temp-dir={temp_dir}"),
            check=True,
            env=env,
            capture_output=True,
            timeout=180,
        )
        client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"})
        deadline, first = time.time() + 180, None
        while True:  # the job agent answers a few seconds after the dashboard; a just-submitted job may 404
            try:
                first = first or client.submit_job(entrypoint="true")
                if client.get_job_status(first).is_terminal():
                    break
            except Exception:
                if time.time() > deadline:
                    raise
            if time.time() > deadline:
                raise TimeoutError(f"the Ray head's first job did not end; its logs: {temp_dir}")
            time.sleep(2)
        HEADS_TO_STOP.append(temp_dir)
        yield SimpleNamespace(
            address=address,
            token=token,
            client=client,
            env={"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
        )
    finally:
        stop_ray_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


# The session's `ray_head`, stopped once the last module of its group has run (see
# pytest_runtest_teardown below): idle, a head with its dashboard takes about 5% of a core.
HEADS_TO_STOP: list[str] = []


S3_SERVER = None  # the running moto server (test_model_cache records the requests it answers)


def serialize_object_puts() -> None:
    """S3 decides a conditional PUT (If-None-Match, If-Match) atomically; moto's server checks the
    condition, then writes, on one thread per request with no lock between, so two PUTs at the
    same instant can both pass (test_lease's race caught it: both runs proceeded). One lock around
    moto's PutObject handler gives the test server the atomicity the real store has."""
    from moto.s3.responses import S3Response

    handler = S3Response.put_object
    if getattr(handler, "serialized", False):
        return
    lock = threading.Lock()

    @functools.wraps(handler)
    def put_object(self, *args, **kwargs):
        with lock:
            return handler(self, *args, **kwargs)

    put_object.serialized = True
    S3Response.put_object = put_object


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1, with a bucket `specbatch`."""
    global S3_SERVER
    import boto3
    from moto.server import ThreadedMotoServer

    serialize_object_puts()
    port = free_port()
    S3_SERVER = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    S3_SERVER.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="specbatch")
    yield endpoint
    S3_SERVER.stop()


RAY_METRICS_PORT = None  # where the local Ray serves Prometheus metrics (scrape_job_metrics reads them)


@pytest.fixture(scope="session")
def ray_local():
    global RAY_METRICS_PORT
    import ray

    RAY_METRICS_PORT = free_port()
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        _node_ip_address="127.0.0.1",
        _metrics_export_port=RAY_METRICS_PORT,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def trained_kit() -> dict[str, str]:
    """The kit's trained target and its EAGLE-3.1 drafter."""
    from tinykit import kit_paths

    kit = kit_paths()
    return {"target": kit["target"], "drafter": kit["drafter_eagle31"]}


@pytest.fixture(scope="session")
def stripped_drafter(tmp_path_factory) -> str:
    """drafter-mismatched as public drafters ship: no declared target."""
    from tinykit import kit_paths

    src, dst = Path(kit_paths()["drafter_mismatched"]), tmp_path_factory.mktemp("stripped") / "drafter"
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "config.json":
            config = {k: v for k, v in json.loads(f.read_text()).items() if not k.startswith("specbatch_")}
            (dst / "config.json").write_text(json.dumps(config))
        else:
            os.symlink(f.resolve(), dst / f.name)
    return str(dst)


@pytest.fixture(scope="session")
def random_kit(tmp_path_factory) -> dict[str, str]:
    """Random weights: the drafter accepts nothing (acceptance 0)."""
    from tinykit.random_kit import build_random_kit

    return build_random_kit(str(tmp_path_factory.mktemp("random-kit")))


@pytest.fixture(scope="session")
def zero_kit(tmp_path_factory) -> dict[str, str]:
    """lm_head of target and drafter zeroed: both always pick token 0, acceptance exactly 1."""
    from tinykit.random_kit import build_random_kit

    return build_random_kit(str(tmp_path_factory.mktemp("zero-kit")), zero_lm_head=True)


def write_prompts(path: Path | str, columns: dict, filesystem=None) -> None:
    table = pa.table(columns)
    if filesystem is None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), filesystem=filesystem)


def calibration_report(rows: list, **fields) -> CalibrationReport:
    """A calibration report as `specbatch calibrate` writes one: a CPU calibration of 64 prompts
    at up to 32 sequences at once, recommending off, with `rows` and `fields` as a test needs."""
    measured = dict(
        config_uri="job.yaml",
        measured_at="2026-12-07T00:00:00+00:00",
        accelerator="cpu",
        gpus_per_replica=1.0,
        currency="USD",
        price_per_gpu_hour=0.2,
        max_num_seqs=32,
        sample_requested=64,
        sample_measured=64,
        concurrencies=[32],
        recommended_depth=0,
        config_snippet="",
    )
    return CalibrationReport(**{**measured, "rows": rows, **fields})


def speculation_surfaces(config_path: str, capsys) -> dict[str, str]:
    """What each surface of the finished job of `config_path` says of its speculation: `_job.json`,
    the console's summary, `specbatch status`, the report, the data set card and the dry run of
    the same config (which runs nothing, and so repeats the job's verdict). Each as printed."""
    import re

    from pipeline.cli import main
    from pipeline.commit.outputs import OutputLocation
    from pipeline.config import load_config
    from pipeline.job.console import summary
    from pipeline.storage import Storage
    from pipeline.tools.cost import job_figures, read_job
    from pipeline.tools.data_card import write_data_card
    from pipeline.tools.prices import load_prices
    from pipeline.tools.status import job_status
    from schemas.plan import DryRunPlan

    config, storage = load_config(config_path), Storage()
    manifest = OutputLocation(storage, config.output_uri).job_manifest()
    card = write_data_card(config, "specbatch run job.yaml")  # as `specbatch run` writes it at the job's end
    capsys.readouterr()
    assert main(["run", config_path, "--dry-run", "--json"]) == 0
    out = capsys.readouterr().out
    plan = DryRunPlan.model_validate_json(out[re.search(r"(?m)^\{$", out).start() :])
    return {
        "_job.json": manifest.speculation.text,
        "console": next(line.split("verdict", 1)[1].strip() for line in summary(manifest) if "  verdict  " in line),
        "status": job_status(storage, config.output_uri).speculation_verdict,
        "report": job_figures(read_job(storage, config.output_uri), load_prices()).speculation_verdict,
        "data card": re.search(r"(?m)^\| speculation \| [^:]*: (.*) \|$", card).group(1),
        "dry run": plan.speculation.removeprefix("nothing left to run; the job's verdict stays: "),
    }


def job_config(input_uri: str, output_uri: str, kit: dict, **overrides) -> dict:
    """A job config on the tiny models in eager fp32 (what the tests run). The drafter probe and
    the acceptance guard are off: the random kit accepts nothing, a probe costs an engine start
    per job, and both have their own tests (test_speculation.py, test_guard.py)."""
    config = {
        "job_name": "test",
        "input_uri": input_uri,
        "output_uri": output_uri,
        "model": {"path": kit["target"]},
        "speculative": {
            "enabled": True,
            "drafter": kit["drafter"],
            "num_speculative_tokens": 3,
            "probe": {"rows": 0},
            "guard": None,
        },
        # a quarter GiB of KV cache holds 64 sequences of 256 tokens and is filled in well under
        # a second at each engine start, where 1 GiB took about 4 s
        "engine": {
            "dtype": "float32",
            "max_model_len": 256,
            "max_num_seqs": 32,
            "enforce_eager": True,
            "cpu_kv_cache_gib": 0.25,
        },
        "sampling": {"max_tokens": 16, "temperature": 0.0},
        "resources": {"replicas": 1, "rows_per_unit": 16, "units_in_flight": 2},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key] = {**config.get(key, {}), **value}
        else:
            config[key] = value
    return config


# ---------------------------------------------------------------- one small job, read by two modules

# test_status.py reads it as a finished job, test_guard.py for the guard's `warn` and the metrics
# (GROUPS below keeps the two modules in one process, so the job runs once).
RANDOM_JOB_ROWS = 28  # 4 units of 8, 8, 8, 4 rows
RANDOM_JOB_NULL_ID = 26  # a row with a good prompt and a null id: a row error too, not a refusal of the input
# row -> (prompt, max_tokens): 2 empty_prompt, 1 invalid_sampling, 1 invalid_id
RANDOM_JOB_BAD = {1: ("   ", None), 10: (None, None), 20: ("ok", 0), RANDOM_JOB_NULL_ID: ("def f(x):", None)}
RANDOM_JOB_ERRORS = {"empty_prompt": 2, "invalid_sampling": 1, "invalid_id": 1}
RANDOM_JOB_GUARD = {"min_acceptance_rate": 0.5, "window_units": 2, "action": "warn"}
# The good prompts share this header (about 110 tokens): the units after the first two find it in
# vLLM's prefix cache, in 32-token blocks (the CPU build's default of 128 is more than a prompt holds)
RANDOM_JOB_HEADER = (
    "# Helpers for lists, strings and numbers: each function takes one argument and returns a value.\n" * 4
)
RANDOM_JOB_BLOCK_SIZE = 32


@pytest.fixture(scope="session")
def random_kit_job(tmp_path_factory, ray_local, random_kit):
    """28 rows on the random kit (its drafter accepts nothing) in 4 units, 4 of them bad, one in
    each unit, under a `warn` guard that its acceptance of 0 sets off; the good rows share a long
    prefix (RANDOM_JOB_HEADER). Returns the folder (job.yaml, in/, out/), the manifest, and the
    local Ray's metrics text once the job's rows are counted there, read right after the job: a
    gauge leaves the endpoint soon after its actor is gone."""
    from pipeline.config import parse_config
    from pipeline.job.runner import run_job

    import yaml

    root = tmp_path_factory.mktemp("random-kit-job")
    bad = RANDOM_JOB_BAD
    write_prompts(
        root / "in" / "p.parquet",
        {
            "id": [None if i == RANDOM_JOB_NULL_ID else f"r{i}" for i in range(RANDOM_JOB_ROWS)],
            "prompt": [
                bad[i][0] if i in bad else f"{RANDOM_JOB_HEADER}def function_{i}(x):\n    return"
                for i in range(RANDOM_JOB_ROWS)
            ],
            "max_tokens": pa.array([bad[i][1] if i in bad else None for i in range(RANDOM_JOB_ROWS)], pa.int64()),
        },
    )
    data = job_config(
        str(root / "in"),
        str(root / "out"),
        random_kit,
        sampling={"max_tokens": 8},
        resources={"rows_per_unit": 8},  # auto leaves it ungrouped: the header is found in any order
        retries={"max_error_fraction": 0.5},
        speculative={"guard": RANDOM_JOB_GUARD},
        engine={"extra_args": {"block_size": RANDOM_JOB_BLOCK_SIZE}},
    )
    (root / "job.yaml").write_text(yaml.safe_dump(data))
    manifest = run_job(parse_config(data), progress=False)
    assert manifest.status == "succeeded"
    return root, manifest, scrape_job_metrics(manifest.job_id, manifest.totals.output_rows)


def job_metric(text: str, name: str, job_id: str) -> dict[str, float]:
    """Values of the Prometheus metric `name` for this job, by replica."""
    import re

    pattern = re.compile(rf"^{name}{{(?P<labels>[^}}]*)}} (?P<value>\S+)$", re.M)
    values = {}
    for match in pattern.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        if labels.get("job_id") == job_id:
            values[labels["replica"]] = float(match["value"])
    return values


def scrape_job_metrics(job_id: str, output_rows: int) -> str:
    """The local Ray's metrics text once the job's rows are all counted there (Ray exports
    periodically), or after a minute."""
    import urllib.request

    deadline = time.time() + 60
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{RAY_METRICS_PORT}/metrics", timeout=10) as response:
            text = response.read().decode()
        rows = job_metric(text, "ray_specbatch_rows_done_total", job_id)
        gauges = job_metric(text, "ray_specbatch_acceptance_rate", job_id)
        if (sum(rows.values()) == output_rows and gauges) or time.time() > deadline:
            return text
        time.sleep(1)


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path, s3_endpoint):
    """An empty output location, on local files and on moto S3."""
    from pipeline.commit.outputs import OutputLocation
    from pipeline.storage import Storage

    if request.param == "local":
        return OutputLocation(Storage(), str(tmp_path / "out"))
    return OutputLocation(Storage(endpoint_url=s3_endpoint), f"s3://specbatch/location-{tmp_path.name}")


def record_s3_requests(monkeypatch) -> list[tuple[str, str]]:
    """Every S3 request s3fs sends from now on, as (operation, key or prefix), recorded at its
    one entry point (`_call_s3`)."""
    import s3fs

    calls = []
    original = s3fs.S3FileSystem._call_s3

    async def recording(self, method, *args, **kwargs):
        calls.append((method, kwargs.get("Key") or kwargs.get("Prefix") or ""))
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", recording)
    return calls


# ---------------------------------------------------------------- the `engine` mark, held


class EngineSpotter(threading.Thread):
    """Every vLLM EngineCore process that appears on this machine, seen by its process title
    (VLLM::EngineCore), once a second: the tests' engines run in Ray workers and in `specbatch`
    subprocesses, not only under pytest's own process, and most are gone when their test ends."""

    def __init__(self):
        super().__init__(name="engine-spotter", daemon=True)
        self.seen: set[tuple[int, float]] = set()

    def run(self) -> None:
        while True:
            self.look()
            time.sleep(1.0)

    def look(self) -> None:
        import psutil

        for proc in psutil.process_iter(["cmdline", "create_time"]):
            if "VLLM::EngineCore" in " ".join(proc.info["cmdline"] or ()) and self.ours(proc):
                self.seen.add((proc.pid, proc.info["create_time"]))

    @staticmethod
    def ours(proc) -> bool:
        """Started by this test process, not by the other one running beside it: every process
        a test starts (Ray workers included) inherits the test process's environment."""
        import psutil

        try:
            return proc.environ().get("PYTEST_XDIST_WORKER") == os.environ.get("PYTEST_XDIST_WORKER")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def started_since(self, since: float) -> int:
        return sum(1 for _, created in self.seen if created >= since)


SPOTTER = EngineSpotter()
ENGINE_CHECK_SINCE = pytest.StashKey[float]()


def pytest_configure(config):
    SPOTTER.start()


# ---------------------------------------------------------------- two test processes

# `make test` runs the suite in two processes (pytest -n 2): an engine's start-up is mostly one
# process importing vLLM at a time (the engine actor, then EngineCore, then its worker), which
# leaves the other core idle. A module's tests stay in one process (they share its job runs); the
# modules that kill engines, drivers and nodes run one after another in one process, so that the
# other process never runs two of them at once; modules that share a session fixture that starts
# engines or a Ray run in one process too, or each process would start its own. The longest go first.
GROUPS = {
    "test_resilience.py": "faults",
    "test_multinode.py": "faults",
    "test_status.py": "random-kit-job",
    "test_guard.py": "random-kit-job",
    "test_readme.py": "ray-head",
    "test_ray_job_submit.py": "ray-head",
}
LONGEST_FIRST = (
    "test_resilience.py",
    "test_multinode.py",
    "test_hangs.py",
    "test_storage_outage.py",
    "test_calibrate.py",
    "test_speculation.py",
    "test_trial.py",
    "test_readme.py",
    "test_job.py",
    "test_sampling.py",
    "test_guard.py",
    "test_prefix_groups.py",
    "test_ray_job_submit.py",
)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-by-scope scheduling, a scope being a module or one of GROUPS. (Its own
    `--dist loadgroup` marks are lost on pytest 9.2, which no longer reads the node id it sets.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return GROUPS.get(module.rsplit("/", 1)[-1], module)

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items):
    def scope(name: str) -> str:
        return GROUPS.get(name, name)

    def module_rank(name: str) -> int:
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    modules = {item.path.name for item in items}
    scope_rank = {scope(m): min(module_rank(n) for n in modules if scope(n) == scope(m)) for m in modules}
    with_engines = {scope(item.path.name) for item in items if item.get_closest_marker("engine")}

    def rank(item) -> tuple:  # the module's, so that its tests keep their order; a group's modules side by side
        name = item.path.name
        return scope_rank[scope(name)], scope(name) not in with_engines, scope(name), module_rank(name)

    items.sort(key=rank)  # stable; xdist then hands out modules in this order (--no-loadscope-reorder)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked `engine` that started one (its module's fixtures included) fails at teardown."""
    item.stash[ENGINE_CHECK_SINCE] = time.time() - 1.0  # a process's start time is rounded
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """In the quick selection (-m "not engine") a test that started an engine fails; in a whole
    run it is a warning in the summary, so that a mark missed costs no landing. And after the last
    test of the `ray_head` group (its modules run side by side, in one process), the head stops."""
    yield
    group = GROUPS.get(item.path.name)
    if HEADS_TO_STOP and group == "ray-head" and (nextitem is None or GROUPS.get(nextitem.path.name) != group):
        for temp_dir in HEADS_TO_STOP:
            stop_ray_head(temp_dir)
        HEADS_TO_STOP.clear()
    if item.get_closest_marker("engine") is not None:
        return
    SPOTTER.look()  # an engine still starting is seen now; one that came and went, by the thread
    started = SPOTTER.started_since(item.stash[ENGINE_CHECK_SINCE])
    if not started:
        return
    message = (
        f"{item.nodeid} started {started} vLLM engine(s) but is not marked engine: mark it "
        "@pytest.mark.engine (or its module with pytestmark), so that -m 'not engine' stays quick"
    )
    if "not engine" in (item.config.getoption("markexpr") or ""):
        pytest.fail(message)
    warnings.warn(pytest.PytestWarning(message))
