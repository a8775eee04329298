"""The generation stage of the engine actor: a unit's rows as requests to the actor's one
AsyncLLM engine, several units at once, with the engine's death recorded and its suspects
narrowed down.

When the engine dies (vLLM's EngineCore process killed by a GPU fault, CUDA OOM or the OOM
killer; every call then raises EngineDeadError), nothing of the units in flight is committed:
the stage records the death and, for each unit in flight, its suspects (rows submitted and not
finished), then ends the engine's remaining processes and its own, so that Ray restarts the
actor with a fresh engine and retries its units. A unit that was in flight at `retries.isolate_after_attempts` deaths is
isolated: its other rows run as usual, its suspects run alone in the engine, half of them at a
time, and a row that kills the engine when it is the only one in it is an `EngineCrash`.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Optional

from pipeline.commit.outputs import OutputLocation
from pipeline.stages.sampling import row_sampling_params
from schemas import utc_timestamp

PROBE = "probe"  # the drafter probe's requests in `in_flight`: not a unit, never a suspect


class EngineCrash(RuntimeError):
    """The row killed (or hung) the engine when it was the only one in it."""


class EngineHung(RuntimeError):
    """The engine held requests and made no step for its stall limit (pipeline/stages/engine_watch.py)."""


class EngineRequests:
    def __init__(
        self,
        engine,
        location: OutputLocation,
        lora_requests: dict[str, Any],
        end_engine: Callable[[], Any],
        actor_id: str,
        node_id: str,
    ):
        self.engine, self.location, self.lora_requests = engine, location, lora_requests
        self.end_engine = end_engine  # ends the dead engine's processes (pipeline/stages/engine.EngineProcesses)
        self.actor_id, self.node_id = actor_id, node_id
        # An isolated unit's suspects run alone in the engine: they wait for the units in
        # flight and hold off new ones.
        self.isolation = asyncio.Lock()
        self.units_generating = 0
        self.isolated: Optional[str] = None
        self.in_flight: dict[str, set[int]] = {}  # unit -> rows submitted and not finished
        self.dying = False
        # What the other requests of a dying actor wait on until the process ends. Held here:
        # an Event only their own frames referenced would be garbage with its waiters, and the
        # collector would close their coroutines (a GeneratorExit that fails Ray Data's task
        # instead of the actor's death ending it).
        self.never = asyncio.Event()

    async def run(
        self, unit_id: str, rows: list[dict], valid_rows: list[int], suspects: Optional[dict]
    ) -> dict[int, Any]:
        """Each row of `valid_rows`: its final RequestOutput, or the exception that ended it."""
        async with self.isolation:  # not while another unit's suspects run alone
            self.units_generating += 1
        try:
            if suspects is None:
                return await self._generate_all(unit_id, rows, valid_rows)
            return await self._generate_isolated(unit_id, rows, valid_rows, suspects)
        finally:
            self.units_generating -= 1
            self.in_flight.pop(unit_id, None)

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

    async def probe(self, rows: list[dict], concurrency: Optional[int]) -> list:
        """The drafter probe's rows, at most `concurrency` in the engine at once (None: all),
        before any unit of this engine generates: each row's final output, or the exception
        that ended it. An engine death ends the process as above
        (no unit is in flight yet): the restarted actor is handed the rows again."""
        gate = asyncio.Semaphore(concurrency or len(rows))

        async def one(i: int, row: dict):
            async with gate:
                return await self._generate(PROBE, i, row)

        try:
            return await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)), return_exceptions=True)
        finally:
            self.in_flight.pop(PROBE, None)

    async def _generate_all(self, unit_id: str, rows: list[dict], valid_rows: list[int]) -> dict[int, Any]:
        results = await asyncio.gather(
            *(self._generate(unit_id, i, rows[i]) for i in valid_rows), return_exceptions=True
        )
        return dict(zip(valid_rows, results))

    def has_requests(self) -> bool:
        return any(self.in_flight.values())

    async def engine_hung(self, seconds: float, limit: float, stacks: Callable[[], str]) -> None:
        """The engine holds requests and has made no step for `seconds` (over `limit`): ended
        as a dead one is, its processes' stacks (`stacks()`, taken before they are killed) in
        the event."""
        exc = EngineHung(f"the engine made no step for {seconds:.1f} s with requests in it (limit {limit:.1f} s)")
        await self._engine_died(
            exc,
            hang={"seconds_without_progress": round(seconds, 1), "stall_limit_seconds": round(limit, 1)},
            stacks=stacks,
        )

    async def _engine_died(
        self, exc: BaseException, hang: Optional[dict] = None, stacks: Optional[Callable[[], str]] = None
    ) -> None:
        """Record the death (or hang) and each unit's suspects, then end the process: nothing
        of the units in flight is committed, and Ray restarts the actor and retries them."""
        if self.dying:  # another request of this actor is already recording it
            await self.never.wait()
        self.dying = True
        suspects = {unit: sorted(rows) for unit, rows in self.in_flight.items() if rows and unit != PROBE}
        event = {
            "time": utc_timestamp(),
            "actor_id": self.actor_id,
            "node_id": self.node_id,
            "error": f"{type(exc).__name__}: {exc}",
            "units": sorted(suspects),
            "kind": "hung" if hang else "died",
            "rows_in_flight": suspects,
            **(hang or {}),
        }

        def record():
            if stacks is not None:
                event["stacks"] = stacks()
            for unit, rows in suspects.items():
                alone = unit == self.isolated and len(rows) == 1
                self.location.record_suspects(unit, rows, alone)
            self.location.record_engine_death(event)

        try:
            await asyncio.to_thread(record)
        finally:
            try:
                self.end_engine()  # none of them alive when the replacement starts
            finally:
                os._exit(1)

    async def _generate_isolated(
        self, unit_id: str, rows: list[dict], valid_rows: list[int], suspects: dict
    ) -> dict[int, Any]:
        """Rows that were not in flight at the unit's last engine death run as usual; its
        suspects run alone in the engine, half of them at a time, so that the next death
        narrows them down. A suspect that killed the engine alone is not run again."""
        if suspects["alone"]:
            (culprit,) = suspects["rows"]
            crash = EngineCrash(
                f"the engine died or hung each time this row was in it, the last time alone (unit {unit_id})"
            )
            results = await self._generate_all(unit_id, rows, [i for i in valid_rows if i != culprit])
            return {**results, **({culprit: crash} if culprit in valid_rows else {})}
        suspect_rows = [i for i in valid_rows if i in set(suspects["rows"])]
        results = await self._generate_all(unit_id, rows, [i for i in valid_rows if i not in set(suspect_rows)])
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
