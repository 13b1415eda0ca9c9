"""BatchQueue: the per-shuffle Ray actor that launches epochs and hands trainers their outputs.

One named actor per shuffle job, created by rank 0 on its node (Ray ends an actor with the
process that created it, so it lives exactly as long as rank 0's process) and found by name by
the other ranks. It never touches row data: its scheduler submits each epoch's map/reduce
tasks, and trainers ask it for the object refs of their reducer outputs, then fetch the data
straight from the object store.

Pipelining and throttling: an epoch is *live* from its launch until every rank has moved past
it (asked for a later epoch or finished it). When a rank asks for epoch e, epochs are launched
in order from e on while fewer than `max_concurrent_epochs` are live, so shuffling of the next
epochs runs while trainers train on this one, and memory holds at most that many epochs.
`ShuffleScheduler` decides the order in which the launched epochs' tasks run.

An async actor: a rank waiting for an epoch (held back by a slower rank) does not block the
calls that would release it. Waits are bounded by the caller's `wait_s`; the caller decides
when waiting has lasted too long (a dead trainer) and raises.

Restarts: every rank hands `attach` a small object its own process owns (its presence). A rank
that attaches again replaces the old attachment only once that object is gone (Ray reports its
owner dead), so a trainer restarted from its `state_dict()` rejoins the running shuffle, while a
second live trainer with the same rank is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.exceptions as rex

from globalloader.errors import GlobalLoaderError
from globalloader.ray.layout import ShuffleLayout, make_layout
from globalloader.ray.reader import Part
from globalloader.ray.schedule import ShuffleScheduler


@dataclass(frozen=True)
class ShuffleSpec:
    """Everything every rank must agree on; `key` is compared when a rank attaches."""

    files: tuple[Part, ...]  # what each map task reads
    columns: tuple[str, ...] | None
    num_epochs: int
    num_trainers: int
    batch_size: int
    num_reducers: int
    max_concurrent_epochs: int
    seed: int
    drop_last: bool

    @property
    def key(self) -> str:
        return repr(self)

    @property
    def expands(self) -> bool:
        """The chain drops or makes rows (filter, flat_map): each epoch's rows are known only once
        its stage-1 tasks ran, and so are its batch sizes."""
        return any(part.chain is not None and part.chain.expands for part in self.files)

    def layout(self, file_rows: np.ndarray) -> ShuffleLayout:
        """The layout of an epoch whose parts hold `file_rows` rows."""
        return make_layout(file_rows, self.num_trainers, self.batch_size, self.num_reducers, self.drop_last)


@ray.remote(num_cpus=0)
class BatchQueue:
    """Launches each epoch's shuffle and queues each rank's reducer outputs (see module doc)."""

    def __init__(self, spec: ShuffleSpec) -> None:
        self._spec = spec
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self._scheduler = ShuffleScheduler(
            spec.files, spec.columns, spec.layout, spec.expands, spec.num_reducers, spec.seed, limit=max(2, cpus + 1)
        )
        self._nodes = self._scheduler.nodes
        self._pos: dict[int, int] = {}  # rank -> lowest epoch it may still ask for
        self._taken: dict[tuple[int, int], str] = {}  # (rank, epoch) already read -> the ticket that took it
        self._live: set[int] = set()  # launched, not yet released epochs
        self._released: set[int] = set()
        self._presence: dict[int, ray.ObjectRef] = {}  # rank -> object its process owns
        self._next_launch: int | None = None
        self._changed = asyncio.Condition()

    async def attach(self, rank: int, key: str, node_id: str, presence: list[ray.ObjectRef]) -> dict[str, Any]:
        """Register a rank; returns its batches and rows per epoch (None: a chain that expands),
        or why it cannot attach.

        `presence`: [an object the rank's process owns] (in a list, so Ray passes the ref).
        """
        if key != self._spec.key:
            return {"error": "mismatch", "spec": self._spec.key}
        if rank in self._presence and self._presence[rank] != presence[0]:  # equal: a retried call
            if await _owner_alive(self._presence[rank]):
                return {"error": "attached"}
            self._taken = {(r, e): t for (r, e), t in self._taken.items() if r != rank}  # restarted: may read again
            self._pos.pop(rank, None)
        self._presence[rank] = presence[0]
        self._nodes[rank] = node_id
        fixed = self._scheduler.fixed_layout
        if fixed is None:
            return {"batches": None, "rows": None}
        return {"batches": fixed.num_batches, "rows": int(fixed.file_rows.sum())}

    def finished(self) -> bool:
        """True once every rank has moved past the last epoch (the queue can go)."""
        return len(self._pos) == self._spec.num_trainers and min(self._pos.values()) >= self._spec.num_epochs

    async def take(self, rank: int, epoch: int, wait_s: float, ticket: str) -> tuple[str, Any]:
        """Rank `rank` moves to `epoch`: ("ok", its batches) once the epoch is cut, else after
        `wait_s` ("wait", why it is held back); ("error", message) if it can never come. Its
        batches: {"batch_sizes", "reducer_batches"} (see `_batches`), or {"failed": the error of a
        stage-1 task}. `ticket` names one iteration: a call retried with it (its answer was lost)
        is answered again."""
        if self._taken.get((rank, epoch)) == ticket:
            return await self._batches(rank, epoch)
        if epoch < self._pos.get(rank, 0) or (rank, epoch) in self._taken:
            return "error", (
                f"rank {rank} already read epoch {epoch} or moved past it (each "
                "epoch is shuffled once and read once per rank)"
            )
        if epoch in self._released:
            return "error", self._freed(rank, epoch)
        self._pos[rank] = epoch
        if self._next_launch is not None and epoch < self._next_launch and epoch not in self._live:
            self._live.add(epoch)  # a rank resuming behind the others, before they read any epoch
            self._scheduler.launch(epoch)
        await self._advance()
        try:
            await asyncio.wait_for(self._wait_launched(epoch), wait_s)
        except TimeoutError:
            return "wait", self._holdup()
        if epoch not in self._live:
            return "error", self._freed(rank, epoch)
        try:
            status, batches = await asyncio.wait_for(self._batches(rank, epoch), wait_s)
        except TimeoutError:
            return "wait", f"epoch {epoch}'s chain is still running on its parts ({self._scheduler.describe()})"
        if status == "ok":
            self._taken[(rank, epoch)] = ticket
        return status, batches

    async def _batches(self, rank: int, epoch: int) -> tuple[str, Any]:
        """("ok", rank `rank`'s batch sizes in `epoch` and the batches each of its reducers
        makes) once the epoch is cut; ("error", why) if it was freed."""
        try:
            layout = await self._scheduler.layout(epoch)
        # A stage-1 task failed, or the epoch has too few rows: the trainer raises it.
        except (rex.RayError, GlobalLoaderError) as exc:
            return "ok", {"failed": exc}
        if layout is None:
            return "error", self._freed(rank, epoch)
        return "ok", {
            "batch_sizes": layout.batch_sizes[rank],
            "reducer_batches": layout.reducer_batches[layout.rank_reducers(rank)],
        }

    @staticmethod
    def _freed(rank: int, epoch: int) -> str:
        return (
            f"epoch {epoch} was freed: the other ranks moved past it before rank {rank} asked for it "
            "(a rank restarted from an older state_dict() than the others?): restart every rank from "
            "states saved at the same step"
        )

    async def output(self, rank: int, epoch: int, index: int, wait_s: float) -> tuple[str, Any]:
        """The ref of rank `rank`'s `index`-th output of `epoch`: ("ok", ref) once its reducer
        is submitted, ("wait", why) after `wait_s`, ("error", message) if it is gone."""
        try:  # known once the rank took the epoch
            layout = await asyncio.wait_for(self._scheduler.layout(epoch), wait_s)
        except TimeoutError:
            return "wait", f"epoch {epoch} is not cut yet ({self._scheduler.describe()})"
        except (rex.RayError, GlobalLoaderError) as exc:
            return "error", f"epoch {epoch} failed: {exc}"
        if layout is None:
            return "error", f"epoch {epoch} was released before rank {rank} read it"
        reducer = int(layout.rank_reducers(rank)[index])
        try:
            ref = await asyncio.wait_for(self._scheduler.output(epoch, reducer), wait_s)
        except TimeoutError:
            return "wait", f"its reducer has not started ({self._scheduler.describe()})"
        if ref is None:
            return "error", f"epoch {epoch} was released before rank {rank} read it"
        return "ok", ref

    async def done(self, rank: int, epoch: int) -> None:
        """Rank `rank` finished iterating `epoch`: it may release that epoch's memory."""
        self._pos[rank] = max(self._pos.get(rank, 0), epoch + 1)
        await self._advance()

    async def _wait_launched(self, epoch: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._next_launch is not None and self._next_launch > epoch)

    async def _advance(self) -> None:
        """Release epochs every rank has left, then launch while under the live limit."""
        spec = self._spec
        everyone = len(self._pos) == spec.num_trainers
        low = min(self._pos.values()) if everyone else 0
        for epoch in [e for e in self._live if everyone and e < low]:
            self._live.discard(epoch)
            self._released.add(epoch)
            self._scheduler.release(epoch)  # drops the refs of outputs no rank took
        if self._next_launch is None:
            self._next_launch = min(self._pos.values())
        if everyone:
            self._next_launch = max(self._next_launch, low)
        while self._next_launch < spec.num_epochs and len(self._live) < spec.max_concurrent_epochs:
            self._live.add(self._next_launch)
            self._scheduler.launch(self._next_launch)
            self._next_launch += 1
        async with self._changed:
            self._changed.notify_all()

    def _holdup(self) -> str:
        """Which ranks keep the oldest live epoch alive (so no further epoch can launch)."""
        oldest = min(self._live) if self._live else 0
        missing = [r for r in range(self._spec.num_trainers) if r not in self._pos]
        behind = [r for r, e in sorted(self._pos.items()) if e <= oldest]
        parts = []
        if behind:
            parts.append(f"rank(s) {behind} have not finished epoch {oldest}")
        if missing:
            parts.append(f"rank(s) {missing} never asked for an epoch")
        return "; ".join(parts) or "the queue is waiting for its epochs to be released"


async def _owner_alive(presence: ray.ObjectRef) -> bool:
    """False once the process that owns `presence` has died (Ray then fails any read of it)."""
    with contextlib.suppress(TimeoutError):
        try:
            await asyncio.wait_for(presence, 5.0)
        except (rex.OwnerDiedError, rex.ObjectLostError):
            return False
    return True
