"""The job runner: one attempt at a job, read top to bottom in `JobAttempt.run`:

    plan (footers -> work units -> minus the units in _commits/; pipeline/job/plan.py)
    -> the checks before any engine -> the lease on the output location
    -> start (the probe's rows, Ray, the attempt's manifest)
    -> generate: Ray Data graph after graph (pipeline/graph/, run by pipeline/job/graph_run.py)
       until every unit is committed, the guard turned speculation off or a node was lost
    -> close: the attempt's counts, cleanup, its stats file, the totals, `_job.json`

`_job.json` is written in one place, `JobAttempt.save`, and only while the lease is this run's.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import pyarrow as pa

from pipeline.cluster import check_cluster_paths, check_schedulable, cluster_capacity
from pipeline.cluster.job_board import start_board
from pipeline.cluster.startup import StartClock, ray_init
from pipeline.commit.lease import LeaseLost, OutputLease
from pipeline.commit.outputs import OutputLocation
from pipeline.config import JobConfig
from pipeline.inputs.units import WorkUnit, plan_units
from pipeline.job.console import print_line, say
from pipeline.job.graph_run import AttemptProgress, GraphOutcome, run_graph
from pipeline.job.manifest import (
    added_by,
    close_killed_attempt,
    finished_status,
    new_manifest,
    plain_text,
    plan_summary,
)
from pipeline.job.plan import (
    JobPlan,
    RunOptions,
    check_before_any_engine,
    model_id,
    plan_job,
    results_fingerprint,
)
from pipeline.job.speculation import JobSpeculation
from pipeline.speculation.guard import speculation_turned_off
from pipeline.speculation.probe import job_probe_rows, refusal, rejudged
from pipeline.stages.stats import billed_replicas, totals_from_stats
from pipeline.storage import StorageUnavailable
from schemas import Attempt, EngineDeath, JobManifest, Lease, ProbeResult, utc_timestamp

if TYPE_CHECKING:
    from pipeline.graph.engine_stage import EngineActorArgs

log = logging.getLogger("specbatch")


def run_job(config: JobConfig, clock: Optional[StartClock] = None, **options: Any) -> JobManifest:
    """Run, or resume, the job at `config.output_uri` (options: RunOptions' fields). Units
    already committed there are skipped, except units with retryable error rows (and with
    `retry_errors`, units with any error rows), which run again; a finished job reruns without
    starting an engine. `clock`: where the start's time line begins (`specbatch run`: its
    process start)."""
    return JobAttempt(config, RunOptions(**options), clock or StartClock()).run()


class JobAttempt:
    """One attempt at a job. `unit_stats`: unit -> its stats row, for the units this attempt committed."""

    def __init__(self, config: JobConfig, options: RunOptions, clock: StartClock):
        self.config, self.options, self.clock = config, options, clock
        self.unit_stats: dict[str, dict] = {}
        self.plan: JobPlan
        self.lease: OutputLease
        self.manifest: JobManifest
        self.speculation: JobSpeculation  # the driver's one place to ask the speculation policy
        self.probe_rows: tuple[list, int] = ([], 0)  # for the first graph's first engine to measure
        self.started = 0.0  # when generation began: the attempt's wall time and what its cleanup may delete

    def run(self) -> JobManifest:
        self.plan = plan_job(self.config, self.options.job_id, self.options.restart, self.options.retry_errors)
        self._calibrated()
        self._check()
        dead_owner = self._take_lease()
        try:
            self._start(dead_owner)
            self._generate_and_close()
        finally:
            self._release_lease()
        return self.manifest

    @property
    def location(self) -> OutputLocation:
        return self.plan.location

    @property
    def record(self) -> Attempt:
        return self.manifest.attempts[-1]

    def write_stats(self, committed: Optional[set[str]] = None) -> pa.Table:
        """This attempt's stats file (pipeline/commit/outputs.write_stats), written from here
        alone: every STATS_FLUSH_SECONDS while it runs, at its end (`committed`: then with every
        committed unit no other file holds, returning them all), and when it was fenced."""
        return self.location.write_stats(self.record.number, list(self.unit_stats.values()), committed)

    def save(self) -> None:
        """`_job.json`, written here alone. A fenced attempt replaces only its own record (a
        compare-and-swap): the location's manifest is the new owner's."""
        if self.record.status == "fenced":
            self.location.record_fenced_attempt(self.record.model_dump(mode="json"))
        else:
            self.location.write_manifest(self.manifest.model_dump(mode="json"))

    # ------------------------------------------------------------ the steps, in order

    def _calibrated(self) -> None:
        """The job's calibration (one GET when there is one: pipeline/speculation/calibrations.py)
        and, with speculative.depth_from: calibration, the setting it recommends."""
        self.speculation = JobSpeculation(self.config, self.plan)
        self.config = self.speculation.configured(self.config, lambda said: say(self.options.progress, said))

    def _check(self) -> None:
        if self.plan.todo:
            for warning in check_before_any_engine(self.config, self.plan):
                log.warning("drafter check downgraded to a warning: %s", warning)

    def _take_lease(self) -> Optional[Lease]:
        """The lease, and the dead run's it took over (if any)."""
        self.lease = OutputLease(self.location, self.config.lease, self.plan.job_id, self.plan.attempt_number)
        announce = print_line if self.options.progress else log.warning
        dead_owner = self.lease.acquire(take_over=self.options.take_over, say=announce)
        self.location.write_only_while(self.lease.still_ours)
        return dead_owner

    def _start(self, dead_owner: Optional[Lease]) -> None:
        probe = self._drafter_probe()
        self.clock.mark("planned")
        cluster = self._join_cluster() if self.plan.todo else None
        if self.options.restart:
            self.location.clear()
        if self.plan.grouping.copy_to_write:
            self._group_rows()
        if self.plan.previous:
            close_killed_attempt(self.plan.previous, dead_owner)
        self.manifest = new_manifest(self.config, self.plan, cluster, probe)
        self.save()
        say(self.options.progress, plan_summary(self.plan.units, self.plan.todo, len(self.plan.again)))

    def _generate_and_close(self) -> None:
        record, plan = self.record, self.plan
        self.started = self.clock.mark("generating")  # the attempt's wall time, on the start's time line too
        try:
            committed = plan.committed
            if plan.todo:
                self._generate()
                committed = self.location.committed_units()
            missing = [u.unit_id for u in plan.units if u.unit_id not in committed]
            if missing:
                raise RuntimeError(
                    f"{len(missing)} of {len(plan.units)} units were not committed (e.g. {missing[0]}); rerun to "
                    "finish them"
                )
            record.status = self.manifest.status = "succeeded"
        except KeyboardInterrupt:
            record.status = self.manifest.status = "interrupted"
            record.error = self.manifest.error = "interrupted (Ctrl-C, SIGINT); rerun the same command to resume"
            raise
        except LeaseLost as lost:
            self._close_fenced(lost)
            raise
        except BaseException as exc:
            record.status = self.manifest.status = "failed"
            record.error = self.manifest.error = plain_text(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            if record.status != "fenced":
                self._close_unless_the_store_is_down()

    # ------------------------------------------------------------ start

    def _drafter_probe(self) -> Optional[ProbeResult]:
        """The probe's part in this attempt: a verdict already in, or the rows (`probe_rows`) for
        the job's first engine to measure. A resume of the same settings keeps the earlier
        verdict, judged against today's floor, and refuses at once a drafter it refused; other
        settings probe again."""
        config, plan = self.config, self.plan
        spec, previous = config.speculative, plan.previous
        if not (plan.todo and spec.enabled and spec.probe.rows):
            return None
        if previous and speculation_turned_off(previous.guard_events):
            return previous.probe
        if (
            previous
            and previous.probe
            and previous.results_fingerprint == results_fingerprint(config, plan.target, plan.drafter)
        ):
            kept = rejudged(config, previous.probe)
            rejected = refusal(config, kept)
            if rejected:
                raise rejected
            return kept
        rows, near_limit_rows = job_probe_rows(config, plan.location.storage, plan.todo)
        if rows:
            say(
                self.options.progress,
                f"drafter probe: {len(rows)} rows of the input, measured on the job's first engine before any unit "
                "commits",
            )
        self.probe_rows = (rows, near_limit_rows)
        return None

    def _group_rows(self) -> None:
        """The input copied once in prefix order (pipeline/graph/regroup.py); the units become
        row ranges of the copy. Nothing is committed yet: a job is grouped before its first unit."""
        from pipeline.graph.regroup import write_grouped_copy
        from pipeline.inputs.shape import RowShape

        plan, started = self.plan, time.time()
        grouping = plan.grouping
        grouping.record.files = write_grouped_copy(
            self.location.storage,
            self.location.uri,
            plan.inputs.files,
            grouping.order,
            grouping.kinds,
            self.config.resources.rows_per_unit,
            RowShape.for_job(self.config),
        )
        grouping.record.sources = [f.uri for f in plan.inputs.files]
        grouping.order = grouping.kinds = None
        plan.units = plan.todo = plan_units(grouping.record.files, self.config.resources.rows_per_unit, plan.head)
        say(
            self.options.progress,
            f"grouped {plan.inputs.rows:,} rows by shared prompt prefix in {time.time() - started:.1f} s "
            f"({grouping.record.reason}): {len(grouping.record.files)} file(s) under {self.location.uri}/_grouped/",
        )
        self.clock.mark("grouped")

    def _join_cluster(self) -> str:
        """Joins (or starts) Ray; refuses local paths a multi-node cluster cannot read, and a
        graph that cannot fit, before any engine starts."""
        self.clock.mark("ray_started")
        logs, cluster = ray_init(self.options.verbose, self.options.address)
        self.clock.mark("ray_ready")
        say(self.options.progress, f"Ray: {cluster}")
        if logs and not self.options.verbose:
            say(self.options.progress, f"Ray's and vLLM's logs: {logs} (--verbose shows them here)")
        nodes, can_add = cluster_capacity()
        check_cluster_paths(self.config, len(nodes))
        check_schedulable(self.config, nodes, can_add)
        return cluster

    # ------------------------------------------------------------ generate

    def _generate(self) -> None:
        """Graph after graph over the units not committed yet, until one finishes. A graph is
        rebuilt when the guard turns speculation off (leaving it shuts it down, killing its
        engines) and when it fails after a node left (up to `retries.max_node_losses`). The
        probe's rows go to the first graph's board; later graphs have the verdict already."""
        # The engine actor's module imports Ray's metrics: only a run with work imports it.
        from pipeline.graph import build_dataset

        todo = self.plan.todo
        disabled = speculation_turned_off(self.manifest.guard_events)  # by an earlier attempt's guard: kept off
        guard = self.speculation.guard(self.config, self._drafter_id() is not None and not disabled, self.record.number)
        progress = AttemptProgress(self, sum(u.rows for u in todo) + self.record.skipped_rows, guard)
        probe_rows = self.probe_rows
        self._skip_a_trial_too_small(self._drafter_id() is not None and not disabled)
        while todo:
            config, engines = self._next_graph(disabled, probe_rows, todo, progress)
            outcome = run_graph(
                build_dataset(config, todo, engines, self.plan.ids.duplicates), todo, progress, engines.board
            )
            probe_rows = ([], 0)  # judged by this graph, or refused (and then the job has stopped)
            if outcome is GraphOutcome.FINISHED:
                return
            disabled = disabled or outcome is GraphOutcome.SPECULATION_OFF
            committed = self.location.committed_units()  # what the stopped engines committed
            todo = [u for u in todo if u.unit_id not in committed]

    def _drafter_id(self) -> Optional[str]:
        return model_id(self.plan.drafter) if self.plan.drafter and self.config.speculative.enabled else None

    def _next_graph(
        self, disabled: bool, probe_rows: tuple[list, int], todo: list[WorkUnit], progress: AttemptProgress
    ) -> tuple[JobConfig, EngineActorArgs]:
        """The next graph's config and what its engines are built with, as the speculation policy
        says (pipeline/job/speculation.py): without the drafter once the guard, the trial or the
        prediction turned speculation off; with the trial's plan while it is to run."""
        from pipeline.graph import engine_stage

        rows = sum(u.rows for u in todo)
        config, speculating, trial = self.speculation.graph(self.config, self.manifest, disabled, rows, self.plan.head)
        drafter = self._drafter_id() if speculating else None
        if not speculating:
            progress.guard, probe_rows = None, ([], 0)
        board = start_board(*probe_rows)
        target = model_id(self.plan.target)
        return config, engine_stage.EngineActorArgs(
            target, drafter, self.manifest.job_id, disabled, board, self.lease.fence, trial
        )

    def _skip_a_trial_too_small(self, speculating: bool) -> None:
        """A job of too few units skips the speculation trial before any engine, and says why."""
        manifest = self.manifest
        if not speculating or manifest.trial is not None:
            return
        manifest.trial = self.speculation.trial_skipped(self.config, self.plan.todo, self.plan.head)
        if manifest.trial is not None:
            say(self.options.progress, manifest.trial.reason)
            self.save()

    # ------------------------------------------------------------ close

    def _close(self) -> None:
        """The attempt's end, also when it failed: its counts, the cleanup, its stats file, the totals."""
        record, location, plan, config, manifest = self.record, self.location, self.plan, self.config, self.manifest
        committed = plan.committed
        if plan.todo:  # what the engines committed, also when this attempt failed
            committed = location.committed_units()
            # also units that stopped engines committed after the driver stopped listening
            record.processed_rows = sum(u.rows for u in plan.todo if u.unit_id in committed)
        previous = plan.previous
        if previous is not None and previous.status in ("succeeded", "completed_with_errors") and not plan.todo:
            # a rerun of a finished job: nothing to tidy, nothing new to count
            stats = plan.done if plan.done is not None else location.stats_table(committed)
        else:  # files of commits that never finished or were superseded; this attempt's stats file
            location.cleanup(committed, since=self.started, generation=self.lease.lease.generation)
            stats = self.write_stats(committed)
            record.added = added_by(list(self.unit_stats.values()), plan.inputs.files, plan.previous)
        self._end_record()
        manifest.ended_at = record.ended_at
        wall = sum(a.wall_seconds for a in manifest.attempts)
        manifest.totals = totals_from_stats(stats, plan.inputs.rows, wall, billed_replicas(config, stats))
        manifest.speculation = self.speculation.verdict(config, manifest)
        if manifest.status == "succeeded":
            record.status = manifest.status = finished_status(manifest.totals, config)
            location.clear_progress()  # a failed attempt keeps its engines' last state for a look afterwards
        self.save()

    def _close_unless_the_store_is_down(self) -> None:
        """`_close`; when the attempt failed and the store does not answer, the failure goes on
        and the record it could not write is said (the next attempt closes it)."""
        try:
            self._close()
        except StorageUnavailable as down:
            if self.record.status != "failed":
                raise
            log.error("the failed attempt's record was not written to %s: %s", self.location.uri, down)

    def _release_lease(self) -> None:
        """The lease given back; a store that does not answer keeps it until the next run takes it
        over (at once on this host, where this process is gone by then; elsewhere once it is stale)."""
        try:
            self.lease.release()
        except StorageUnavailable as down:
            log.warning("the lease on %s was not released: %s", self.location.uri, down)

    def _close_fenced(self, lost: LeaseLost) -> None:
        """What a run that lost the location did under its own lease, into its own attempt's
        record and stats file; nothing of the new owner's is touched (no cleanup, no totals, no
        manifest). Its units are those it heard of and those its engines committed under its
        lease that it had not heard of yet (their markers name its lease's owner)."""
        record, location, owner = self.record, self.location, self.lease.lease.owner
        not_recorded = location.committed_units() - self.plan.committed - set(self.unit_stats)
        for unit, marker in location.markers(not_recorded).items():
            if marker.stats.lease_owner == owner:
                self.unit_stats[unit] = marker.stats.model_dump()
        taken = (
            f"run {lost.owner.owner} (attempt {lost.owner.attempt})" if lost.owner else "nobody (its lease was removed)"
        )
        record.status = "fenced"
        record.error = (
            f"lost the output location to {taken} while it ran: it committed {len(self.unit_stats)} units under "
            "its own lease, then stopped"
        )
        record.processed_rows = sum(r["rows"] for r in self.unit_stats.values())
        self._end_record()
        self.write_stats()
        self.save()

    def _end_record(self) -> None:
        """The attempt's record ends (a closed attempt's and a fenced one's): its wall time, and the
        engine deaths and hangs recorded since it began generating."""
        record = self.record
        record.wall_seconds, record.ended_at = time.time() - self.started, utc_timestamp()
        if self.plan.todo:
            deaths = self.location.engine_deaths(since=self.started)
            record.engine_deaths = [EngineDeath.model_validate(e) for e in deaths]
