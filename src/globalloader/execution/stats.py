"""What a Loader spends its time on, per stage, so a user can see where the stall is.

Workers time every stage of every task (read, each map, collate, transport) and send the totals
with each result; the consumer adds how long `next()` waited and how long the training step
between two `next()` calls took. If the consumer waits, loading is the bottleneck; if workers sit
idle, the training step is. The torch drop-in records into the same object (its workers' stages
are fetch, collate and transport), so both front doors give one structure and one report.
"""

from __future__ import annotations

import warnings
from typing import Any

from globalloader.execution.timeline import StepTimeline


def warn_skipped(skipped: list[tuple[int, str]], epoch: int) -> None:
    """on_error="skip" never drops a sample silently: one warning per epoch that skipped any."""
    if skipped:
        first = ", ".join(f"index {i}: {msg}" for i, msg in skipped[:3])
        warnings.warn(
            f"globalloader: skipped {len(skipped)} bad sample(s) in epoch {epoch} (on_error='skip'); first: {first}",
            stacklevel=4,
        )


class LoaderStats:
    def __init__(self) -> None:
        self._stages: dict[str, list[float]] = {}
        self._tasks = 0
        self._worker_idle = 0.0
        self._consumer = {"items": 0, "wait_s": 0.0, "busy_s": 0.0}
        self._skipped = 0
        self.timeline = StepTimeline()  # the same waits over time, for `Loader.report()`

    def add_task(self, timer: dict[str, list[float]], idle: float, skipped: int) -> None:
        for stage, (items, busy) in timer.items():
            entry = self._stages.setdefault(stage, [0, 0.0])
            entry[0] += items
            entry[1] += busy
        self._tasks += 1
        self._worker_idle += idle
        self._skipped += skipped

    def add_skipped(self, count: int) -> None:
        """Samples dropped before any task ran them (shared mode: the server could not load them)."""
        self._skipped += count

    def new_pass(self) -> None:
        self.timeline.begin()

    def consumer_wait(self, seconds: float) -> None:
        self._consumer["items"] += 1
        self._consumer["wait_s"] += seconds
        self.timeline.step(seconds)

    def consumer_busy(self, seconds: float) -> None:
        self._consumer["busy_s"] += seconds

    def loop_seconds(self) -> tuple[float, float]:
        """(seconds the training loop waited for data, seconds it spent in its own body) so far."""
        return self._consumer["wait_s"], self._consumer["busy_s"]

    def report(self) -> dict[str, Any]:
        stages = {name: {"items": int(n), "busy_s": round(busy, 6)} for name, (n, busy) in self._stages.items()}
        return {
            "stages": stages,
            "workers": {
                "tasks": self._tasks,
                "busy_s": round(sum(s["busy_s"] for s in stages.values()), 6),
                "wait_s": round(self._worker_idle, 6),
            },
            "consumer": {k: round(v, 6) if isinstance(v, float) else v for k, v in self._consumer.items()},
            "skipped": self._skipped,
        }
