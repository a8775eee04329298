"""The circuit breaker: a job whose rows keep failing stops, instead of writing a dataset of
errors overnight. The driver feeds it every unit-stats row as units commit.

It trips when the error rows of the last `retries.breaker_window_units` units are more than
`retries.max_error_fraction` of their rows, or when `retries.breaker_consecutive_units` units
in a row have retryable (infrastructure) errors. Its message names the error kind, an example
id and the unit.
"""

from __future__ import annotations

from collections import deque

from pipeline.config import RetriesConfig


class TooManyErrors(RuntimeError):
    """The circuit breaker stopped the job."""


class ErrorBreaker:
    def __init__(self, config: RetriesConfig):
        self.config = config
        self.window: deque[dict] = deque(maxlen=config.breaker_window_units)
        self.retryable_streak: list[dict] = []

    def observe(self, row: dict) -> None:
        """One unit-stats row (schemas.UnitStats as a dict); raises TooManyErrors when it trips."""
        self.window.append(row)
        self.retryable_streak = [*self.retryable_streak, row] if row["retryable_error_rows"] else []
        if len(self.retryable_streak) >= self.config.breaker_consecutive_units:
            raise TooManyErrors(
                f"{len(self.retryable_streak)} units in a row have errors that are not their rows' own "
                f"(retries.breaker_consecutive_units = {self.config.breaker_consecutive_units}): "
                f"{self._example(self.retryable_streak)}"
            )
        if len(self.window) == self.window.maxlen:
            rows = sum(r["rows"] for r in self.window)
            errors = sum(r["error_rows"] for r in self.window)
            if rows and errors / rows > self.config.max_error_fraction:
                failing = [r for r in self.window if r["error_rows"]]
                raise TooManyErrors(
                    f"{errors} of the {rows} rows of the last {len(self.window)} units failed ({errors / rows:.1%}, "
                    f"above retries.max_error_fraction = {self.config.max_error_fraction:.1%}): "
                    f"{self._example(failing)}"
                )

    @staticmethod
    def _example(rows: list[dict]) -> str:
        last = rows[-1]
        return f"e.g. {last['first_error']} in unit {last['unit_id']} ({last['source']})"
