"""The engine actor: one vLLM engine (with its EAGLE-3 drafter) for the actor's whole life.

Ray Data calls it with one prepared work unit at a time. The actor is async: several units
are in flight at once and their requests overlap inside the engine, so the engine does not
drain at a unit's tail. Each unit is committed to the output location (its outputs, errors
and marker with its stats row) off the event loop, and the stats row is returned to the
driver.

When the engine dies (vLLM's EngineCore process killed by a GPU fault, CUDA OOM or the OOM
killer; every call then raises EngineDeadError), the actor commits nothing: it records the
death and, for each unit in flight, its suspects (rows submitted and not finished), then
exits, so that Ray restarts it with a fresh engine and retries its units. A unit that was in
flight at `retries.isolate_after_attempts` deaths is isolated: its other rows run as usual,
its suspects run alone in the engine, half of them at a time, and a row that kills the
engine when it is the only one in it goes to errors/ as `EngineCrash`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import time
from typing import Any

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.completions import output_rows, reasoning_parser
from pipeline.engine import engine_kwargs, prepare_process_env, schedule_text
from pipeline.metrics import ReplicaMetrics
from pipeline.outputs import OutputLocation
from pipeline.stats import Acceptance
from pipeline.storage import Storage
from pipeline.sampling import row_sampling_params
from pipeline.units import unit_of
from schemas import ErrorRow, OutputRow, UnitStats, arrow_schema


# Errors of a request that are the row's own (vLLM refused it): retrying cannot help.
FINAL_GENERATE_ERRORS = (ValueError, TypeError)


def lora_requests(config: JobConfig) -> dict[str, Any]:
    """vLLM LoRARequest of each configured adapter, from this node's copy of it."""
    if not config.lora:
        return {}
    from vllm.lora.request import LoRARequest

    from pipeline.model_cache import localize

    storage = Storage.from_config(config.storage)
    return {
        name: LoRARequest(name, number, localize(path, storage))
        for number, (name, path) in enumerate(sorted(config.lora.adapters.items()), start=1)
    }


