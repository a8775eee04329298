"""The engine actor: one vLLM engine (with its EAGLE-3 drafter) for the actor's whole life.

Ray Data calls it with one prepared work unit at a time. The actor is async: several units
are in flight at once and their requests overlap inside the engine, so the engine does not
drain at a unit's tail. Each unit is committed to the output location (its outputs, errors
and marker with its stats row) off the event loop, and the stats row is returned to the
driver.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.engine import engine_kwargs, prepare_process_env, sampling_params
from pipeline.metrics import ReplicaMetrics
from pipeline.outputs import OutputLocation
from pipeline.stats import Acceptance
from pipeline.storage import Storage
from pipeline.units import unit_of
from schemas import ErrorRow, OutputRow, UnitStats, arrow_schema


# Fault injection for the resilience tests: ids whose request kills the actor's process, the
# way a poisoned row that crashes the engine would. Empty unless the variable is set.
CHAOS_CRASH_IDS = frozenset(filter(None, os.environ.get("SPECBATCH_CHAOS_CRASH_IDS", "").split(",")))


class EngineCrash(RuntimeError):
    pass


class Generator:
    def __init__(
        self, config: dict[str, Any], model_id: str, drafter_id: str | None, job_id: str = "", disabled_by_guard: bool = False
    ):
        import ray
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = JobConfig.model_validate(config)
        prepare_process_env(self.config)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(self.config)))
        self.location = OutputLocation(Storage.from_config(self.config.storage), self.config.output_uri)
        self.model_id, self.drafter_id = model_id, drafter_id
        self.disabled_by_guard = disabled_by_guard
        context = ray.get_runtime_context()
        self.actor_id, self.node_id = context.get_actor_id() or "driver", context.get_node_id()
        # An isolated unit runs alone in the engine, so that a crash is the fault of the one
        # row it was generating: it waits for the units in flight and holds off new ones.
        self.isolation = asyncio.Lock()
        self.units_generating = 0
        self.metrics = ReplicaMetrics(job_id, self.actor_id)

    async def _generate(self, request_id: str, row: dict[str, Any]):
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(self.config, row, output_kind=RequestOutputKind.FINAL_ONLY)
        if row["id"] in CHAOS_CRASH_IDS:
            os._exit(70)  # fault injection for tests: this row takes the engine's process down
        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=row["prompt_token_ids"]), params, request_id):
            final = output
        return final

    async def _generate_isolated(self, unit_id: str, rows: list[dict], todo: list[int]) -> list:
        """Row by row, each start recorded first: a row that was started and never finished
        took the engine down with it, and goes to errors/ instead of crashing it again."""
        results = []
        for i in todo:
            marker = f"row-{i}"
            if await asyncio.to_thread(self.location.start_attempt, unit_id, marker):
                results.append(EngineCrash(f"the engine died while generating this row (unit {unit_id})"))
                continue
            try:
                results.append(await self._generate(f"{unit_id}-{i}", rows[i]))
            except Exception as exc:
                results.append(exc)
            await asyncio.to_thread(self.location.finish_attempt, unit_id, marker)
        return results

    async def __call__(self, batch: pa.Table) -> pa.Table:
        received = time.time()
        unit_id, source, first_row = unit_of(batch)
        rows = batch.drop_columns(["metadata"]).to_pylist()
        todo = [i for i, r in enumerate(rows) if r["error_kind"] is None]

        crashes_before = await asyncio.to_thread(self.location.start_attempt, unit_id)
        if crashes_before >= self.config.retries.isolate_after_attempts:
            async with self.isolation:
                while self.units_generating:
                    await asyncio.sleep(0.05)
                started = time.time()
                results = await self._generate_isolated(unit_id, rows, todo)
        else:
            async with self.isolation:  # not while a unit runs isolated
                self.units_generating += 1
            started = time.time()
            try:
                results = await asyncio.gather(
                    *(self._generate(f"{unit_id}-{i}", rows[i]) for i in todo), return_exceptions=True
                )
            finally:
                self.units_generating -= 1
        engine_seconds = time.time() - started

        outputs, output_index, errors = [], [], []
        total = Acceptance()
        prompt_tokens = generated_tokens = 0
        for row in rows:
            if row["error_kind"] is not None:
                errors.append(self._error(row, "validate", row["error_kind"], row["error_field"], row["error_message"]))
        for i, result in zip(todo, results):
            row = rows[i]
            if isinstance(result, BaseException) or result is None:
                errors.append(self._error(row, "generate", type(result).__name__, None, str(result)))
                continue
            if not result.finished:
                errors.append(self._error(row, "generate", "Unfinished", None, "the engine returned no final output"))
                continue
            completion = result.outputs[0]
            acceptance = Acceptance.from_request(completion.spec_decode_metrics)
            total = total + acceptance
            prompt_tokens += len(result.prompt_token_ids or row["prompt_token_ids"])
            generated_tokens += len(completion.token_ids)
            outputs.append(
                OutputRow(
                    id=row["id"],
                    text=completion.text,
                    finish_reason=completion.finish_reason or "unknown",
                    prompt_tokens=len(result.prompt_token_ids or row["prompt_token_ids"]),
                    generated_tokens=len(completion.token_ids),
                    draft_tokens=acceptance.draft_tokens,
                    accepted_tokens=acceptance.accepted_tokens,
                    num_drafts=acceptance.num_drafts,
                    mean_acceptance_length=acceptance.mean_acceptance_length or 1.0,
                    model=self.model_id,
                    drafter=self.drafter_id,
                    source=row["source"],
                    row=row["row"],
                    unit_id=unit_id,
                ).model_dump(exclude={"metadata"})
            )
            output_index.append(i)

        spec = self.config.speculative
        stats = UnitStats(
            unit_id=unit_id,
            source=source,
            first_row=first_row,
            actor_id=self.actor_id,
            node_id=self.node_id,
            rows=len(rows),
            output_rows=len(outputs),
            error_rows=len(errors),
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            started_at=started,
            wall_seconds=0.0,
            engine_seconds=engine_seconds,
            tokens_per_second=generated_tokens / engine_seconds if engine_seconds > 0 else 0.0,
            speculative=spec.enabled,
            num_speculative_tokens=spec.num_speculative_tokens if spec.enabled else 0,
            **total.summary(),
            accepted_per_position=total.accepted_per_position,
            speculation_disabled_by_guard=self.disabled_by_guard,
        )
        metadata = batch.column("metadata")
        output_table = pa.Table.from_pylist(outputs, schema=arrow_schema(OutputRow)).append_column(
            "metadata", metadata.take(pa.array(output_index, type=pa.int64()))
        )
        error_table = pa.Table.from_pylist(errors, schema=arrow_schema(ErrorRow))

        def commit() -> pa.Table:
            stats.wall_seconds = time.time() - received
            marker = self.location.commit(unit_id, {"outputs": output_table, "errors": error_table}, stats)
            self.location.finish_attempt(unit_id)
            self.metrics.record(marker.stats)
            return pa.Table.from_pylist([marker.stats.model_dump()], schema=arrow_schema(UnitStats))

        # Off the event loop: the other units in flight keep the engine busy meanwhile.
        return await asyncio.to_thread(commit)

    @staticmethod
    def _error(row: dict, stage: str, kind: str, field: str | None, message: str) -> dict:
        return ErrorRow(
            id=row["id"], source=row["source"], row=row["row"], stage=stage, error_kind=kind, field=field,
            message=message, unit_id=row["unit_id"],
        ).model_dump()
