"""What `specbatch calibrate` (pipeline/tools/calibrate.py) chooses from its measurements:
the figures per depth and concurrency, the best depth at each, a depth schedule by concurrency
when the best depth changes with it, and the chosen setting written into the job config."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import yaml

from pipeline.config import parse_config
from pipeline.speculation.policy import recommended_row
from pipeline.speculation.speedup import Speedup
from pipeline.stages.stats import Acceptance
from pipeline.storage import Storage
from pipeline.tools.cost import per_million
from schemas.report import CalibrationRow


def calibration_rows(
    measured: Sequence[dict[str, Any]], gpus_per_replica: float, price: Optional[float]
) -> list[CalibrationRow]:
    """Figures per depth and concurrency, each with its speedup's spread over off; at each
    concurrency the speculation policy's choice is recommended (pipeline/speculation/policy.py
    `recommended_row`: the fastest depth that paid over its whole spread, else off)."""
    off_rate = {m["concurrency"]: m["generated_tokens"] / m["seconds"] for m in measured if m["depth"] == 0}
    off_runs = {m["concurrency"]: m for m in measured if m["depth"] == 0}
    rows = []
    for m in sorted(measured, key=lambda m: (m["concurrency"], m.get("schedule") is not None, m["depth"])):
        rate = m["generated_tokens"] / m["seconds"]
        acceptance = Acceptance(
            m["num_drafts"], m["draft_tokens"], m["accepted_tokens"], list(m["accepted_per_position"])
        )
        dollars = price * gpus_per_replica * m["seconds"] / 3600 if price is not None else None
        off = off_rate.get(m["concurrency"])
        spread = _spread(m, off_runs.get(m["concurrency"])) if m["depth"] else None
        rows.append(
            CalibrationRow(
                depth=m["depth"],
                schedule=m.get("schedule"),
                concurrency=m["concurrency"],
                prompts=m["prompts"],
                prompt_tokens=m["prompt_tokens"],
                generated_tokens=m["generated_tokens"],
                completions=m.get("completions"),
                seconds=m["seconds"],
                seconds_runs=m.get("seconds_runs", [m["seconds"]]),
                tokens_per_second=rate,
                tokens_per_second_per_gpu=rate / gpus_per_replica,
                speedup_vs_off=rate / off if off else None,
                speedup_low=spread.low if spread else None,
                speedup_high=spread.high if spread else None,
                **acceptance.summary(),
                accepted_per_position=acceptance.rate_per_position,
                cost_per_million_generated_tokens=per_million(dollars, m["generated_tokens"]),
                cost_per_million_total_tokens=per_million(dollars, m["generated_tokens"] + m["prompt_tokens"]),
                recommended=False,
            )
        )
    for concurrency in {r.concurrency for r in rows}:
        recommended_row([r for r in rows if r.concurrency == concurrency and r.schedule is None]).recommended = True
    return rows


def _spread(measured: dict[str, Any], off: Optional[dict[str, Any]]) -> Optional[Speedup]:
    if off is None:
        return None
    rates = lambda m: [m["generated_tokens"] / s for s in m.get("seconds_runs", [m["seconds"]])]  # noqa: E731
    return Speedup.of_rates(rates(measured), rates(off))


def best_depths(rows: Sequence[CalibrationRow]) -> dict[int, int]:
    """concurrency -> the recommended depth there."""
    return {r.concurrency: r.depth for r in rows if r.recommended}


def schedule_pays(rows: Sequence[CalibrationRow]) -> bool:
    """The measured schedule is at least as fast as the best single depth at the highest
    concurrency, the job's steady state (it wins the tail by construction)."""
    top = max(r.concurrency for r in rows)
    scheduled = next((r for r in rows if r.concurrency == top and r.schedule), None)
    single = next(r for r in rows if r.concurrency == top and r.recommended)
    return scheduled is not None and scheduled.tokens_per_second_per_gpu >= single.tokens_per_second_per_gpu


