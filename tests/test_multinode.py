"""specbatch on a real multi-node Ray cluster: a head and worker nodes started with `ray start`
on 127.0.0.1 (tests/ray_cluster.py), each with its own raylet and object store. Engines may run
only on nodes with the custom resource `engine_slot` (the head has none), so where they run is
known. The job runs as `specbatch run` joining the cluster through RAY_ADDRESS, as under
`ray job submit`. One cluster serves the whole module; tests add and kill worker nodes.

A node is lost the way a spot node is: SIGKILL to its raylet and every process under it (its
workers, the engine actor, vLLM's EngineCore) at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.graph import engine_actor_label
from pipeline.commit.outputs import OutputLocation
from pipeline.storage import Storage
from tests.conftest import job_config, write_prompts
from tests.ray_cluster import LocalCluster, Node
from tests.test_resilience import assert_exactly_once, titled_processes

SPECBATCH = str(Path(sys.executable).with_name("specbatch"))


@pytest.fixture(scope="module")
def cluster():
    cluster = LocalCluster(head_cpus=4)
    try:
        cluster.add_node("a", {"engine_slot": 1})
        cluster.add_node("b", {"engine_slot": 1})
        yield cluster
    finally:
        cluster.shutdown()


def engine_nodes(cluster: LocalCluster, count: int) -> None:
    """Exactly `count` live worker nodes with an engine slot (starting or killing nodes)."""
    names = cluster.engine_nodes()
    for name in names[count:]:
        cluster.kill_node(name, wait_dead=True)  # or the next actor may be placed on it
    for i in range(count - len(names)):
        cluster.add_node(f"w{len(cluster.nodes)}{i}{int(time.time()) % 1000}", {"engine_slot": 1})


def write_job(
    tmp_path: Path, kit: dict, output_uri: str, units: int, rows_per_unit: int = 16, s3: str | None = None, **overrides
) -> tuple[Path, list[str]]:
    ids = [f"id-{i:05d}" for i in range(units * rows_per_unit)]
    columns = {"id": ids, "prompt": [f"def f{i}(a, b):" for i in range(len(ids))]}
    input_uri = f"s3://specbatch/{tmp_path.name}/in" if s3 else str(tmp_path / "in")
    if s3:
        write_prompts(
            f"specbatch/{tmp_path.name}/in/p.parquet",
            columns,
            filesystem=Storage(endpoint_url=s3).fs("s3://specbatch")[0],
        )
    else:
        write_prompts(tmp_path / "in" / "p.parquet", columns)
    models = str(Path(kit["target"]).parent)  # the kit is on a folder every node sees: declared shared
    resources = {
        "replicas": 2,
        "rows_per_unit": rows_per_unit,
        "units_in_flight": 2,
        "resources_per_replica": {"engine_slot": 1},
    }
    config = job_config(
        input_uri,
        output_uri,
        kit,
        sampling={"max_tokens": 32, "temperature": 0.0, "ignore_eos": True},
        resources={**resources, **overrides.pop("resources", {})},
        storage={"shared_mounts": [models, str(tmp_path)], **({"endpoint_url": s3} if s3 else {})},
        **overrides,
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, ids


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_cli(
    cluster: LocalCluster, config: Path, timeout: float = 300, background: bool = False
) -> subprocess.CompletedProcess:
    """`specbatch run` to its end; a run that does not end in time fails the test with its output.
    `background`: started as a shell or scheduler starts a background job, with SIGINT ignored."""
    try:
        return subprocess.run(
            [SPECBATCH, "run", str(config)],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=ignore_sigint if background else None,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"specbatch run did not end in {timeout:g} s:\n{(exc.stderr or b'')[-4000:]}") from None


def start(cluster: LocalCluster, config: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [SPECBATCH, "run", str(config), *flags],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def engine_core_on(cluster: LocalCluster, node: Node) -> bool:
    """Whether vLLM's EngineCore runs on the node (its engine actor is starting its engine)."""
    on_node = {proc.pid for proc in cluster.node_processes(node)}
    return any(pid in on_node for pid in titled_processes("VLLM::EngineCore"))


