"""What the job asks of a Ray cluster, checked without one where no cluster is needed: the
schedulability packing, the placement groups of engines of several devices (requested on the
session's real Ray and read back from its placement group table), and relative paths.
tests/test_multinode.py runs the same checks through `specbatch run` on a real cluster."""

from __future__ import annotations

import fsspec
import pytest
import yaml

from pipeline.cluster import Unschedulable, check_schedulable, engine_remote_args, engine_task_options
from pipeline.config import ConfigError, load_config, parse_config
from pipeline.stages.engine import engine_kwargs
from tests.conftest import job_config

KIT = {"target": "/models/target", "drafter": "/models/drafter"}


def config(**overrides):
    return parse_config(job_config("s3://b/in", "s3://b/out", KIT, **overrides))


def test_the_two_cpu_head_of_ray_job_submit():
    """One replica fits a 2-CPU node (1 + 0.5 + 0.25 CPUs); two do not, and the refusal says
    which actor is left over and what the graph holds."""
    head = [{"CPU": 2.0, "memory": 1e9}]
    check_schedulable(config(), head, [])
    with pytest.raises(Unschedulable) as refused:
        check_schedulable(config(resources={"replicas": 2}), head, [])
    message = str(refused.value)
    assert "preprocess actor 1 needs {CPU: 0.5}" in message and "holds 2.75 CPUs" in message
    assert "no autoscaler" in message and "{CPU: 2}" in message


def test_custom_resources_and_what_an_autoscaler_may_add():
    job = config(resources={"resources_per_replica": {"gpu_node": 1}, "replicas": {"min": 2, "max": 8}})
    cpu_only = [{"CPU": 8.0}]
    with pytest.raises(Unschedulable, match=r"engine replica 1 of 2 needs \{CPU: 1, gpu_node: 1\}"):
        check_schedulable(job, cpu_only, [])
    check_schedulable(job, cpu_only, [{"CPU": 4.0, "gpu_node": 1.0}] * 2)  # the autoscaler's group: two such nodes
    with pytest.raises(Unschedulable, match="its autoscaler may add"):
        check_schedulable(job, cpu_only, [{"CPU": 4.0, "gpu_node": 1.0}])


def test_tensor_parallel_needs_one_node_pipeline_parallel_may_spread():
    one_gpu_nodes = [{"CPU": 4.0, "GPU": 1.0}] * 2 + [{"CPU": 4.0}]
    tp = config(engine={"tensor_parallel_size": 2}, resources={"gpus_per_replica": 2})
    with pytest.raises(Unschedulable, match=r"2 x \{CPU: 0.5, GPU: 1\} \(STRICT_PACK\)"):
        check_schedulable(tp, one_gpu_nodes, [])
    check_schedulable(tp, [{"CPU": 4.0, "GPU": 2.0}, {"CPU": 4.0}], [])
    pp = config(engine={"pipeline_parallel_size": 2, "pipeline_placement": "SPREAD"}, resources={"gpus_per_replica": 2})
    check_schedulable(pp, one_gpu_nodes, [])


def test_parallel_engines_are_validated():
    with pytest.raises(
        ConfigError,
        match=r"gpus_per_replica \(4\) must be engine.tensor_parallel_size x engine.pipeline_parallel_size \(2\)",
    ):
        config(engine={"pipeline_parallel_size": 2}, resources={"gpus_per_replica": 4})
    with pytest.raises(ConfigError, match=r"resources.replicas: min \(3\) is larger than max \(2\)"):
        config(resources={"replicas": {"min": 3, "max": 2}})
    with pytest.raises(ConfigError, match="resources_per_replica.GPU"):
        config(resources={"resources_per_replica": {"GPU": 1}})
    with pytest.raises(ConfigError, match=r"cpus_per_replica \(1\) is below the engine's 2 workers"):
        config(engine={"tensor_parallel_size": 2})
    kwargs = engine_kwargs(config(engine={"tensor_parallel_size": 2}, resources={"gpus_per_replica": 2}))
    assert kwargs["distributed_executor_backend"] == "ray" and kwargs["tensor_parallel_size"] == 2
    assert "distributed_executor_backend" not in engine_kwargs(config())
    # vLLM's CPU build has no Ray executor: its own multiprocessing executor, on the actor's node
    cpu_tp = config(engine={"tensor_parallel_size": 2}, resources={"cpus_per_replica": 2})
    assert "distributed_executor_backend" not in engine_kwargs(cpu_tp)
    assert engine_remote_args(cpu_tp) == dict(num_cpus=2, num_gpus=0, resources=None)
    # the CPU build's KV cache is sized by the config; a GPU's by gpu_memory_utilization
    assert engine_kwargs(config(engine={"cpu_kv_cache_gib": 0.5}))["kv_cache_memory_bytes"] == 2**29
    assert "kv_cache_memory_bytes" not in kwargs


