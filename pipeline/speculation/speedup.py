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

    def rounded(self) -> tuple[float, float, float]:
        """(median, low, high) as records keep them."""
        return round(self.median, 3), round(self.low, 3), round(self.high, 3)

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
    """Seconds per sequence decode step, one figure per run: the run's whole time over its
    steps, its prefill included: it transferred across the workloads of
    benchmarks/speculation_model.py, where a decode step's cost taken apart from the prefill did
    not (docs/speculation.md)."""
    steps = decode_steps(row)
    return [s / steps for s in (row.seconds_runs or [row.seconds])] if steps > 0 else []


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
    return SpeculationCosts(
        calibration_uri=uri,
        measured_at=report.measured_at,
        depth=depth,
        concurrency=at,
        off_step_seconds=step_seconds(off),
        spec_step_seconds=step_seconds(spec),
        calibration_acceptance=spec.accepted_per_position,
        calibration_tokens_per_step=_yield(spec.generated_tokens, spec.completions or spec.prompts, spec.num_drafts),
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
    """The speedup over off of this traffic on the calibrated hardware: E_k x T_off / T_k, every
    run of one setting against every run of the other."""
    tokens = traffic.length(costs.depth)
    steps = Speedup.of_rates([1 / t for t in costs.spec_step_seconds], [1 / t for t in costs.off_step_seconds])
    return steps.times(tokens) if tokens is not None and steps is not None else None


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

    @classmethod
    def of_totals(cls, totals: JobTotals) -> Optional[Traffic]:
        if not totals.num_drafts or not totals.accepted_per_position:
            return None
        rates = [n / totals.num_drafts for n in totals.accepted_per_position]
        return cls(rates, f"this job's {totals.num_drafts:,} drafts", totals.tokens_per_target_pass)

    @classmethod
    def of_probe(cls, probe: Optional[ProbeResult]) -> Optional[Traffic]:
        if probe is None or not probe.num_drafts:
            return None
        return cls(
            list(probe.accepted_per_position),
            f"the probe's {probe.rows} rows of this job",
            probe.tokens_per_target_pass,
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
