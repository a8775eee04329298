"""The job's Ray Data graph, over the units left to run:

UnitDatasource (one read task per unit) -> Preprocessor (CPU: validate, chat template,
tokenize) -> EngineStage actor pool (one vLLM engine each; commits each unit)
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Sequence

from pipeline.cluster import PREPROCESS_CPUS, READ_TASK_CPUS, engine_remote_args, read_concurrency
from pipeline.inputs.units import WorkUnit
from pipeline.config import JobConfig
from pipeline.storage import TRANSIENT_ERRORS, Storage
from schemas import DuplicateId


if TYPE_CHECKING:  # the engine actor's module imports Ray's metrics: a run imports it once it has work
    import ray.data

    from pipeline.graph.engine_stage import EngineActorArgs


def build_dataset(
    config: JobConfig, units: list[WorkUnit], engines: EngineActorArgs, duplicates: Sequence[DuplicateId] = ()
) -> ray.data.Dataset:
    """The Ray Data graph over `units`; nothing runs until the caller iterates it. `engines`:
    what each engine actor is built with beside the config (pipeline/graph/engine_stage.py);
    `duplicates`: rows whose id an earlier row has (the plan's id check), each its row's error."""
    import ray
    from ray.data import ActorPoolStrategy

    from pipeline.graph.datasource import UnitDatasource
    from pipeline.inputs.shape import RowShape
    from pipeline.stages.preprocess import PreprocessSettings, Preprocessor

    storage = Storage.from_config(config.storage)
    context = ray.data.DataContext.get_current()
    context.retried_io_errors = [*context.retried_io_errors, *TRANSIENT_ERRORS]
    # An error of an actor reaches the driver as itself (a StorageUnavailable, with the store, the
    # operation and the key), not as Ray Data's UserCodeException, which keeps only its text.
    context.raise_original_map_exception = True
    # A block is a whole unit from its read to its commit: Ray Data must not split it by size.
    context.target_max_block_size = None
    resources = config.resources
    # One read task (one block) per unit, so no extra split either. Reads are I/O-bound and few
    # run at once (cluster.READS_PER_ENGINE).
    ds = ray.data.read_datasource(
        UnitDatasource(units, storage, RowShape.for_job(config)),
        override_num_blocks=len(units),
        num_cpus=READ_TASK_CPUS,
        concurrency=read_concurrency(config),
    )
    ds = ds.map_batches(
        Preprocessor,
        fn_constructor_kwargs={
            "settings": PreprocessSettings.for_job(config, duplicates),
            "storage": storage,
        },  # a tokenizer in storage: copied on the actor's node
        batch_format="pyarrow",
        batch_size=None,
        compute=ActorPoolStrategy(size=resources.preprocess_concurrency),
        num_cpus=PREPROCESS_CPUS,
    )
    with warnings.catch_warnings():
        # Ray 2.60 has no named parameter for actor restarts and task retries, only the
        # deprecated **ray_remote_args, which warns on every run.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return _engine_stage(ds, config, engines)


def engine_actor_label() -> str:
    """What Ray calls the engine actors, inside `MapWorker(...)`: Ray Data's name for a map stage
    of this class. The cluster watch names them first among what waits for resources, and the
    tests find their processes by it."""
    from pipeline.graph.engine_stage import EngineStage

    return f"MapBatches({EngineStage.__name__})"


def _engine_stage(ds: ray.data.Dataset, config: JobConfig, engines: EngineActorArgs) -> ray.data.Dataset:
    from ray.data import ActorPoolStrategy

    from pipeline.graph.engine_stage import EngineStage

    resources = config.resources
    # Ray Data grows a pool when the units sent to its actors reach 1.75x the units they run at
    # once: an autoscaling pool lets each engine hold as many units waiting as running.
    waiting = resources.units_in_flight if resources.max_replicas > resources.min_replicas else 0
    return ds.map_batches(
        EngineStage,
        fn_constructor_kwargs=dict(config=config.model_dump(mode="json"), engines=engines),
        batch_format="pyarrow",
        batch_size=None,
        compute=ActorPoolStrategy(
            min_size=resources.min_replicas,
            max_size=resources.max_replicas,
            max_tasks_in_flight_per_actor=resources.units_in_flight + waiting,
            max_concurrent_calls_per_actor=resources.units_in_flight,  # the actor is async: they overlap in the engine
        ),
        **engine_remote_args(config),
        # A dead actor (engine crash, preempted node) is restarted and its units retried.
        max_restarts=config.retries.max_actor_restarts,
        max_task_retries=config.retries.max_unit_retries,
    )
