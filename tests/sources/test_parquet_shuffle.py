"""shuffle(window=...): blocks permuted, rows shuffled within windows of blocks, over real Parquet files."""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.dataset.shuffle import WindowShuffle
from globalloader.errors import ArgumentError
from helpers import check_resume


@pytest.fixture
def files(tmp_path: pathlib.Path) -> list[str]:
    """230 rows in row groups of uneven sizes (10 x 16 + 2 in the first file, 6 x 7 + 3 + 23 after)."""
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), str(tmp_path / "c.parquet")]
    pq.write_table(pa.table({"id": list(range(162))}), paths[0], row_group_size=16)
    pq.write_table(pa.table({"id": list(range(162, 207))}), paths[1], row_group_size=7)
    pq.write_table(pa.table({"id": list(range(207, 230))}), paths[2])
    return paths


def _blocks(order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return np.searchsorted(starts, order, side="right") - 1


def _max_open_blocks(order: np.ndarray, starts: np.ndarray, n: int) -> int:
    """The most row groups begun but not finished at any point of the order."""
    sizes = np.diff(np.append(starts, n))
    left = sizes.copy()
    open_now = most = 0
    for block in _blocks(order, starts).tolist():
        open_now += left[block] == sizes[block]
        left[block] -= 1
        open_now -= left[block] == 0
        most = max(most, open_now)
    return int(most)


@pytest.mark.parametrize("window", [1, 3, 4, 100])
def test_every_row_once_per_epoch_within_windows_of_whole_blocks(files: list[str], window: int) -> None:
    src = gl.Parquet(files)
    assert src.block_starts.tolist() == [*range(0, 162, 16), 162, 169, 176, 183, 190, 197, 204, 207]
    plan = gl.Dataset(src).shuffle(seed=1, window=window).plan
    for epoch in range(3):
        order = plan.indices(epoch)
        assert sorted(order.tolist()) == list(range(230))
        # Rows of a window come only from its blocks, and its blocks are read to the end before
        # the next window opens: never more than `window` row groups are in progress at once.
        assert _max_open_blocks(order, src.block_starts, 230) <= window
    with pytest.warns(UserWarning, match="random order"):  # the plain shuffle, for contrast
        plain = gl.Dataset(gl.Parquet(files)).shuffle(seed=1)
    assert _max_open_blocks(plain.plan.indices(0), src.block_starts, 230) > 10


def test_deterministic_per_seed_and_epoch_and_mixed_within_a_window(files: list[str]) -> None:
    src = gl.Parquet(files)
    orders = {
        (seed, epoch): gl.Dataset(src).shuffle(seed=seed, window=4).plan.indices(epoch)
        for seed in (0, 1)
        for epoch in (0, 1)
    }
    again = gl.Dataset(gl.Parquet(files)).shuffle(seed=0, window=4).plan.indices(1)
    assert np.array_equal(orders[0, 1], again)
    keys = list(orders)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert (orders[a] != orders[b]).mean() > 0.9, f"{a} and {b} give nearly the same order"
    # Block order is permuted and rows inside a window are interleaved, not read block by block.
    blocks = _blocks(orders[0, 0], src.block_starts)
    assert not np.all(np.diff(orders[0, 0]) == 1)
    assert (blocks[1:] != blocks[:-1]).mean() > 0.5


def test_records_and_iteration_through_the_loader(files: list[str]) -> None:
    ds = gl.Dataset(gl.Parquet(files)).shuffle(seed=3, window=2).batch(16)
    in_thread = np.concatenate([b["id"] for b in ds.iterator(2)])
    with gl.Loader(ds, workers=2) as loader:
        loader.set_epoch(2)
        in_workers = np.concatenate([b["id"] for b in loader])
    assert np.array_equal(in_thread, in_workers) and sorted(in_workers.tolist()) == list(range(230))
    assert np.array_equal(in_thread, ds.plan.indices(2))  # the id column is the row number


def test_resume_mid_epoch_through_the_loader_equals_the_uninterrupted_run(files: list[str]) -> None:
    ds = gl.Dataset(gl.Parquet(files)).shuffle(seed=7, window=3).batch(10)

    def make() -> gl.Loader:
        loader = gl.Loader(ds, workers=2)
        loader.set_epoch(1)
        return loader

    full = check_resume(make, at=9)
    assert sorted(np.concatenate([b["id"] for b in full]).tolist()) == list(range(230))
    check_resume(lambda: ds.iterator(1), at=13)


class _CountingParquet(gl.Parquet):
    """Parquet that records which row groups it decodes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoded: list[int] = []

    def read_block(self, block: int) -> Any:
        self.decoded.append(block)
        return super().read_block(block)


def test_each_row_group_is_decoded_once_per_epoch(files: list[str]) -> None:
    src = _CountingParquet(files)
    assert src.cached_row_groups == 4
    ds = gl.Dataset(src).shuffle(seed=0, window=5).batch(9)
    assert src.cached_row_groups == 10  # two windows: a batch may straddle two
    for epoch in range(3):
        src.decoded.clear()
        assert sorted(int(i) for b in ds.iterator(epoch) for i in b["id"]) == list(range(230))
        # Once at most (a group still cached from the last epoch's end is not decoded again).
        assert len(set(src.decoded)) == len(src.decoded)
        if epoch == 0:
            assert sorted(src.decoded) == list(range(len(src.block_starts)))


def test_shard_after_a_window_shuffle_splits_the_rows(files: list[str]) -> None:
    base = gl.Dataset(gl.Parquet(files)).shuffle(seed=2, window=3)
    ranks = [[r["id"] for r in base.shard(rank, 3, uneven="none")] for rank in range(3)]
    assert sorted(i for rank in ranks for i in rank) == list(range(230))


def test_the_window_is_part_of_the_chain_identity(files: list[str]) -> None:
    src = gl.Parquet(files)
    keys = {
        gl.Dataset(src).shuffle(seed=0, window=2).fingerprint,
        gl.Dataset(src).shuffle(seed=0, window=3).fingerprint,
        gl.Dataset(src).shuffle(seed=1, window=2).fingerprint,
        gl.Dataset(gl.Parquet(files, cached_row_groups=100)).shuffle(seed=0).fingerprint,
    }
    assert len(keys) == 4
    assert (
        gl.Dataset(src).shuffle(seed=0, window=2).fingerprint == gl.Dataset(src).shuffle(seed=0, window=2).fingerprint
    )


def test_empty_row_groups_and_an_empty_source(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "gaps.parquet")
    with pq.ParquetWriter(path, pa.schema([("id", pa.int64())])) as writer:
        for ids in ([0, 1, 2], [], [3, 4], [], []):
            writer.write_table(pa.table({"id": pa.array(ids, pa.int64())}))
    src = gl.Parquet(path)
    assert len(src.block_starts) == 5
    assert sorted(r["id"] for r in gl.Dataset(src).shuffle(seed=0, window=1)) == [0, 1, 2, 3, 4]
    op = WindowShuffle(0, 2, np.array([0]))
    assert op.length(0) == 0 and op.parents(np.arange(0), 0, 0).tolist() == []


def test_bad_arguments_raise_named_errors(files: list[str]) -> None:
    ds = gl.Dataset(gl.Parquet(files))
    for window in (0, -2, 1.5, True, "4"):
        with pytest.raises(ArgumentError, match="window must be an int >= 1"):
            ds.shuffle(seed=0, window=window)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="seed must be"):
        ds.shuffle(seed=-1, window=2)
    with pytest.raises(ArgumentError, match=r"source made of blocks .* SequenceSource has none"):
        gl.Dataset(gl.from_sequence(list(range(10)))).shuffle(seed=0, window=2)
    with pytest.raises(ArgumentError, match="must apply directly to the source, but it follows select"):
        ds.select(range(10)).shuffle(seed=0, window=2)
    with pytest.raises(ArgumentError, match="must apply directly to the source, but it follows shard"):
        ds.shard(0, 2).shuffle(seed=0, window=2)
    with pytest.raises(ArgumentError, match=r"shuffle\(window=...\) is for random-access sources"):
        gl.Dataset.stream(list(range(10))).shuffle(seed=0, window=2)
    with pytest.raises(ArgumentError, match=r"shuffle\(window=...\) is for random-access sources"):
        ds.shuffle(seed=0, buffer_size=10, window=2)
    with pytest.raises(ArgumentError, match="before batch"):
        ds.batch(4).shuffle(seed=0, window=2)
    with pytest.raises(ArgumentError, match="blocks cover 5 rows but the source has 230"):
        WindowShuffle(0, 2, np.array([0, 5])).length(230)


def test_a_plain_shuffle_over_more_row_groups_than_the_cache_holds_warns(tmp_path: pathlib.Path) -> None:
    """The silent 440x: a global shuffle that decodes a row group for nearly every row says so,
    with the remedies; the remedies themselves do not warn."""
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": list(range(100))}), path, row_group_size=10)  # 10 row groups
    with pytest.warns(UserWarning, match=r"reads its 10 row groups in random order.*shuffle\(window=w\)"):
        gl.Dataset(gl.Parquet(path)).shuffle(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gl.Dataset(gl.Parquet(path)).shuffle(seed=0, window=2)
        gl.Dataset(gl.Parquet(path, cached_row_groups=10)).shuffle(seed=0)
        gl.Dataset(gl.Parquet(path).local_copy(tmp_path / "copies", progress=False)).shuffle(seed=0)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_run_of_positions_maps_as_the_positions_do(files: list[str], window: int) -> None:
    """A task's positions take a shortcut (`parents_run`, a slice of its window's order): it must
    give what mapping the positions one by one gives, within a window, across two, at the end."""
    src = gl.Parquet(files)
    op = gl.Dataset(src).shuffle(seed=3, window=window).plan.index_ops[0]
    rng = np.random.default_rng(window)
    runs = [(0, 230), (0, 1), (229, 230), (200, 230), *(sorted(rng.integers(0, 231, 2).tolist()) for _ in range(40))]
    for epoch in (0, 1):
        for start, stop in runs:
            expected = op.parents(np.arange(start, stop, dtype=np.int64), 230, epoch)
            assert np.array_equal(op.parents_run(start, stop, 230, epoch), expected), (epoch, start, stop)


@pytest.mark.parametrize(
    ("bounds", "orders"),
    [
        (
            [0, 4, 8, 12, 16, 19],  # blocks of one size, the last shorter: the arithmetic path
            [
                [11, 9, 18, 16, 8, 10, 17, 4, 3, 2, 6, 1, 7, 5, 0, 14, 15, 12, 13],
                [11, 4, 10, 6, 7, 9, 8, 5, 12, 2, 1, 15, 13, 0, 3, 14, 18, 16, 17],
            ],
        ),
        (
            [0, 2, 7, 8, 13, 20],  # blocks of any size
            [
                [15, 13, 18, 16, 7, 14, 17, 19, 2, 0, 4, 1, 5, 3, 6, 12, 10, 11, 8, 9],
                [3, 5, 4, 2, 7, 6, 8, 0, 11, 9, 12, 1, 10, 17, 19, 16, 18, 13, 15, 14],
            ],
        ),
    ],
)
def test_the_orders_of_a_seed_never_change(bounds: list[int], orders: list[list[int]]) -> None:
    """A checkpoint stores positions: a release that drew other orders from the same seed would
    resume it into other rows. These are the orders the first release of the windowed shuffle drew."""
    op = WindowShuffle(5, 2, np.array(bounds))
    n = bounds[-1]
    for epoch, expected in enumerate(orders):
        assert op.parents(np.arange(n), n, epoch).tolist() == expected
        assert op.parents_run(0, n, n, epoch).tolist() == expected
        assert [int(op.parents_run(i, i + 1, n, epoch)[0]) for i in range(n)] == expected
