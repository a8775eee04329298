"""The dry run's plan (schemas.DryRunPlan) as text for a terminal: what `specbatch run CONFIG
--dry-run` prints without `--json`."""

from __future__ import annotations

from schemas.plan import DryRunPlan, PlanGrouping

FILES_SHOWN = 10
PROMPT_LINES_SHOWN = 12


def format_plan(plan: DryRunPlan) -> str:
    lines = []
    if plan.accepted:
        lines.append("specbatch run --dry-run: the job would be accepted (exit 0). Nothing was started or written.")
    else:
        lines.append(
            "specbatch run --dry-run: the job would be REFUSED (exit 2); the reason is below. Nothing was "
            "started or written."
        )
    lines.append(f"  config    {plan.config_uri}")
    if plan.output_uri:
        lines.append(f"  output    {plan.output_uri}")
    i = plan.inputs
    if i:
        kind = "OpenAI batch files, converted to " if i.input_format == "openai_batch" else ""
        lines.append(
            f"  input     {kind}{i.files:,} Parquet file{'s' if i.files != 1 else ''}, {i.rows:,} rows: "
            f"{i.prompt_rows:,} prompt, {i.chat_rows:,} chat (messages); {i.footers_read:,} footers read"
        )
        if i.duplicate_ids:
            lines.append(
                f"            {i.duplicate_ids:,} rows repeat an earlier row's id: each would be its row's error "
                "(duplicate_id), the earlier row generated"
            )
        if i.input_format == "openai_batch":
            lines.append(
                f"            {i.converted_files} JSONL file(s) already converted under the output's _inputs/, "
                f"{i.conversions_checked} not yet: checked line by line in a temporary folder (deleted); "
                "the run converts them"
            )
        for f in i.file_list[:FILES_SHOWN]:
            lines.append(
                f"            {f.uri}  {f.rows:,} rows ({f.text_column}), {f.units:,} unit{'s' if f.units != 1 else ''}"
            )
            if f.first_prompt is not None:
                lines += [
                    f"              first prompt | {line}" for line in f.first_prompt.splitlines()[:PROMPT_LINES_SHOWN]
                ]
        if len(i.file_list) > FILES_SHOWN:
            lines.append(f"            ... and {len(i.file_list) - FILES_SHOWN:,} more files")
    u = plan.units
    if u:
        lines.append(f"  units     {u.units:,} of up to {u.rows_per_unit:,} rows")
        if u.head:
            lines.append(
                f"            the first {u.head.rows:,} rows in units of {u.head.rows_per_unit:,} (the job's sequences "
                "at once), which the speculation trial measures"
            )
        rerun = f"rerun of job {u.rerun_of}: " if u.rerun_of else ""
        again = f" ({u.again:,} of them again, for their error rows)" if u.again else ""
        lines.append(
            f"            {rerun}{u.committed:,} committed, {u.left:,} left to run{again}, {u.rows_left:,} rows"
        )
    t = plan.tokens
    if t:
        how = (
            "counted over every row"
            if t.exact
            else (
                f"estimated from {t.sample_rows:,} sampled rows in {t.sample_row_groups} row groups, seed "
                f"{t.sample_seed}"
            )
        )
        kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(t.prompt_tokens_by_kind.items()))
        lines.append(
            f"  tokens    prompt ~{t.prompt_tokens:,} ({kinds}; {how}, as the preprocess stage tokenizes); "
            f"left to run ~{t.prompt_tokens_left:,}"
        )
        bound = "summed over every row" if t.exact else "estimated: the sample's mean per row x the rows"
        lines.append(
            f"            output at most {t.output_tokens_upper_bound:,} (each row's max_tokens x n, {bound}; "
            f"rows may stop earlier); left to run at most {t.output_tokens_upper_bound_left:,}"
        )
        if t.sample_error_rows:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(t.sample_error_kinds.items()))
            lines.append(
                f"            {t.sample_error_rows} of {t.sample_rows} sampled rows would go to errors/ ({kinds})"
            )
    if plan.grouping:
        lines += _grouping_lines(plan.grouping)
    if plan.checks:
        lines.append("  checks")
        for c in plan.checks:
            lines.append(
                f"            {c.name:<14}{c.status:<8}{c.message.splitlines()[0] if c.status == 'fail' else c.message}"
            )
    if plan.speculation:
        lines.append(f"  speculate {plan.speculation}")
    c = plan.cost
    if c:
        price = (
            f", {c.currency} {_figure(c.cost)} at {c.price_per_gpu_hour:g} per GPU-hour ({c.price_source})"
            if c.cost is not None
            else ", no price for the accelerator"
        )
        at = f"schedule {c.schedule}" if c.schedule else (f"depth {c.depth}" if c.depth else "speculation off")
        lines.append(
            f"  cost      at most {_figure(c.gpu_hours)} GPU-hours{price}; wall time at most "
            f"{_figure(c.wall_hours)} h at the pool's minimum replicas"
        )
        lines.append(
            f"            from {c.calibration_uri} ({c.measured_at}): {c.tokens_per_second_per_gpu:,.1f} generated "
            f"tok/s per GPU at {at}, {c.concurrency} sequences at once; {c.output_tokens:,} output tokens at most"
        )
    elif plan.cost_note:
        lines.append(f"  cost      {plan.cost_note}")
    for w in plan.warnings:
        lines.append(f"  warning   {w}")
    if plan.refused:
        lines.append("  refused   (the message follows, as the real run gives it)")
    return "\n".join(lines) + "\n"


def _grouping_lines(g: PlanGrouping) -> list[str]:
    d, s = g.decision, g.decision.sharing
    lines = [
        f"  prefixes  {'grouped' if d.grouped else 'not grouped'} (resources.group_prefixes: {d.setting}): {d.reason}"
    ]
    if s:
        share = lambda chars: f"{chars / s.prompt_chars:.0%}" if s.prompt_chars else "0%"  # noqa: E731
        lines.append(
            f"            {s.prefix_groups:,} shared prefixes over {s.rows_in_groups:,} of {s.rows:,} rows; sorted by "
            f"prefix, rows share at least {share(s.shared_chars_grouped)} of the prompt text, "
            f"{share(s.shared_chars_in_input_order)} in the input's "
            f"order{f' ({s.job_common_chars:,} characters every row shares)' if s.job_common_chars else ''}"
        )
    if g.prefill_tokens_saved is not None and d.grouped:
        lines.append(
            f"            prefill it expects to save: at least ~{g.prefill_tokens_saved:,} prompt tokens, when the "
            "engines' KV cache holds a fraction of the job's prefixes (as on GPUs with large models)"
        )
    if d.grouped:
        where = "planned over the grouped copy" + (
            "" if g.copy_written else ", which the run writes first under the output's _grouped/"
        )
        lines.append(f"            {g.units:,} units {where}")
    return lines


def _figure(x: float) -> str:
    """Hours and money: whole above 100, cents above 1, three significant digits below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}" if x >= 1 else f"{x:.3g}"
