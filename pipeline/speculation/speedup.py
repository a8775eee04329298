"""The arithmetic of speculation's speedup (pipeline/speculation/policy.py decides with it).

A speedup carries its spread: the lowest and the highest speed over off that any pair of runs
allows. What the hardware costs is read from a calibration (`SpeculationCosts`: seconds per
sequence decode step, off and at a depth, every run kept); what the traffic accepts is its share
of drafts kept by position (`Traffic`). A decode step at depth k yields E_k = 1 + a_1 + ... + a_k
tokens (a_i already counts only drafts whose first i tokens were all kept), so speculation runs at
E_k x T_off / T_k the speed of off.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from schemas import JobTotals, ProbeResult
from schemas.report import CalibrationReport, CalibrationRow, SpeculationCosts

Verdict = Literal["paid", "cost_more", "no_difference"]


@dataclass(frozen=True)
class Speedup:
    """Speculation's speed over off's: the median and the spread the runs allow."""

    median: float
    low: float
    high: float
    runs: int  # the fewer runs of the two sides

    @classmethod
    def of_rates(cls, on: Sequence[float], off: Sequence[float], median: Optional[float] = None) -> Optional[Speedup]:
        """From each run's rate of the two settings: any run of one against any of the other."""
        on, off = [r for r in on if r > 0], [r for r in off if r > 0]
        if not on or not off:
            return None
        middle = median if median is not None else statistics.median(on) / statistics.median(off)
        low, high = min(on) / max(off), max(on) / min(off)
        return cls(middle, min(low, middle), max(high, middle), min(len(on), len(off)))

    def times(self, factor: float) -> Speedup:
        return Speedup(self.median * factor, self.low * factor, self.high * factor, self.runs)

    @property
    def verdict(self) -> Verdict:
        if self.runs < 2:  # a single run has no spread: noise cannot be told from a result
            return "no_difference"
        if self.low > 1.0:
            return "paid"
        if self.high < 1.0:
            return "cost_more"
        return "no_difference"

    @property
    def spread(self) -> str:
        return f"{self.low:.2f}x-{self.high:.2f}x"

    def words(self) -> str:
        """The verdict in the words every surface uses."""
        if self.runs < 2:
            return f"no difference this measurement can show (measured once: {self.median:.2f}x, no spread)"
        return {
            "paid": f"paid: {self.median:.2f}x of off ({self.spread})",
            "cost_more": f"cost more than it saved: {self.median:.2f}x of off ({self.spread})",
            "no_difference": f"no difference this measurement can show ({self.spread})",
        }[self.verdict]


# ---------------------------------------------------------------- the hardware's costs, from a calibration


def decode_steps(row: CalibrationRow) -> int:
    """A row's sequence decode steps: each drafting step once speculating; off, each token after
    a completion's first (which comes from its prefill)."""
    if row.depth:
        return row.num_drafts
    return row.generated_tokens - (row.completions if row.completions is not None else row.prompts)


def step_seconds(row: CalibrationRow) -> list[float]:
    """Seconds per sequence decode step, one figure per run: the run's time less its prefill's
    (when the calibration timed the prefill alone), over its decode steps."""
    steps, runs = decode_steps(row), row.seconds_runs or [row.seconds]
    prefills = row.prefill_seconds_runs if len(row.prefill_seconds_runs) == len(runs) else [0.0] * len(runs)
    return [max(s - p, 0.05 * s) / steps for s, p in zip(runs, prefills)] if steps > 0 else []


def prefill_seconds(row: CalibrationRow) -> list[float]:
    """Seconds of prefill per prompt token, one figure per run; empty when not timed apart."""
    runs = row.seconds_runs or [row.seconds]
    if len(row.prefill_seconds_runs) != len(runs) or not row.prompt_tokens:
        return []
    return [p / row.prompt_tokens for p in row.prefill_seconds_runs]


def costs_from(
    report: CalibrationReport, depth: int, concurrency: int, uri: Optional[str] = None
) -> Optional[SpeculationCosts]:
    """The step costs at `depth`, at the calibrated concurrency nearest `concurrency` (by ratio;
    ties: the higher). None when the calibration did not measure off and `depth` there."""
    fixed = {(r.concurrency, r.depth): r for r in report.rows if r.schedule is None}
    measured = [c for c in report.concurrencies if (c, 0) in fixed and (c, depth) in fixed]
    if depth <= 0 or not measured:
        return None
    at = min(measured, key=lambda c: (abs(math.log(c / concurrency)), -c))
    off, spec = fixed[(at, 0)], fixed[(at, depth)]
    if not step_seconds(off) or not step_seconds(spec):
        return None
    completions = spec.completions or spec.prompts
    return SpeculationCosts(
        calibration_uri=uri,
        measured_at=report.measured_at,
        depth=depth,
        concurrency=at,
        off_step_seconds=step_seconds(off),
        spec_step_seconds=step_seconds(spec),
        off_prefill_seconds=prefill_seconds(off),
        spec_prefill_seconds=prefill_seconds(spec),
        calibration_acceptance=spec.accepted_per_position,
        calibration_tokens_per_step=_yield(spec.generated_tokens, completions, spec.num_drafts),
        calibration_prompt_tokens=spec.prompt_tokens / completions,
        calibration_decode_tokens=(spec.generated_tokens - completions) / completions,
    )


