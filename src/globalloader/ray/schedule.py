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
- a reducer becomes ready when every map of its epoch has ended;
- for a chain that drops or makes rows (filter, flat_map), stage-1 tasks run the chain on every
  part first, spread over the whole previous epoch: the epoch is cut (its layout and scatter
  table) once every part's count is known, and its maps then scatter the stage-1 rows.

The CPUs never idle while a task is ready, so throughput does not suffer: only the order
changes. Runs on the batch queue actor's event loop (single-threaded, no locks).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import ray.exceptions as rex

from globalloader.errors import ArgumentError
from globalloader.ray.layout import ShuffleLayout, scatter_table
from globalloader.ray.reader import Part
from globalloader.ray.shuffle import submit_map, submit_reduce, submit_run

_RUN, _MAP, _REDUCE = 0, 1, 2
_OBJECTS_PER_MAP = 4  # map outputs a map task returns, split over nodes (see `_groups`)


@dataclass
class _Epoch:
    layout: asyncio.Future[ShuffleLayout]  # known at launch, or once every stage-1 count is
    runs: list[ray.ObjectRef | None]  # per part: the rows its stage-1 task made (chains that expand)
    counts: list[int | None]
    table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # rows from part m to reducer k
    group_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # reducer -> its map output object
    offset: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # where k's rows start in m's
    maps_left: int = 0
    parts: list[list[ray.ObjectRef] | None] = field(default_factory=list)  # per map: one object per group
    outputs: list[asyncio.Future[ray.ObjectRef]] = field(default_factory=list)

    def group_rows(self, m: int) -> np.ndarray:
        return np.bincount(self.group_of, weights=self.table[m], minlength=int(self.group_of.max()) + 1).astype(
            np.int64
        )