@pytest.mark.parametrize(
    "engine, strategy",
    [
        ({"tensor_parallel_size": 2}, "STRICT_PACK"),
        ({"pipeline_parallel_size": 2}, "PACK"),
        ({"pipeline_parallel_size": 2, "pipeline_placement": "SPREAD"}, "SPREAD"),
    ],
)
def test_a_gpu_engine_of_several_devices_gets_a_placement_group_of_its_own(ray_local, engine, strategy):
    """Ray Data calls `ray_remote_args_fn` for each engine actor it creates; the group it makes
    is read back from the GCS's placement group table: one bundle per GPU, the strategy. There
    is no GPU here (vLLM's CPU build has no Ray executor to run such an engine anyway): the
    group waits, as on a cluster without such nodes."""
    import ray

    job = config(engine=engine, resources={"gpus_per_replica": 2, "resources_per_replica": {"pool": 1}})
    args = engine_remote_args(job)
    assert args["num_gpus"] == 0  # the GPU workers vLLM starts take the GPUs, inside the group
    group = args["ray_remote_args_fn"]()["scheduling_strategy"].placement_group
    try:
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == strategy and table["state"] == "PENDING"
        assert (
            list(table["bundles"].values()) == [{"CPU": 0.5, "GPU": 1.0, "pool": 0.5}] * 2
        )  # the replica's share each
    finally:
        ray.util.remove_placement_group(group)
    assert "ray_remote_args_fn" not in engine_task_options(config())


def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    data = job_config("./prompts", "../out", {"target": "models/target", "drafter": "/abs/drafter"})
    (folder / "job.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir("/")
    loaded = load_config(str(folder / "job.yaml"), {"output_uri": "s3://b/dated/"})
    assert loaded.input_uri == str(folder / "prompts")
    assert loaded.model.path == str(folder / "models" / "target") and loaded.speculative.drafter == "/abs/drafter"
    assert loaded.output_uri == "s3://b/dated/"

    with fsspec.open("memory://configs/job.yaml", "w") as f:
        f.write(yaml.safe_dump(data))
    with pytest.raises(
        ConfigError, match=r"input_uri = './prompts' is a relative path, and the config is not a local file"
    ):
        load_config("memory://configs/job.yaml")


STALLED_DRIVER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a job a shell or scheduler started in the background
import pipeline.cluster as cluster
import pipeline.cluster.watch as watch_module
watch_module.WATCH_SECONDS = 0.1

def look(idle_seconds):  # what pipeline/job/watch.AttemptLooks finds, here a stall after 0.2 s, or nothing
    return cluster.SchedulingStalled("actor waiting-for-a-node (PENDING_CREATION)") if WAITS and \
idle_seconds > 0.2 else None

WAITS = sys.argv[1] == "stalled"
started = time.time()
watch = cluster.StallWatch(look, lost=lambda: not WAITS and time.time() - started > 0.5)
watch.start()
try:
    deadline = time.time() + 20
    while time.time() < deadline:  # the driver waiting for its next unit, as Ray Data's consumer does
        time.sleep(0.01)
except cluster.StallInterrupt:
    watch.stop()
    time.sleep(1.5)  # nothing raised once the watch is stopped
    print("stopped:", watch.failure if watch.failure else "lease lost")
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.parametrize("why, says", [("stalled", "actor waiting-for-a-node"), ("lease-lost", "lease lost")])
def test_the_stall_watch_stops_a_driver_that_ignores_sigint(why, says):
    """A stalled job stops with a named error also when it runs with SIGINT ignored, as a
    background job does (a signal-based interrupt did nothing there: the job waited forever);
    so does a job whose heartbeat found another owner of its lease, at once rather than at its
    next unit. The GCS reading is replaced; tests/test_multinode.py runs the whole stall on a
    cluster, tests/test_resilience.py the lost lease."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STALLED_DRIVER, why], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"stopped: {says}" in done.stdout