class EngineCrash(RuntimeError):
    """The row killed the engine when it was the only one in it."""


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
        # An isolated unit's suspects run alone in the engine: they wait for the units in
        # flight and hold off new ones.
        self.isolation = asyncio.Lock()
        self.units_generating = 0
        self.isolated: str | None = None
        self.in_flight: dict[str, set[int]] = {}  # unit -> rows submitted and not finished
        self.dying = False
        self.metrics = ReplicaMetrics(job_id, self.actor_id)
        self.lora_requests = lora_requests(self.config)
        tokenizer = self.engine.get_tokenizer()
        self.decode = lambda token_id: tokenizer.decode([token_id])
        self.reasoning_parser = reasoning_parser(self.config.chat.reasoning_parser, tokenizer)

    def __del__(self):
        # Ray Data calls it when it shuts the pool down: the engine stops before its process
        # ends, instead of its output handler finding EngineCore gone and logging an error.
        engine = getattr(self, "engine", None)
        if engine is not None and not getattr(self, "dying", False):
            engine.shutdown()

    async def _generate(self, unit_id: str, i: int, row: dict[str, Any]):
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        params = row_sampling_params(row, output_kind=RequestOutputKind.FINAL_ONLY)
        self.in_flight.setdefault(unit_id, set()).add(i)
        final = None
        try:
            prompt = TokensPrompt(prompt_token_ids=row["prompt_token_ids"])
            lora = self.lora_requests.get(row["lora"]) if row.get("lora") else None
            async for output in self.engine.generate(prompt, params, f"{unit_id}-{i}", lora_request=lora):
                final = output
        except EngineDeadError as exc:
            await self._engine_died(exc)
        if self.engine.errored:
            await self._engine_died(RuntimeError("the engine reports an error"))
        self.in_flight[unit_id].discard(i)
        return final

    async def _generate_all(self, unit_id: str, rows: list[dict], todo: list[int]) -> dict[int, Any]:
        results = await asyncio.gather(*(self._generate(unit_id, i, rows[i]) for i in todo), return_exceptions=True)
        return dict(zip(todo, results))

    async def _engine_died(self, exc: BaseException) -> None:
        """Record the death and each unit's suspects, then end the process: nothing of the
        units in flight is committed, and Ray restarts the actor and retries them."""
        if self.dying:  # another request of this actor is already recording it
            await asyncio.Event().wait()
        self.dying = True
        suspects = {unit: sorted(rows) for unit, rows in self.in_flight.items() if rows}
        event = {
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "actor_id": self.actor_id,
            "node_id": self.node_id,
            "error": f"{type(exc).__name__}: {exc}",
            "units": sorted(suspects),
        }

        def record():
            for unit, rows in suspects.items():
                alone = unit == self.isolated and len(rows) == 1
                self.location.record_suspects(unit, rows, alone)
            self.location.record_engine_death(event)

        try:
            await asyncio.to_thread(record)
        finally:
            os._exit(1)

    async def _generate_isolated(self, unit_id: str, rows: list[dict], todo: list[int], suspects: dict) -> dict[int, Any]:
        """Rows that were not in flight at the unit's last engine death run as usual; its
        suspects run alone in the engine, half of them at a time, so that the next death
        narrows them down. A suspect that killed the engine alone is not run again."""
        if suspects["alone"]:
            (culprit,) = suspects["rows"]
            crash = EngineCrash(f"the engine died each time this row was in it, the last time alone (unit {unit_id})")
            results = await self._generate_all(unit_id, rows, [i for i in todo if i != culprit])
            return {**results, **({culprit: crash} if culprit in todo else {})}
        suspect_rows = [i for i in todo if i in set(suspects["rows"])]
        results = await self._generate_all(unit_id, rows, [i for i in todo if i not in set(suspect_rows)])
        self.units_generating -= 1  # the engine is the suspects' alone: wait for the others
        try:
            async with self.isolation:
                while self.units_generating:
                    await asyncio.sleep(0.05)
                self.isolated = unit_id
                half = max(1, (len(suspect_rows) + 1) // 2)
                for chunk in (suspect_rows[:half], suspect_rows[half:]):
                    results.update(await self._generate_all(unit_id, rows, chunk))
        finally:
            self.isolated = None
            self.units_generating += 1
        return results

    async def __call__(self, batch: pa.Table) -> pa.Table:
        received = time.time()
        unit_id, source, first_row = unit_of(batch)
        rows = batch.drop_columns(["metadata"]).to_pylist()
        todo = [i for i, r in enumerate(rows) if r["error_kind"] is None]

        crashes_before = await asyncio.to_thread(self.location.start_attempt, unit_id)
        suspects = None
        if crashes_before >= self.config.retries.isolate_after_attempts:
            suspects = await asyncio.to_thread(self.location.read_suspects, unit_id)
        async with self.isolation:  # not while another unit's suspects run alone
            self.units_generating += 1
        started = time.time()
        try:
            if suspects is None:
                results = await self._generate_all(unit_id, rows, todo)
            else:
                results = await self._generate_isolated(unit_id, rows, todo, suspects)
        finally:
            self.units_generating -= 1
            self.in_flight.pop(unit_id, None)
        engine_seconds = time.time() - started

        outputs, output_index, errors = [], [], []
        total = Acceptance()
        prompt_tokens = generated_tokens = generated_ids = 0
        for row in rows:
            if row["error_kind"] is not None:
                errors.append(self._error(row, "validate", row["error_kind"], row["error_field"], row["error_message"]))
        for i in todo:
            row, result = rows[i], results[i]
            if isinstance(result, BaseException) or result is None:
                final = isinstance(result, (EngineCrash, *FINAL_GENERATE_ERRORS))
                errors.append(self._error(row, "generate", type(result).__name__, None, str(result), retryable=not final))
                continue
            if not result.finished:
                errors.append(
                    self._error(row, "generate", "Unfinished", None, "the engine returned no final output", retryable=True)
                )
                continue
            if any(c.finish_reason == "error" for c in result.outputs):
                # vLLM ended the request itself, e.g. "grammar rejected tokens": its text is not an output.
                errors.append(self._error(
                    row, "generate", "RequestFailed", None,
                    "vLLM ended the request with finish_reason 'error' (its engine log says why, e.g. a grammar that "
                    "rejected a token)", retryable=True,
                ))
                continue
            samples, acceptance = output_rows(result, json.loads(row["sampling"]), self.decode, self.reasoning_parser)
            total = total + acceptance
            prompt_tokens += len(result.prompt_token_ids or row["prompt_token_ids"])
            generated_tokens += sum(sample["generated_tokens"] for sample in samples)
            shared = dict(
                id=row["id"], max_tokens_clipped=bool(row["max_tokens_clipped"]), model=self.model_id, drafter=self.drafter_id,
                lora=row.get("lora"),
                source=row["source"], row=row["row"], unit_id=unit_id,
            )
            outputs += [{**sample, **shared} for sample in samples]
            output_index += [i] * len(samples)
            generated_ids += 1

        spec = self.config.speculative
        stats = UnitStats(
            unit_id=unit_id,
            source=source,
            first_row=first_row,
            actor_id=self.actor_id,
            node_id=self.node_id,
            rows=len(rows),
            output_rows=generated_ids,
            error_rows=len(errors),
            samples=len(outputs),
            retryable_error_rows=sum(e["retryable"] for e in errors),
            clipped_rows=sum(1 for o in outputs if o["max_tokens_clipped"] and o["sample_index"] == 0),
            first_error=f"{errors[0]['error_kind']}: {errors[0]['id']}" if errors else None,
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            started_at=started,
            wall_seconds=0.0,
            engine_seconds=engine_seconds,
            tokens_per_second=generated_tokens / engine_seconds if engine_seconds > 0 else 0.0,
            speculative=spec.enabled,
            num_speculative_tokens=spec.num_speculative_tokens if spec.enabled else 0,
            depth_schedule=schedule_text(spec.depth_schedule) if spec.enabled and spec.depth_schedule else None,
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
    def _error(row: dict, stage: str, kind: str, field: str | None, message: str, retryable: bool = False) -> dict:
        return ErrorRow(
            id=row["id"], source=row["source"], row=row["row"], stage=stage, error_kind=kind, field=field,
            message=message, retryable=retryable, unit_id=row["unit_id"],
        ).model_dump()