def commits_by_node(location: OutputLocation) -> dict[str, int]:
    """node_id -> units committed by engines on that node, from the commit markers."""
    fs, path = location.storage.fs(location.uri)
    counts: dict[str, int] = {}
    for marker in fs.glob(f"{path}/_commits/*.json"):
        try:
            node = json.loads(fs.cat_file(marker))["stats"]["node_id"]
        except (FileNotFoundError, ValueError):
            continue
        counts[node] = counts.get(node, 0) + 1
    return counts


def wait_until(condition, proc: subprocess.Popen, timeout: float = 400, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"not in time: {what}")


@pytest.fixture(scope="module")
def node_lost_run(tmp_path_factory, cluster, random_kit, s3_endpoint):
    """Two replicas on two worker nodes, each engine on its own node; then one node is lost
    mid-job. Returns what the test below reads; the tensor-parallel test compares its outputs."""
    tmp_path = tmp_path_factory.mktemp("node-lost")
    engine_nodes(cluster, 2)
    a, b = (cluster.nodes[name] for name in cluster.engine_nodes())
    uri = f"s3://specbatch/{tmp_path.name}/out"
    # Enough units that the job still runs when the GCS declares the node dead (about 5 s here:
    # tests/ray_cluster.py), so that the driver sees the loss while it runs.
    units = 40
    config, ids = write_job(tmp_path, random_kit, uri, units=units, s3=s3_endpoint)
    location = OutputLocation(Storage(endpoint_url=s3_endpoint), uri)
    proc = start(cluster, config)
    wait_until(
        lambda: {a.node_id, b.node_id} <= set(commits_by_node(location)), proc, what="both nodes committed a unit"
    )
    cluster.kill_node(next(name for name, n in cluster.nodes.items() if n is b))
    # read once b's processes are gone (a marker b sent just before has landed by then): a read
    # before the kill missed two units b committed in the instant between (a landing run's failure)
    time.sleep(1.0)
    before = commits_by_node(location)
    assert sum(before.values()) < units  # b had units in flight (two per engine), and work was left
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    return location, ids, a, b, before, units


@pytest.mark.engine
def test_engines_on_two_nodes_and_a_node_lost_mid_job(node_lost_run):
    """The job finishes on the other node, every id exactly once, and `_job.json` names the
    lost node."""
    location, ids, a, b, before, units = node_lost_run
    uri = location.uri
    assert_exactly_once(location, ids)
    stats = location.read_table("stats")
    by_node = {node: stats.column("node_id").to_pylist().count(node) for node in (a.node_id, b.node_id)}
    assert by_node[a.node_id] > 0 and by_node[b.node_id] == before[b.node_id]  # b committed nothing after its death
    assert len(set(stats.column("actor_id").to_pylist())) >= 2
    manifest = json.loads(location.storage.read_bytes(f"{uri}/_job.json"))
    assert manifest["status"] == "succeeded"
    (loss,) = manifest["attempts"][-1]["node_losses"]
    assert loss["node_id"] == b.node_id and loss["address"] == "127.0.0.1"
    # counted when the driver saw b gone (the GCS declares it dead some seconds after the kill)
    assert 0 <= loss["units_not_committed"] <= units - sum(before.values())
    assert loss["recovery"] in ("ray-data-retried", "graph-rebuilt")