def schedule_from(best: dict[int, int], max_num_seqs: int) -> Optional[list[tuple[int, int, int]]]:
    """The measured points as inclusive ranges over 1..max_num_seqs: each concurrency's depth
    holds up to the geometric middle between it and the next one measured (speculation's
    payoff changes with the order of magnitude of concurrency, not its difference). Adjacent
    ranges of one depth merge. None when one depth wins everywhere."""
    points = sorted((c, k) for c, k in best.items() if c <= max_num_seqs)
    if len({k for _, k in points}) < 2:
        return None
    schedule: list[tuple[int, int, int]] = []
    lo = 1
    for i, (c, k) in enumerate(points):
        hi = max_num_seqs if i == len(points) - 1 else max(lo, int((c * points[i + 1][0]) ** 0.5))
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], hi, k)
        else:
            schedule.append((lo, hi, k))
        lo = hi + 1
        if lo > max_num_seqs:
            break
    return schedule if len(schedule) > 1 else None


def config_snippet(depth: int, schedule: Optional[list[tuple[int, int, int]]] = None) -> str:
    if schedule:
        return (
            f"speculative:\n  enabled: true\n  num_speculative_tokens: {max(k for _, _, k in schedule)}\n"
            f"  depth_schedule: {schedule_yaml(schedule)}\n"
        )
    if depth == 0:
        return "speculative:\n  enabled: false\n"
    return f"speculative:\n  enabled: true\n  num_speculative_tokens: {depth}\n"


def schedule_yaml(schedule: Sequence[Sequence[int]]) -> str:
    return "[" + ", ".join(f"[{lo}, {hi}, {k}]" for lo, hi, k in schedule) + "]"


def apply_depth(text: str, depth: int, schedule: Optional[list[tuple[int, int, int]]] = None) -> str:
    """The job config's YAML text with the chosen depth, or schedule: edits the `speculative:`
    block in place (comments and layout kept); falls back to re-writing the YAML if it is not a
    plain block mapping."""
    data = yaml.safe_load(text) or {}
    spec = dict(data.get("speculative") or {})
    spec.pop("depth_schedule", None)
    updates: dict[str, str] = {"enabled": "true" if depth > 0 or schedule else "false"}
    spec["enabled"] = depth > 0 or bool(schedule)
    if schedule:
        spec["num_speculative_tokens"] = max(k for _, _, k in schedule)
        spec["depth_schedule"] = [list(r) for r in schedule]
        updates.update(
            num_speculative_tokens=str(spec["num_speculative_tokens"]), depth_schedule=schedule_yaml(schedule)
        )
    elif depth > 0:
        spec["num_speculative_tokens"] = depth
        updates["num_speculative_tokens"] = str(depth)
    expected = {**data, "speculative": spec}

    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if re.match(r"^speculative:\s*(#.*)?$", ln.rstrip("\n"))), None)
    if start is not None:
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
            end += 1
        block = lines[start + 1 : end]
        indent = next((re.match(r"^(\s+)\S", ln).group(1) for ln in block if re.match(r"^\s+[^\s#]", ln)), "  ")
        if not schedule:  # a single depth replaces a schedule
            block = [ln for ln in block if not re.match(rf"^{re.escape(indent)}depth_schedule:", ln)]
        for key, value in updates.items():
            pattern = re.compile(rf"^({re.escape(indent)}{key}:[ \t]*)([^#\n]*?)([ \t]*#.*)?(\n?)$")
            for i, ln in enumerate(block):
                match = pattern.match(ln)
                if match:
                    block[i] = f"{match.group(1)}{value}{match.group(3) or ''}{match.group(4)}"
                    break
            else:
                block.insert(0, f"{indent}{key}: {value}\n")
        edited = "".join(lines[: start + 1] + block + lines[end:])
        try:
            if yaml.safe_load(edited) == expected:
                return edited
        except yaml.YAMLError:
            pass
    return yaml.safe_dump(expected, sort_keys=False)


def write_config_depth(storage: Storage, config_uri: str, depth: int, schedule=None) -> None:
    edited = apply_depth(storage.read_bytes(config_uri).decode(), depth, schedule)
    parse_config(yaml.safe_load(edited), source=config_uri)  # never write a config the job would refuse
    storage.write_bytes(config_uri, edited.encode())
