"""The job's Ray Data graph (dataset.py): the units' reads (datasource.py), the preprocess
stage, the engine actors (engine_stage.py, with their part in the speculation trial in
engine_trial.py) and the prefix-grouped regrouping (regroup.py)."""

from pipeline.graph.dataset import build_dataset, engine_actor_label

__all__ = ["build_dataset", "engine_actor_label"]