@pytest.mark.engine
def test_a_pool_grows_onto_a_node_that_joins_mid_job(tmp_path, cluster, random_kit):
    """replicas {min: 1, max: 2} starts on the one engine node there is; a node that joins
    mid-job, once the first engine is starting, gets the second engine, which commits units."""
    engine_nodes(cluster, 1)
    (first,) = (cluster.nodes[name] for name in cluster.engine_nodes())
    # 96 units: the first engine alone takes about twice as long as the second needs to start once
    # the first is ready (with 64 and the node joining after the first commit, a quiet machine's
    # first engine finished them all before)
    config, ids = write_job(
        tmp_path, random_kit, str(tmp_path / "out"), units=96, resources={"replicas": {"min": 1, "max": 2}}
    )
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    proc = start(cluster, config)
    wait_until(lambda: engine_core_on(cluster, first), proc, what="the first engine starting on its node")
    joined = cluster.add_node(f"joined{int(time.time()) % 1000}", {"engine_slot": 1})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert_exactly_once(location, ids)
    nodes = location.read_table("stats").column("node_id").to_pylist()
    assert nodes.count(joined.node_id) >= 1, f"the joined node committed nothing: {sorted(set(nodes))}"
    assert nodes.count(first.node_id) >= 1


@pytest.mark.engine
def test_local_paths_on_a_cluster_are_refused_before_any_engine(tmp_path, cluster, random_kit):
    config, _ = write_job(tmp_path, random_kit, str(tmp_path / "out"), units=1)
    data = yaml.safe_load(config.read_text())
    data["storage"]["shared_mounts"] = [
        str(Path(random_kit["target"]).parent)
    ]  # the models are shared, the job's folder not
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run([SPECBATCH, "run", str(config)], env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"output_uri = {tmp_path / 'out'}" in done.stderr and f"input_uri = {tmp_path / 'in'}" in done.stderr
    assert "s3://" in done.stderr and "storage.shared_mounts" in done.stderr
    assert "model.path" not in done.stderr
    assert not (tmp_path / "out" / "_job.json").exists()


@pytest.mark.engine
def test_a_graph_that_cannot_fit_is_refused_naming_what_is_missing(tmp_path, cluster, random_kit):
    """Worker nodes have 2 CPUs each: an engine of 3 CPUs fits on none, and no autoscaler can add one."""
    config, _ = write_job(
        tmp_path, random_kit, str(tmp_path / "out"), units=1, resources={"cpus_per_replica": 3, "replicas": 1}
    )
    started = time.time()
    done = subprocess.run([SPECBATCH, "run", str(config)], env=cluster.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "cannot be scheduled" in done.stderr and "engine replica 1 of 1 needs {CPU: 3, engine_slot: 1}" in done.stderr
    )
    assert "no autoscaler" in done.stderr
    assert time.time() - started < 120  # refused, not waited for
    assert not (tmp_path / "out" / "_job.json").exists()


HOLD_SLOTS = """
import ray, sys
ray.init(logging_level="ERROR", namespace="test-holders")
@ray.remote(resources={"engine_slot": 1}, num_cpus=0)
class Holder:
    def ready(self): return True
holders = [Holder.options(name=f"holder-{i}", lifetime="detached").remote() for i in range(int(sys.argv[1]))]
ray.get([h.ready.remote() for h in holders])
"""
RELEASE_SLOTS = """
import ray, sys
ray.init(logging_level="ERROR", namespace="test-holders")
for i in range(int(sys.argv[1])):
    ray.kill(ray.get_actor(f"holder-{i}"))
"""


@pytest.mark.engine
def test_a_job_whose_engines_never_get_resources_stops_with_a_named_error(tmp_path, cluster, random_kit):
    """Another job holds every engine slot: the graph fits the cluster, but its engine waits.
    After retries.stall_minutes without a commit the job stops, naming what waits."""
    engine_nodes(cluster, 1)
    subprocess.run([sys.executable, "-c", HOLD_SLOTS, "1"], env=cluster.env, check=True, timeout=120)
    try:
        config, _ = write_job(
            tmp_path,
            random_kit,
            str(tmp_path / "out"),
            units=2,
            resources={"replicas": 1},
            retries={"stall_minutes": 0.4},
        )
        done = run_cli(cluster, config, background=True)  # the stall watch must not rely on SIGINT
    finally:
        subprocess.run([sys.executable, "-c", RELEASE_SLOTS, "1"], env=cluster.env, check=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "specbatch: job failed: no unit committed for" in done.stderr, done.stderr[-3000:]
    assert f"waits for resources: actor MapWorker({engine_actor_label()})" in done.stderr, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "_job.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"].startswith("SchedulingStalled: no unit committed for")
    assert manifest["totals"]["output_rows"] == 0


@pytest.mark.engine
def test_a_tensor_parallel_engine_on_the_cpu_build(tmp_path, cluster, random_kit, node_lost_run):
    """TP=2 on vLLM's CPU build: two workers under vLLM's multiprocessing executor on the engine
    actor's node (the CPU build has no Ray executor), the actor holding 2 CPUs of one node;
    the greedy outputs equal those of the TP=1 engines of the node-loss job, whose first rows
    are the same prompts with the same sampling."""
    engine_nodes(cluster, 1)
    config, ids = write_job(
        tmp_path,
        random_kit,
        str(tmp_path / "out"),
        units=2,
        resources={"replicas": 1, "cpus_per_replica": 2},
        engine={"tensor_parallel_size": 2, "cpu_omp_threads_bind": "nobind"},
    )
    done = subprocess.run([SPECBATCH, "run", str(config)], env=cluster.env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    location = OutputLocation(Storage(), str(tmp_path / "out"))
    assert_exactly_once(location, ids)

    def texts(location: OutputLocation) -> dict[str, str]:
        table = location.read_table("outputs")
        return dict(zip(table.column("id").to_pylist(), table.column("text").to_pylist()))

    tp1 = texts(node_lost_run[0])
    assert texts(location) == {i: tp1[i] for i in ids}


PUBLISH_NODE_GROUP = """
import sys, ray, ray._raylet as raylet
from ray.core.generated import autoscaler_pb2
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put
ray.init(logging_level="ERROR")
key, namespace = raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode()
if sys.argv[1] == "publish":
    group = autoscaler_pb2.NodeGroupConfig(name="big", resources={"CPU": 4, "big_node": 1}, min_count=0, max_count=2)
    _internal_kv_put(key, autoscaler_pb2.ClusterConfig(node_group_configs=[group]).SerializeToString(), \
overwrite=True, namespace=namespace)
else:
    _internal_kv_del(key, namespace=namespace)
"""


@pytest.mark.engine
def test_nodes_the_autoscaler_may_add_count_and_a_wait_for_them_ends(tmp_path, cluster, random_kit):
    """An engine that needs a `big_node` no node has is refused; once the cluster's autoscaler
    says it may add such nodes, the job is accepted and waits for one. No autoscaler runs here
    (it would start cloud instances): its node groups are published in the GCS where autoscalers
    publish them (the autoscaler state namespace), which is what the job reads. No node comes,
    so the stall watch ends the wait."""
    config, _ = write_job(
        tmp_path,
        random_kit,
        str(tmp_path / "out"),
        units=1,
        resources={"replicas": 1, "resources_per_replica": {"big_node": 1}},
        retries={"stall_minutes": 0.3},
    )
    refused = subprocess.run(
        [SPECBATCH, "run", str(config)], env=cluster.env, capture_output=True, text=True, timeout=300
    )
    assert (
        refused.returncode == 2
        and "needs {CPU: 1, big_node: 1}" in refused.stderr
        and "no autoscaler" in refused.stderr
    )
    subprocess.run([sys.executable, "-c", PUBLISH_NODE_GROUP, "publish"], env=cluster.env, check=True, timeout=120)
    try:
        waited = run_cli(cluster, config, background=True)
    finally:
        subprocess.run([sys.executable, "-c", PUBLISH_NODE_GROUP, "delete"], env=cluster.env, check=True, timeout=120)
    assert waited.returncode == 1, waited.stderr[-3000:]
    assert f"waits for resources: actor MapWorker({engine_actor_label()})" in waited.stderr
