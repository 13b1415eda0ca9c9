"""ShuffleScheduler: submit shuffle tasks in the order trainers will need their results.

Ray runs whatever is submitted in roughly first-come order per task kind, so submitting two
epochs at once lets the next epoch's maps and this epoch's reducers interleave at random:
sometimes a trainer finishes an epoch and then waits for most of the next one's maps. Here
tasks wait in a priority queue and only about one per cluster CPU runs at a time, so the
order is ours:

- reducer k of epoch e has priority e*R + k (R reducers per epoch), the order trainers read;
- the maps of epoch e are spread evenly over the reducers of epoch e-1 except its last round
  (one reducer per trainer), so they are done, and the next epoch's first batches nearly so,
  when trainers reach the end of epoch e-1;
- a reducer becomes ready when every map of its epoch has ended.

The CPUs never idle while a task is ready, so throughput does not suffer: only the order
changes. Runs on the batch queue actor's event loop (single-threaded, no locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from globalloader.ray.layout import ShuffleLayout, scatter_table
from globalloader.ray.reader import Part
from globalloader.ray.shuffle import submit_map, submit_reduce

_MAP, _REDUCE = 0, 1
_OBJECTS_PER_MAP = 4  # map outputs a map task returns, split over nodes (see `_groups`)


@dataclass
class _Epoch:
    table: np.ndarray  # rows from file m to reducer k
    group_of: np.ndarray  # reducer -> index of the map output object it reads
    offset: np.ndarray  # (files, reducers): where reducer k's rows start in map m's object
    maps_left: int
    parts: list[list[ray.ObjectRef] | None]  # per map: one object per group
    outputs: list[asyncio.Future[ray.ObjectRef]] = field(default_factory=list)

    def group_rows(self, m: int) -> np.ndarray:
        return np.bincount(self.group_of, weights=self.table[m], minlength=int(self.group_of.max()) + 1).astype(
            np.int64
        )


class ShuffleScheduler:
    """Per-epoch map/reduce tasks, submitted by need and at most `limit` at a time."""

    def __init__(
        self, files: Sequence[Part], columns: Sequence[str] | None, layout: ShuffleLayout, seed: int, limit: int
    ) -> None:
        self._files = list(files)
        self._columns = list(columns) if columns is not None else None
        self._layout = layout
        self._seed = seed
        self.limit = limit
        self.nodes: dict[int, str] = {}  # rank -> node id, for reducer placement
        self._epochs: dict[int, _Epoch] = {}
        self._ready: list[tuple[float, int, int, int, int]] = []  # priority, seq, epoch, kind, i
        self._seq = itertools.count()
        self._running = 0
        self._watchers: set[asyncio.Task[None]] = set()

    def launch(self, epoch: int) -> None:
        """Plan `epoch` and queue its maps; call from the event loop."""
        layout = self._layout
        table = scatter_table(layout, self._seed, epoch)
        reducers, files = table.shape[1], len(self._files)
        mapped = [m for m in range(files) if layout.file_rows[m] > 0]
        loop = asyncio.get_running_loop()
        group_of, offset = self._groups(table)
        state = _Epoch(
            table, group_of, offset, len(mapped), [None] * files, [loop.create_future() for _ in range(reducers)]
        )
        self._epochs[epoch] = state
        span = max(1, reducers - len(layout.batch_sizes))  # the previous epoch minus last round
        for j, m in enumerate(mapped):
            self._push((epoch - 1) * reducers + (j + 1) * span / (len(mapped) + 1), epoch, _MAP, m)
        self._fill()

    def _groups(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Group reducers into the objects a map returns: by node, then by reducer order.

        A map sends a group one object holding the rows of its reducers one after another;
        `offset[m, k]` is where reducer k's rows start in map m's object for its group. One
        object per reducer would cost Ray a few milliseconds each; one per node would keep
        every map output alive until the node's last reducer. So a node's reducers (in the
        order they run) are cut into a few runs, about `_OBJECTS_PER_MAP` objects per map in
        all, and each run's object is freed as soon as its reducers are done. Reducers of a
        rank whose node is not known yet (it has not attached) group by rank.
        """
        nodes = [self.nodes.get(int(r), ("rank", int(r))) for r in self._layout.reducer_rank]
        runs = max(1, -(-_OBJECTS_PER_MAP // len(set(nodes))))
        count: dict[Any, int] = {}
        places = []  # each reducer's place among its node's reducers
        for n in nodes:
            places.append(count.get(n, 0))
            count[n] = places[-1] + 1
        keys: dict[Any, int] = {}
        group_of = np.array(
            [keys.setdefault((n, place * runs // count[n]), len(keys)) for n, place in zip(nodes, places, strict=True)],
            np.int64,
        )
        offset = np.zeros_like(table)
        for g in range(len(keys)):
            members = np.flatnonzero(group_of == g)
            offset[:, members] = np.cumsum(table[:, members], axis=1) - table[:, members]
        return group_of, offset

    def release(self, epoch: int) -> None:
        """Forget `epoch`: tasks not yet started are skipped, unread outputs are dropped."""
        state = self._epochs.pop(epoch, None)
        if state is not None:
            for future in state.outputs:
                if not future.done():
                    future.cancel()

    async def output(self, epoch: int, reducer: int) -> ray.ObjectRef | None:
        """The ref of a reducer's output once submitted (None if the epoch was released)."""
        state = self._epochs.get(epoch)
        if state is None:
            return None
        future = state.outputs[reducer]
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():
                return None
            raise

    def _push(self, priority: float, epoch: int, kind: int, index: int) -> None:
        heapq.heappush(self._ready, (priority, next(self._seq), epoch, kind, index))

    def _fill(self) -> None:
        while self._ready and self._running < self.limit:
            _, _, epoch, kind, index = heapq.heappop(self._ready)
            state = self._epochs.get(epoch)
            if state is None:
                continue
            done = self._submit(epoch, state, kind, index)
            self._running += 1
            watcher = asyncio.get_running_loop().create_task(self._watch(done, epoch, state, kind))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)

    def _submit(self, epoch: int, state: _Epoch, kind: int, index: int) -> ray.ObjectRef:
        layout = self._layout
        if kind == _MAP:
            parts, done = submit_map(
                self._files[index],
                index,
                self._columns,
                state.group_rows(index),
                int(layout.file_rows[index]),
                self._seed,
                epoch,
            )
            state.parts[index] = parts
            return done
        sources = [m for m in range(len(self._files)) if state.table[m, index] > 0]
        group = int(state.group_of[index])
        output, done = submit_reduce(
            index,
            self._seed,
            epoch,
            [self._files[m].name for m in sources],
            [(int(state.offset[m, index]), int(state.table[m, index])) for m in sources],
            [state.parts[m][group] for m in sources],  # type: ignore[index]
            self.nodes.get(int(layout.reducer_rank[index])),
        )
        state.outputs[index].set_result(output)
        if all(f.done() for f in state.outputs):
            state.parts = []  # the reducers hold the map outputs now
        return done

    async def _watch(self, done: ray.ObjectRef, epoch: int, state: _Epoch, kind: int) -> None:
        with contextlib.suppress(Exception):  # a failed task's error reaches trainers anyway
            await done
        self._running -= 1
        if kind == _MAP:
            state.maps_left -= 1
            if state.maps_left == 0 and self._epochs.get(epoch) is state:
                reducers = state.table.shape[1]
                for k in range(reducers):
                    self._push(epoch * reducers + k, epoch, _REDUCE, k)
        self._fill()

    def describe(self) -> dict[str, Any]:
        """Queue depth and running tasks, for status messages."""
        return {"ready": len(self._ready), "running": self._running, "epochs": sorted(self._epochs)}