class ShuffleScheduler:
    """Per-epoch map/reduce tasks, submitted by need and at most `limit` at a time.

    `make_layout(rows per part)` cuts an epoch; `expands`: the chain drops or makes rows (filter,
    flat_map), so an epoch first runs it on every part (stage 1, returning its rows and their
    count), and once every count is known cuts the epoch and scatters the stage-1 rows where
    they are. Otherwise every epoch has the layout of the parts' rows, and map tasks read, run
    and scatter in one step.
    """

    def __init__(
        self,
        files: Sequence[Part],
        columns: Sequence[str] | None,
        make_layout: Callable[[np.ndarray], ShuffleLayout],
        expands: bool,
        num_reducers: int,
        seed: int,
        limit: int,
    ) -> None:
        self._files = list(files)
        self._columns = list(columns) if columns is not None else None
        self._make_layout = make_layout
        self._fixed = None if expands else make_layout(np.array([part.rows for part in files], np.int64))
        self._reducers = num_reducers
        self._seed = seed
        self.limit = limit
        self.nodes: dict[int, str] = {}  # rank -> node id, for reducer placement
        self._epochs: dict[int, _Epoch] = {}
        self._ready: list[tuple[float, int, int, int, int]] = []  # priority, seq, epoch, kind, i
        self._seq = itertools.count()
        self._running = 0
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def fixed_layout(self) -> ShuffleLayout | None:
        """Every epoch's layout, when it is known before running (None: the chain expands)."""
        return self._fixed

    def launch(self, epoch: int) -> None:
        """Queue `epoch`'s first tasks (stage 1, or the maps); call from the event loop."""
        files = len(self._files)
        state = _Epoch(asyncio.get_running_loop().create_future(), [None] * files, [None] * files)
        self._epochs[epoch] = state
        if self._fixed is not None:
            self._plan(epoch, state, self._fixed)
        else:
            for m in range(files):
                self._push(self._map_priority(epoch, m), epoch, _RUN, m)
        self._fill()

    def _map_priority(self, epoch: int, m: int) -> float:
        """The maps of epoch e spread evenly over the reducers of epoch e-1 (see the module doc)."""
        # Stage 1 spreads over all of them: an epoch that expands is cut only once it has ended.
        last_round = len(self._fixed.batch_sizes) if self._fixed is not None else 0
        span = max(1, self._reducers - last_round)
        return (epoch - 1) * self._reducers + (m + 1) * span / (len(self._files) + 1)

    def _plan(self, epoch: int, state: _Epoch, layout: ShuffleLayout) -> None:
        """Cut `epoch` by `layout` and queue its maps."""
        state.table = scatter_table(layout, self._seed, epoch)
        state.group_of, state.offset = self._groups(state.table, layout)
        mapped = [m for m in range(len(self._files)) if layout.file_rows[m] > 0]
        state.runs = [run if layout.file_rows[m] > 0 else None for m, run in enumerate(state.runs)]
        loop = asyncio.get_running_loop()
        state.maps_left = len(mapped)
        state.parts = [None] * len(self._files)
        state.outputs = [loop.create_future() for _ in range(state.table.shape[1])]
        state.layout.set_result(layout)
        for m in mapped:
            self._push(self._map_priority(epoch, m), epoch, _MAP, m)

    async def layout(self, epoch: int) -> ShuffleLayout | None:
        """`epoch`'s layout once known (None if the epoch was released); a failed stage-1
        task's error."""
        state = self._epochs.get(epoch)
        if state is None:
            return None
        try:
            return await asyncio.shield(state.layout)
        except asyncio.CancelledError:
            if state.layout.cancelled():
                return None
            raise

    def _groups(self, table: np.ndarray, layout: ShuffleLayout) -> tuple[np.ndarray, np.ndarray]:
        """Group reducers into the objects a map returns: by node, then by reducer order.

        A map sends a group one object holding the rows of its reducers one after another;
        `offset[m, k]` is where reducer k's rows start in map m's object for its group. One
        object per reducer would cost Ray a few milliseconds each; one per node would keep
        every map output alive until the node's last reducer. So a node's reducers (in the
        order they run) are cut into a few runs, about `_OBJECTS_PER_MAP` objects per map in
        all, and each run's object is freed as soon as its reducers are done. Reducers of a
        rank whose node is not known yet (it has not attached) group by rank.
        """
        nodes = [self.nodes.get(int(r), ("rank", int(r))) for r in layout.reducer_rank]
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
            futures: list[asyncio.Future[Any]] = [state.layout, *state.outputs]
            for future in futures:
                if not future.done():
                    future.cancel()

    async def output(self, epoch: int, reducer: int) -> ray.ObjectRef | None:
        """The ref of a reducer's output once submitted (None if the epoch was released)."""
        layout = await self.layout(epoch)
        state = self._epochs.get(epoch)
        if layout is None or state is None:
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
            watcher = asyncio.get_running_loop().create_task(self._watch(done, epoch, state, kind, index))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)

    def _submit(self, epoch: int, state: _Epoch, kind: int, index: int) -> ray.ObjectRef:
        if kind == _RUN:
            state.runs[index], count = submit_run(self._files[index], self._columns, epoch)
            return count
        layout = state.layout.result()
        if kind == _MAP:
            data, state.runs[index] = state.runs[index] or self._files[index], None  # the task holds the rows now
            parts, done = submit_map(
                data,
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

    async def _watch(self, done: ray.ObjectRef, epoch: int, state: _Epoch, kind: int, index: int) -> None:
        try:
            value = await done
        except rex.RayError as exc:  # a failed map's or reducer's error reaches trainers through its output
            value = None
            if kind == _RUN and not state.layout.done():  # no layout without every count: tell the trainers
                state.layout.set_exception(exc)
        self._running -= 1
        live = self._epochs.get(epoch) is state
        if kind == _RUN and live and value is not None:
            state.counts[index] = int(value)
            if all(c is not None for c in state.counts):
                try:
                    layout = self._make_layout(np.array(state.counts, np.int64))
                except ArgumentError as exc:  # too few rows this epoch for every trainer
                    state.layout.set_exception(exc)
                else:
                    self._plan(epoch, state, layout)
        elif kind == _MAP and live:
            state.maps_left -= 1
            if state.maps_left == 0:
                self._reduce(epoch, state)
        self._fill()

    def _reduce(self, epoch: int, state: _Epoch) -> None:
        """Queue `epoch`'s reducers, in the order trainers read them."""
        for k in range(state.table.shape[1]):
            self._push(epoch * self._reducers + k, epoch, _REDUCE, k)

    def describe(self) -> dict[str, Any]:
        """Queue depth and running tasks, for status messages."""
        return {"ready": len(self._ready), "running": self._running, "epochs": sorted(self._epochs)}
