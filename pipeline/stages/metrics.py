"""Prometheus metrics of the engine actors, through Ray's metrics API.

Each engine actor (pipeline/graph/engine_stage.py) records one update per committed unit, tagged with the job id and its
replica (the actor id). Ray exports them on every node's metrics endpoint with the prefix
`ray_` (counters also get `_total`): e.g. `ray_specbatch_rows_done_total`. The dashboard in
infra/grafana/specbatch.json plots them.
"""

from __future__ import annotations

import time
from typing import Optional

from ray.util.metrics import Counter, Gauge

from schemas import UnitStats

TAG_KEYS = ("job_id", "replica")
COUNTERS = {
    "rows_done": "Input rows generated and committed to outputs/.",
    "rows_failed": "Input rows committed to errors/.",
    "prompt_tokens": "Prompt tokens of committed units (once per request, whatever its samples).",
    "cached_prompt_tokens": (
        "Of those prompt tokens, the ones vLLM served from its prefix cache (not computed in prefill)."
    ),
    "generated_tokens": "Tokens generated in committed units.",
    "draft_tokens": "Draft tokens proposed in committed units.",
    "accepted_tokens": "Draft tokens accepted in committed units.",
    "drafts": "Verify steps that carried drafts, in committed units.",
}
GAUGES = {
    "tokens_per_second": "Generated tokens per second of this replica since its first unit.",
    "acceptance_rate": "Accepted / draft tokens of the replica's last committed unit that drafted.",
    "mean_acceptance_length": "1 + accepted / drafts of the replica's last committed unit that drafted.",
    "tokens_per_target_pass": (
        "Generated tokens per target decode pass of the replica's last committed unit that drafted: what speculation "
        "saved, the drafts a grammar cut included."
    ),
    "seconds_since_last_output": (
        "Seconds this replica's engine has held requests without making a step (vLLM reports every step); 0 while it "
        "holds none. Past retries.engine_stall_seconds the engine is hung and replaced."
    ),
    "trial_speedup_vs_off": (
        "The speculation trial's measured tokens/s with the configured speculation / without it, on the replica that "
        "ran it (below 1: speculation cost more than it saved, and the job turned it off)."
    ),
}


class ReplicaMetrics:
    def __init__(self, job_id: str, replica: str):
        self.tags = {"job_id": job_id, "replica": replica}
        self.counters = {name: Counter(f"specbatch_{name}", text, TAG_KEYS) for name, text in COUNTERS.items()}
        self.gauges = {name: Gauge(f"specbatch_{name}", text, TAG_KEYS) for name, text in GAUGES.items()}
        self.first_unit_started: Optional[float] = None
        self.generated_tokens = 0

    def record_progress(self, seconds_without_progress: float) -> None:
        self.gauges["seconds_since_last_output"].set(seconds_without_progress, tags=self.tags)

    def record_trial(self, speedup_vs_off: float) -> None:
        self.gauges["trial_speedup_vs_off"].set(speedup_vs_off, tags=self.tags)

    def record(self, stats: UnitStats) -> None:
        increments = {
            "rows_done": stats.output_rows,
            "rows_failed": stats.error_rows,
            "prompt_tokens": stats.prompt_tokens,
            "cached_prompt_tokens": stats.cached_prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "drafts": stats.num_drafts,
        }
        for name, value in increments.items():
            if value > 0:  # Ray's counters refuse 0
                self.counters[name].inc(value, tags=self.tags)
        self.first_unit_started = min(self.first_unit_started or stats.started_at, stats.started_at)
        self.generated_tokens += stats.generated_tokens
        elapsed = time.time() - self.first_unit_started
        if elapsed > 0:
            self.gauges["tokens_per_second"].set(self.generated_tokens / elapsed, tags=self.tags)
        if stats.num_drafts:
            self.gauges["acceptance_rate"].set(stats.acceptance_rate, tags=self.tags)
            self.gauges["mean_acceptance_length"].set(stats.mean_acceptance_length, tags=self.tags)
            if stats.tokens_per_target_pass is not None:
                self.gauges["tokens_per_target_pass"].set(stats.tokens_per_target_pass, tags=self.tags)
