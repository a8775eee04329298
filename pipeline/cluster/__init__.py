"""The job and its Ray cluster: what it asks of the cluster and whether the cluster can give it
(placement.py), what the driver watches while it runs (watch.py), Ray's start and join
(startup.py) and the job board the engines and the driver share (job_board.py)."""

from pipeline.cluster.placement import (
    PREPROCESS_CPUS,
    READ_TASK_CPUS,
    ClusterPathRefused,
    Unschedulable,
    check_cluster_paths,
    check_schedulable,
    cluster_capacity,
    engine_remote_args,
    engine_task_options,
    read_concurrency,
)
from pipeline.cluster.watch import (
    WATCH_SECONDS,
    ClusterWatch,
    SchedulingStalled,
    StallInterrupt,
    StallWatch,
    stall_message,
)

__all__ = [
    "PREPROCESS_CPUS",
    "READ_TASK_CPUS",
    "WATCH_SECONDS",
    "ClusterPathRefused",
    "ClusterWatch",
    "SchedulingStalled",
    "StallInterrupt",
    "StallWatch",
    "Unschedulable",
    "check_cluster_paths",
    "check_schedulable",
    "cluster_capacity",
    "engine_remote_args",
    "engine_task_options",
    "read_concurrency",
    "stall_message",
]
