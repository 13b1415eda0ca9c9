"""A worker's next batches gathered in one call (`dataset.gather_ahead`): every task still gets
exactly its own rows, whatever order tasks are asked in, and a bad row group fails only the task
that reads it."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.dataset.collate import collate
from globalloader.errors import SourceError
from helpers import strictly_equal


def _write(tmp_path: pathlib.Path, n: int = 120) -> list[str]:
    """Two files with uneven row groups; numbers, text with nulls, bytes."""
    ids = np.arange(n)
    table = pa.table(
        {
            "id": ids,
            "x": (ids / 3).astype(np.float32),
            "text": [None if i % 7 == 3 else f"row {i}" for i in ids.tolist()],
            "blob": [bytes([i % 256]) * (i % 5) for i in ids.tolist()],
        }
    )
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(table.slice(0, 70), paths[0], row_group_size=16)
    pq.write_table(table.slice(70), paths[1], row_group_size=9)
    return paths


def _expected(src: Any, plan: Any, epoch: int, task: int) -> dict[str, Any]:
    return collate([src[i] for i in plan.task_indices(epoch, task).tolist()])


def _kept(plan: Any) -> int:
    state = getattr(plan.gather_ahead._local, "state", None)
    return 0 if state is None else len(state.kept)


@pytest.mark.parametrize("chain", ["sequential", "window", "select and shard"])
def test_tasks_asked_in_any_order_get_their_own_rows(tmp_path: pathlib.Path, chain: str) -> None:
    src = gl.Parquet(_write(tmp_path))
    ds = {
        "sequential": gl.Dataset(src).batch(7),
        "window": gl.Dataset(src).shuffle(seed=3, window=2).batch(7),
        "select and shard": gl.Dataset(src).shuffle(seed=3, window=2).select(range(5, 110)).shard(0, 2).batch(4),
    }[chain]
    plan = ds.plan
    assert plan.gather_ahead is not None and plan.gather_ahead.tasks > 8
    n = plan.num_tasks()
    rng = np.random.default_rng(0)
    orders = [
        [(0, t) for t in range(n)],  # in-process: stride 1
        [(0, t) for t in range(1, n, 2)],  # a worker of two
        [(1, t) for t in range(0, n, 3)] + [(0, t) for t in range(2, n, 3)],  # another epoch, then back
        [(0, t % n) for t in (0, 2, 4, 3, 6, 6, 8, 1)],  # off the stride, repeats, back
        [(int(e), int(t)) for e, t in zip(rng.integers(0, 3, 40), rng.integers(0, n, 40), strict=True)],
    ]
    gathered_ahead = 0
    for order in orders:
        for epoch, task in order:
            got = plan.run_task(epoch, task, None).output
            assert strictly_equal(got, _expected(src, plan, epoch, task)), (chain, epoch, task)
            assert _kept(plan) < plan.gather_ahead.tasks
            gathered_ahead = max(gathered_ahead, _kept(plan))
    assert gathered_ahead > 0, "no request was answered from a gather ahead: the test tests nothing"
    # A task sent with its own indices (a resumed shared-mode epoch's remaining rows) is never
    # answered from a kept batch of the same number.
    task = next(
        t for t in range(1, n - 1) if plan.run_task(0, t - 1, None) and plan.run_task(0, t, None) and _kept(plan)
    )
    other = np.array([119, 0, 64], dtype=np.int64)
    assert strictly_equal(plan.run_task(0, task + 1, other).output, collate([src[i] for i in other.tolist()]))


@pytest.mark.parametrize(
    "loader",
    [
        {"workers": 2, "mode": "process"},
        {"workers": 2, "mode": "thread"},
        {"workers": 3, "mode": "process", "start_method": "spawn"},
    ],
)
def test_workers_yield_the_batches_of_a_plain_read(tmp_path: pathlib.Path, loader: dict[str, Any]) -> None:
    """Each worker thread or process keeps its own batches; a spawned worker's copy starts empty."""
    src = gl.Parquet(_write(tmp_path))
    plain = gl.Parquet(src.files)
    plain.gather_rows = 0  # the reference: one gather per task
    for make in (lambda s: gl.Dataset(s).batch(5), lambda s: gl.Dataset(s).shuffle(seed=1, window=2).batch(5)):
        ds, reference = make(src), make(plain)
        assert ds.plan.gather_ahead is not None and reference.plan.gather_ahead is None
        with gl.Loader(ds, **loader) as it:
            for epoch in (0, 1):
                it.set_epoch(epoch)
                got, expected = list(it), list(reference.iterator(epoch))
                assert len(got) == len(expected) == 24
                for g, e in zip(got, expected, strict=True):
                    assert strictly_equal(g, e)


def test_how_many_rows_are_gathered_at_once_follows_the_row_size(tmp_path: pathlib.Path) -> None:
    """At most 16 MiB of rows per gather: large rows gather fewer tasks ahead, or none."""
    path = str(tmp_path / "big.parquet")
    pq.write_table(pa.table({"blob": [bytes([i]) * (1 << 20) for i in range(24)]}), path, row_group_size=8)
    src = gl.Parquet(path)
    assert 12 <= src.gather_rows <= 16
    assert gl.Dataset(src).batch(4).plan.gather_ahead.tasks == src.gather_rows // 4
    assert gl.Dataset(src).batch(12).plan.gather_ahead is None


def _corrupt_row_group(path: str, group: int) -> None:
    """Overwrite the middle of a row group's first column chunk; the footer stays intact."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.data_page_offset + chunk.total_compressed_size // 3
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * (chunk.total_compressed_size // 3))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_later_tasks_bad_row_group_fails_only_that_task(tmp_path: pathlib.Path, workers: int) -> None:
    path = str(tmp_path / "bad.parquet")
    ids = np.arange(40)
    pq.write_table(pa.table({"id": ids, "text": [f"row {i}" for i in ids]}), path, row_group_size=10)
    _corrupt_row_group(path, 2)
    src = gl.Parquet(path)
    with pytest.raises(SourceError, match="row group 2 of"):
        src.read_block(2)  # the precondition: only row group 2 is bad
    for good in (0, 1, 3):
        src.read_block(good)
    ds = gl.Dataset(src).batch(5)
    assert ds.plan.gather_ahead is not None
    with gl.Loader(ds, workers=workers) as loader:
        it = iter(loader)
        got = [next(it)["id"].tolist() for _ in range(4)]  # row groups 0 and 1
        with pytest.raises(SourceError, match=f"row group 2 of {path}"):
            next(it)
    assert got == [list(range(i, i + 5)) for i in range(0, 20, 5)]