def _yield(generated: int, completions: int, steps: int) -> Optional[float]:
    """Tokens a decode step yielded, as generated: vLLM's acceptance counts drafts accepted past
    max_tokens too, which a completion never gets (a short one's last step overshoots)."""
    return (generated - completions) / steps if steps > 0 and generated > completions else None


def tokens_per_step(acceptance: Sequence[float], depth: int) -> Optional[float]:
    """E_k: tokens a speculating decode step yields per sequence, from the share of drafts
    accepted at each position. Acceptance measured shallower than `depth` cannot predict it."""
    if depth <= 0 or len(acceptance) < depth:
        return None
    return 1.0 + sum(acceptance[:depth])


def predict(costs: SpeculationCosts, traffic: Traffic) -> Optional[Speedup]:
    """The speedup over off of this traffic on the calibrated hardware: a completion's time off,
    its prefill and D decode steps, over its time speculating, the same prefill and D / E_k
    steps; every run of one setting against every run of the other. Without the prefill timed
    apart, the decode steps' ratio alone (the prefill then counts in each step)."""
    tokens = traffic.length(costs.depth)
    if tokens is None:
        return None
    if not (costs.off_prefill_seconds and costs.spec_prefill_seconds):
        steps = Speedup.of_rates([1 / t for t in costs.spec_step_seconds], [1 / t for t in costs.off_step_seconds])
        return steps.times(tokens) if steps is not None else None
    prompt = traffic.prompt_tokens if traffic.prompt_tokens is not None else costs.calibration_prompt_tokens
    decode = traffic.decode_tokens if traffic.decode_tokens is not None else costs.calibration_decode_tokens
    off = [p * prompt + decode * t for p, t in zip(costs.off_prefill_seconds, costs.off_step_seconds)]
    spec = [p * prompt + decode / tokens * t for p, t in zip(costs.spec_prefill_seconds, costs.spec_step_seconds)]
    return Speedup.of_rates([1 / t for t in spec], [1 / t for t in off])


def row_speedup(row: CalibrationRow) -> Optional[Speedup]:
    """A calibration row's speedup over off at its concurrency, with its spread; None for off
    itself, or a row written before spreads were kept."""
    if row.depth == 0 or row.speedup_vs_off is None or row.speedup_low is None or row.speedup_high is None:
        return None
    return Speedup(row.speedup_vs_off, row.speedup_low, row.speedup_high, len(row.seconds_runs))


NO_SPEEDUP = Speedup(1.0, 0.0, math.inf, 0)  # no speedup measured: no verdict


# ---------------------------------------------------------------- the traffic's acceptance


@dataclass(frozen=True)
class Traffic:
    """What a job's prompts accept: the share of drafts accepted at each position, and whose."""

    acceptance: list[float]
    source: str
    tokens_per_step: Optional[float] = None  # as generated, at the depth it drafted (len(acceptance))
    prompt_tokens: Optional[float] = None  # prefilled per completion (not from the prefix cache)
    decode_tokens: Optional[float] = None  # generated per completion after its first

    @classmethod
    def of_totals(cls, totals: JobTotals) -> Optional[Traffic]:
        if not totals.num_drafts or not totals.accepted_per_position:
            return None
        rates = [n / totals.num_drafts for n in totals.accepted_per_position]
        samples = totals.samples or None  # a job written before samples were counted: the calibration's lengths
        prompt = (totals.prompt_tokens - totals.cached_prompt_tokens) / samples if samples else None
        decode = (totals.generated_tokens - totals.samples) / samples if samples else None
        return cls(rates, f"this job's {totals.num_drafts:,} drafts", totals.tokens_per_target_pass, prompt, decode)

    @classmethod
    def of_probe(cls, probe: Optional[ProbeResult]) -> Optional[Traffic]:
        if probe is None or not probe.num_drafts or not probe.rows:
            return None
        return cls(
            list(probe.accepted_per_position),
            f"the probe's {probe.rows} rows of this job",
            probe.tokens_per_target_pass,
            probe.prompt_tokens / probe.rows,
            (probe.generated_tokens - probe.rows) / probe.rows,
        )

    @classmethod
    def of_calibration(cls, costs: SpeculationCosts) -> Traffic:
        return cls(list(costs.calibration_acceptance), "the calibration's sample", costs.calibration_tokens_per_step)

    def length(self, depth: int) -> Optional[float]:
        """Tokens per decode step at `depth`: as generated at the depth it drafted, else from
        the acceptance by position (a shallower depth than it drafted)."""
        if self.tokens_per_step is not None and depth == len(self.acceptance):
            return self.tokens_per_step
        return tokens_per_step(self.acceptance, depth)
