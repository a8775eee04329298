"""What the job asks of the Ray cluster, and whether the cluster can give it, before any engine:

- `engine_remote_args`: the engine actors' resources; an engine of several devices (tensor or
  pipeline parallel) gets a placement group of its own, one bundle per device.
- `check_schedulable`: the graph's actors and tasks are packed onto the cluster's nodes (and the
  nodes its autoscaler may add); a graph that cannot fit is refused, naming what is missing,
  instead of waiting forever.
- `check_cluster_paths`: on more than one node, local paths must be on a shared mount.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pipeline.config import ConfigError, JobConfig
from pipeline.storage import is_local

# Ray Data's tasks and actors around the engines (graph.build_dataset).
READ_TASK_CPUS = 0.25
PREPROCESS_CPUS = 0.5
# Unit reads in flight per engine. A read is a few range requests, far quicker than a unit's
# generation; without a bound Ray Data runs one read task per free 0.25 CPU, each in a worker
# process of its own, whose starts slow the engine's own start (docs/measurements.md).
READS_PER_ENGINE = 2


def read_concurrency(config: JobConfig) -> int:
    return READS_PER_ENGINE * config.resources.max_replicas


class Unschedulable(ConfigError):
    """The job's graph cannot be placed on the cluster, even with what its autoscaler can add."""


class ClusterPathRefused(ConfigError):
    """A local path on a cluster of several nodes, not on a declared shared mount."""


def engine_bundles(config: JobConfig) -> int:
    """Placement bundles of one engine: one per GPU worker. An engine on vLLM's CPU build runs
    its workers in the actor's own process tree, on its node: one bundle."""
    return 1 if config.resources.cpu_build else config.engine_workers


def engine_bundle(config: JobConfig) -> dict[str, float]:
    """What one bundle of an engine needs (the replica's resources shared over its bundles);
    with one bundle, what the whole actor needs."""
    resources, bundles = config.resources, engine_bundles(config)
    bundle = {"CPU": resources.cpus_per_replica / bundles}
    if resources.gpus_per_replica:
        bundle["GPU"] = resources.gpus_per_replica / bundles
    return {**bundle, **{name: amount / bundles for name, amount in resources.resources_per_replica.items()}}


def placement_strategy(config: JobConfig) -> str:
    """Tensor parallelism needs one node (NVLink, shared memory); pipeline stages may spread."""
    return "STRICT_PACK" if config.engine.pipeline_parallel_size == 1 else config.engine.pipeline_placement


def _placement_group_args(bundles: list[dict], strategy: str) -> dict:
    """Called by Ray Data for each engine actor it creates: a placement group of its own, which
    vLLM's Ray executor fills with the engine's device workers."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.placement_group(bundles, strategy=strategy)
    return dict(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True))


def engine_remote_args(config: JobConfig) -> dict:
    """Ray Data `map_batches` arguments placing the engine actors."""
    workers = engine_bundles(config)
    if workers == 1:
        bundle = engine_bundle(config)
        return dict(num_cpus=bundle.pop("CPU"), num_gpus=bundle.pop("GPU", 0), resources=bundle or None)
    # The actor itself takes a sliver of the first bundle; the GPU workers vLLM starts take the rest.
    bundles = [engine_bundle(config) for _ in range(workers)]
    return dict(
        num_cpus=0.01,
        num_gpus=0,
        ray_remote_args_fn=functools.partial(_placement_group_args, bundles, placement_strategy(config)),
    )


def engine_task_options(config: JobConfig) -> dict:
    """The same placement for a Ray task that runs one engine (the drafter probe)."""
    options = engine_remote_args(config)
    make_group = options.pop("ray_remote_args_fn", None)
    return {**options, **(make_group() if make_group else {})}


# -- Schedulability -----------------------------------------------------------------------------


@dataclass
class Demand:
    what: str
    bundles: list[dict[str, float]]  # placed together by `strategy`
    strategy: str = "STRICT_PACK"


def graph_demand(config: JobConfig) -> list[Demand]:
    """What the graph holds at once: the pool's minimum of engines, the preprocess actors and one
    read task (Ray Data starts with nothing less)."""
    engines = [
        Demand(
            f"engine replica {i + 1} of {config.resources.min_replicas}",
            [engine_bundle(config)] * engine_bundles(config),
            placement_strategy(config),
        )
        for i in range(config.resources.min_replicas)
    ]
    preprocess = [
        Demand(f"preprocess actor {i + 1}", [{"CPU": PREPROCESS_CPUS}])
        for i in range(config.resources.preprocess_concurrency)
    ]
    return [*engines, *preprocess, Demand("read task", [{"CPU": READ_TASK_CPUS}])]


def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v)


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def _place(nodes: list[dict[str, float]], demand: Demand) -> bool:
    """Place the demand's bundles (first fit); STRICT_PACK: all on one node."""
    if demand.strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for bundle in demand.bundles:
            for k, v in bundle.items():
                total[k] = total.get(k, 0.0) + v
        for free in nodes:
            if _fits(free, total):
                _take(free, total)
                return True
        return False
    trial = [dict(n) for n in nodes]
    for bundle in demand.bundles:
        node = next((free for free in trial if _fits(free, bundle)), None)
        if node is None:
            return False
        _take(node, bundle)
    nodes[:] = trial
    return True


