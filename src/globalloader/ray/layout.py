"""Where every row of an epoch goes: trainer, batch and reducer sizes, and the scatter table.

Pure NumPy, no Ray: the shuffle's correctness (every row exactly once, equal batch counts, the
same order for the same seed) is decided here and tested without a cluster.

The epoch's global order is the concatenation of the reducers' outputs; reducer `k` feeds one
trainer, with a run of whole batches, so a trainer never reassembles a batch from two reducers.
Which rows a reducer gets is random: `scatter_table` draws how many rows each file sends to each
reducer (the counts a uniformly random permutation of all rows would give), each map task picks
which rows with a seeded permutation of its file, and each reducer permutes what it receives.
The result is a uniformly random permutation of the epoch's rows, cut into batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from globalloader._seeding import RAY_TABLE, generator
from globalloader.errors import ArgumentError


@dataclass(frozen=True)
class ShuffleLayout:
    """Sizes that stay the same every epoch (only which rows fill them changes).

    `batch_sizes[t]` lists trainer t's batch sizes; every trainer has the same number.
    Reducer k (in the order tasks are submitted) feeds trainer `reducer_rank[k]` with its
    batches `reducer_batches[k]` = [start, stop). `dropped` rows per epoch go nowhere
    (drop_last only).
    """

    file_rows: np.ndarray
    batch_sizes: np.ndarray
    reducer_rank: np.ndarray
    reducer_batches: np.ndarray
    dropped: int

    @property
    def num_batches(self) -> int:
        """Batches every trainer gets per epoch."""
        return int(self.batch_sizes.shape[1])

    @property
    def reducer_rows(self) -> np.ndarray:
        """Rows each reducer outputs."""
        cum = np.concatenate(
            [np.zeros((len(self.batch_sizes), 1), np.int64), np.cumsum(self.batch_sizes, axis=1)], axis=1
        )
        start, stop = self.reducer_batches[:, 0], self.reducer_batches[:, 1]
        return cum[self.reducer_rank, stop] - cum[self.reducer_rank, start]

    def rank_reducers(self, rank: int) -> np.ndarray:
        """Indices of the reducers feeding `rank`, in the order its batches come."""
        return np.flatnonzero(self.reducer_rank == rank)


def make_layout(
    file_rows: np.ndarray, num_trainers: int, batch_size: int, num_reducers: int, drop_last: bool
) -> ShuffleLayout:
    """Cut an epoch of `sum(file_rows)` rows into equal batch counts per trainer.

    drop_last=False: every row exactly once. All batches hold `batch_size` rows except each
    trainer's last, which share the leftover (fewer than num_trainers * batch_size) rows
    evenly. When fewer rows than trainers are left over, they go one each into the last full
    batches instead (a batch of batch_size + 1), so no trainer ever gets an empty batch.
    drop_last=True: every batch holds `batch_size` rows; the leftover rows (a different random
    set each epoch) are dropped.
    Raises ArgumentError when the rows cannot give every trainer a batch.
    """
    file_rows = np.asarray(file_rows, np.int64)
    total = int(file_rows.sum())
    per_round = num_trainers * batch_size
    if drop_last:
        num_batches = total // per_round
        if num_batches == 0:
            raise ArgumentError(
                f"the files hold {total} rows, fewer than num_trainers * "
                f"batch_size = {per_round}: with drop_last=True no trainer "
                "would get a batch"
            )
        sizes = np.full((num_trainers, num_batches), batch_size, np.int64)
    else:
        if total < num_trainers:
            raise ArgumentError(
                f"the files hold {total} rows, fewer than num_trainers = {num_trainers}: some trainer would get no rows"
            )
        num_batches = -(-total // per_round)
        tail = total - (num_batches - 1) * per_round
        widen = tail < num_trainers  # too few to give each trainer a last batch: widen full ones
        num_batches -= widen
        sizes = np.full((num_trainers, num_batches), batch_size, np.int64)
        if not widen:
            sizes[:, -1] = tail // num_trainers
        sizes[: tail % num_trainers, -1] += 1
    ranks, batches = _split_reducers(num_trainers, num_batches, num_reducers)
    return ShuffleLayout(file_rows, sizes, ranks, batches, total - int(sizes.sum()))


def _split_reducers(num_trainers: int, num_batches: int, num_reducers: int) -> tuple[np.ndarray, np.ndarray]:
    """Give each trainer about num_reducers / num_trainers reducers, each a run of batches.

    Reducers are ordered round by round (trainer 0's first, trainer 1's first, ...) so that,
    submitted in this order, every trainer's first batches are ready early.
    """
    reducers = []  # ((round, trainer), (first batch, stop))
    for t in range(num_trainers):
        count = len(range(t, num_reducers, num_trainers))
        bounds = (np.arange(count + 1) * num_batches) // count
        reducers += [((j, t), (bounds[j], bounds[j + 1])) for j in range(count) if bounds[j + 1] > bounds[j]]
    reducers.sort(key=lambda reducer: reducer[0])
    return (
        np.array([t for (_, t), _ in reducers], np.int64),
        np.array([run for _, run in reducers], np.int64).reshape(-1, 2),
    )


def scatter_table(layout: ShuffleLayout, seed: int, epoch: int) -> np.ndarray:
    """How many rows file m sends to reducer k this epoch: an int64 array (files, reducers).

    Drawn file by file from the multivariate hypergeometric distribution, which is exactly the
    distribution of these counts under a uniformly random permutation of all rows. Row sums
    equal the files' rows minus the rows they drop; column sums equal the reducers' sizes.
    """
    rng = generator(seed, epoch, RAY_TABLE, 0)
    remaining = np.append(layout.reducer_rows, layout.dropped).astype(np.int64)
    table = np.zeros((len(layout.file_rows), len(remaining)), np.int64)
    for m, rows in enumerate(layout.file_rows.tolist()):
        if rows:
            table[m] = rng.multivariate_hypergeometric(remaining, rows, method="marginals")
            remaining -= table[m]
    return table[:, :-1]


def default_num_reducers(num_files: int, num_trainers: int) -> int:
    """A reducer count that depends only on the data, so the order does not depend on the cluster.

    About one reducer per four files, 1 to 8 per trainer: enough that a trainer's first batch
    waits for a small reducer, few enough that map outputs stay large objects.
    """
    per_trainer = min(8, max(1, -(-num_files // (4 * num_trainers))))
    return num_trainers * per_trainer