def _describe(resources: dict[str, float]) -> str:
    shown = {
        k: v for k, v in resources.items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def check_schedulable(config: JobConfig, nodes: list[dict[str, float]], can_add: list[dict[str, float]]) -> None:
    """Refuse a graph that cannot be placed on `nodes` (each alive node's total resources) plus
    `can_add` (nodes the autoscaler may start). Totals, not what is free now: resources other jobs
    hold now are waited for (and caught by the stall watch if they never come)."""
    free = [dict(n) for n in [*nodes, *can_add]]
    for demand in sorted(
        graph_demand(config), key=lambda d: -sum(b.get("CPU", 0) + 100 * b.get("GPU", 0) for b in d.bundles)
    ):
        if _place(free, demand):
            continue
        need = (
            demand.bundles[0]
            if len(demand.bundles) == 1
            else f"{len(demand.bundles)} x {_describe(demand.bundles[0])} ({demand.strategy})"
        )
        offered = "; ".join(_describe(n) for n in nodes) or "none"
        added = (
            f"; its autoscaler may add {'; '.join(_describe(n) for n in can_add)}"
            if can_add
            else "; it has no autoscaler that could add nodes"
        )
        demands = graph_demand(config)
        total_cpus = sum(b.get("CPU", 0) for d in demands for b in d.bundles)
        raise Unschedulable(
            f"the job cannot be scheduled on this Ray cluster: {demand.what} needs "
            f"{_describe(need) if isinstance(need, dict) else need} and no node has it left after the rest of the "
            f"graph (the graph holds {total_cpus:g} CPUs at once: {config.resources.min_replicas} engine replica(s) x "
            f"{config.resources.cpus_per_replica:g}, {config.resources.preprocess_concurrency} preprocess actor(s) x "
            f"{PREPROCESS_CPUS:g}, one read task x {READ_TASK_CPUS:g}). The cluster's nodes offer {offered}{added}. "
            "Add nodes with what is missing, or lower resources.replicas (its min), cpus_per_replica, "
            "gpus_per_replica, resources_per_replica or preprocess_concurrency."
        )


def cluster_capacity() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(alive nodes' total resources, nodes the autoscaler may still add) of the connected cluster.
    The autoscaler's node groups are read from the GCS (KubeRay and the cluster launcher publish
    them); a group of unlimited size counts as many nodes as the job's largest need could use."""
    import ray
    import ray._private.state

    nodes = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
    can_add = []
    try:
        cluster_config = ray._private.state.state.get_cluster_config()
    except Exception:  # an older GCS without the autoscaler's state: no autoscaler known
        cluster_config = None
    for group in getattr(cluster_config, "node_group_configs", []) or []:
        resources = {k: float(v) for k, v in group.resources.items()}
        if not resources or group.max_count == 0:
            continue
        count = 64 if group.max_count == -1 else group.max_count
        can_add += [dict(resources) for _ in range(count)]
    return nodes, can_add


# -- Storage on a cluster -----------------------------------------------------------------------


def check_cluster_paths(config: JobConfig, nodes: int) -> None:
    """On more than one node, every node reads the input and the models and writes the output
    itself: a local path would be each node's own disk (outputs scattered, models missing)."""
    if nodes <= 1:
        return
    mounts = [m.rstrip("/") + "/" for m in config.storage.shared_mounts]
    paths = {
        "input_uri": config.input_uri,
        "output_uri": config.output_uri,
        "model.path": config.model.path,
        "model.tokenizer": config.model.tokenizer,
        "speculative.drafter": config.speculative.drafter if config.speculative.enabled else None,
        **{f"lora.adapters.{name}": path for name, path in (config.lora.adapters if config.lora else {}).items()},
    }
    local = {
        name: path
        for name, path in paths.items()
        if path and is_local(path) and not any((_local_path(path).rstrip("/") + "/").startswith(m) for m in mounts)
    }
    if local:
        listed = ", ".join(f"{name} = {path}" for name, path in local.items())
        raise ClusterPathRefused(
            f"this Ray cluster has {nodes} nodes, and {listed} "
            f"{'is a local path' if len(local) == 1 else 'are local paths'}: each node would read and write its own "
            "disk (outputs scattered over the nodes, models missing on some). Use object storage (s3://bucket/...), or "
            "a folder every node mounts at the same path and declare it in storage.shared_mounts."
        )


def _local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path
