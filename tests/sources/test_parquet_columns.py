"""Batches gathered by column (`read_columns`): exactly the batches collated from records."""

from __future__ import annotations

import decimal
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.dataset.collate import collate
from globalloader.errors import ArgumentError, SampleIndexError, SourceError
from globalloader.sources._columns import BlockIndex
from helpers import check_resume, every_arrow_type, strictly_equal

GATHERED = ["id", "i32", "f32", "f16", "int_with_null", "flag", "flag_with_null", "text", "large_text", "blob"]


def _table(n: int) -> pa.Table:
    table = every_arrow_type(n).select(GATHERED)
    ids = np.arange(n)
    extra = {
        "u32": pa.array(ids + 2**31, pa.uint32()),  # above int32: must stay exact in int64
        "i8": pa.array(ids % 100 - 50, pa.int8()),
        "f64_null": pa.array([None if i % 4 == 1 else i / 7 for i in ids.tolist()], pa.float64()),
    }
    for name, column in extra.items():
        table = table.append_column(name, column)
    return table


@pytest.fixture
def files(write_parts: Callable[[pa.Table], list[str]]) -> list[str]:
    return write_parts(_table(100))


def _index_sets() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [
        np.arange(100),  # every block, in order
        np.arange(10, 37),  # a run across blocks
        np.array([57]),
        rng.permutation(100),
        rng.permutation(100)[:33],
        np.array([5, 5, 90, 5, 6, 7, 90]),  # repeats
        np.array([99, 98, 97, 0, 1, 2]),
    ]


@pytest.mark.parametrize("kind", ["parquet", "copy"])
def test_gathered_batches_equal_the_collated_records(files: list[str], tmp_path: pathlib.Path, kind: str) -> None:
    src: Any = gl.Parquet(files)
    if kind == "copy":
        src = src.local_copy(tmp_path / "copies", progress=False)
    assert src.columnar
    for indices in _index_sets():
        got = src.read_columns(indices)
        expected = collate([src[i] for i in indices.tolist()])
        assert strictly_equal(got, expected), [k for k in got if not strictly_equal(got[k], expected[k])]
        assert list(got) == ["__key__", *GATHERED, "u32", "i8", "f64_null"]
    assert src.read_columns(np.array([60]))["__key__"] == [f"{files[1]}:0"]
    with pytest.raises(SampleIndexError, match="index 100"):
        src.read_columns(np.array([3, 100]))
    with pytest.raises(SampleIndexError, match="index -1"):
        src.read_columns(np.array([-1]))


def test_a_gathered_batch_is_the_callers_own(files: list[str]) -> None:
    """Mutating a batch must never reach the cached row groups (nor a later batch)."""
    src = gl.Parquet(files, columns=["id", "text"])
    first = src.read_columns(np.arange(0, 16))  # one whole row group: slices of the cached arrays
    first["id"][:] = -1
    first["text"][0] = "changed"
    again = src.read_columns(np.arange(0, 16))
    assert again["id"].tolist() == list(range(16)) and again["text"][0] is None  # row 0's text is null


@pytest.mark.parametrize(
    "column",
    [
        pa.array([[1, 2]] * 10),  # lists stack or fail per batch
        pa.array([{"a": 1}] * 10),  # structs collate per field
        pa.array([2**63 + 5] * 10, pa.uint64()),  # int64 or uint64, by value
        pa.array(["c"] * 10).dictionary_encode(),
        pa.array([decimal.Decimal("1.5")] * 10, pa.decimal128(5, 2)),
    ],
    ids=["list", "struct", "uint64", "dictionary", "decimal"],
)
def test_other_columns_are_read_by_record(tmp_path: pathlib.Path, column: pa.Array) -> None:
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": list(range(10)), "other": column}), path, row_group_size=4)
    src = gl.Parquet(path)
    assert not src.columnar
    with pytest.raises(ArgumentError, match="read its records instead"):
        src.read_columns(np.arange(3))
    with pytest.raises(ArgumentError, match="read its records instead"):
        src.local_copy(tmp_path / "copies", progress=False).read_columns(np.arange(3))
    assert gl.Parquet(path, columns=["id"]).columnar
    ds = gl.Dataset(gl.Parquet(path)).batch(4)
    assert not ds.plan.columnar
    assert [b["id"].tolist() for b in ds] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_files_that_differ_are_read_by_record(tmp_path: pathlib.Path) -> None:
    a, b, c = (str(tmp_path / f"{name}.parquet") for name in "abc")
    pq.write_table(pa.table({"id": [1, 2], "t": ["x", "y"]}), a)
    pq.write_table(pa.table({"t": ["z"], "id": [3]}), b)  # same columns, another order
    pq.write_table(pa.table({"id": pa.array([4], pa.int32()), "t": ["w"]}), c)  # another width, same values
    assert gl.Parquet([a, a]).columnar
    assert not gl.Parquet([a, b]).columnar
    assert gl.Parquet([a, b], columns=["t", "id"]).columnar  # records follow the requested order
    assert not gl.Parquet([a, c]).columnar
    assert next(iter(gl.Dataset(gl.Parquet([a, c])).batch(3)))["id"].tolist() == [1, 2, 4]


@pytest.mark.parametrize(
    ("other", "column"),
    [
        ({"id": [4.0], "t": ["w"]}, "id"),  # ints in one file, floats in another
        ({"id": [4], "t": [b"w"]}, "t"),  # text, then bytes
        ({"id": ["4"], "t": ["w"]}, "id"),  # ints, then text: batches would turn to strings mid-epoch
        ({"id": [4]}, "t"),  # a column missing
        ({"id": [4], "t": ["w"], "extra": [1]}, "extra"),  # a column the first file lacks
    ],
)
def test_files_whose_column_types_differ_are_refused(
    tmp_path: pathlib.Path, other: dict[str, Any], column: str
) -> None:
    a, c = str(tmp_path / "a.parquet"), str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"id": [1, 2], "t": ["x", "y"]}), a)
    pq.write_table(pa.table(other), c)
    with pytest.raises(SourceError, match=rf"Parquet column '{column}' .*(missing from|in {a} but .* in {c})"):
        gl.Parquet([a, c])


def _chains(src: Any) -> dict[str, Callable[[gl.Dataset], gl.Dataset]]:
    return {
        "sequential": lambda ds: ds.batch(9),
        "exact shuffle": lambda ds: ds.shuffle(seed=4).batch(9, drop_last=True),
        "window": lambda ds: ds.shuffle(seed=4, window=3).batch(9),
        "select, shard": lambda ds: ds.select(range(5, 95, 2)).shard(1, 2).batch(4),
        "batch map": lambda ds: ds.batch(9).map(lambda b: {**b, "n": len(b["id"])}),
    }


@pytest.mark.filterwarnings("ignore:shuffle\\(\\) over Parquet")  # the exact shuffle on Parquet itself, on purpose
@pytest.mark.parametrize("kind", ["parquet", "copy"])
@pytest.mark.parametrize("workers", [0, 2])
def test_chains_yield_what_the_record_path_yields(
    files: list[str], tmp_path: pathlib.Path, kind: str, workers: int
) -> None:
    src: Any = gl.Parquet(files)
    if kind == "copy":
        src = src.local_copy(tmp_path / "copies", progress=False)
    for name, make in _chains(src).items():
        fast = make(gl.Dataset(src))
        slow = make(gl.Dataset(src).map(lambda r: r))  # a map before the batch: built from records
        assert fast.plan.columnar and not slow.plan.columnar, name
        for epoch in (0, 1):
            if workers:
                with gl.Loader(fast, workers=workers, mode="process") as a, gl.Loader(slow, workers=0) as b:
                    a.set_epoch(epoch)
                    b.set_epoch(epoch)
                    got, expected = list(a), list(b)
            else:
                got, expected = list(fast.iterator(epoch)), list(slow.iterator(epoch))
            assert len(got) == len(expected) > 0, name
            for g, e in zip(got, expected, strict=True):
                assert strictly_equal(g, e), (name, [k for k in g if not strictly_equal(g[k], e[k])])


@pytest.mark.parametrize("seed", range(6))
def test_block_index_finds_the_block_a_binary_search_finds(seed: int) -> None:
    """Uneven and empty blocks (a row group may hold no row) included."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice([0, 1, 2, 50, 3000], size=int(rng.integers(1, 60)))
    sizes[rng.integers(len(sizes))] += 1  # at least one row
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    length = int(sizes.sum())
    indices = np.concatenate([rng.integers(0, length, 500), [0, length - 1], starts[starts < length]])
    expected = np.searchsorted(starts, indices, side="right") - 1
    assert np.array_equal(BlockIndex(starts, length)(indices), expected)


@pytest.mark.filterwarnings("ignore:shuffle\\(\\) over Parquet")  # the exact shuffle on Parquet itself, on purpose
@pytest.mark.parametrize("kind", ["parquet", "copy"])
def test_gathered_chains_resume_exactly_with_process_workers(
    files: list[str], tmp_path: pathlib.Path, kind: str
) -> None:
    """Workers now map their own task positions: a resumed epoch (explicit remaining indices)
    and a fresh one must agree with the uninterrupted run, every row once."""
    src: Any = gl.Parquet(files)
    if kind == "copy":
        src = src.local_copy(tmp_path / "copies", progress=False)
    for shuffled in (lambda ds: ds.shuffle(seed=2, window=3), lambda ds: ds.shuffle(seed=2)):
        ds = shuffled(gl.Dataset(src)).batch(8)
        assert ds.plan.columnar
        full = check_resume(lambda ds=ds: gl.Loader(ds, workers=2, mode="process"), at=5)
        ids = np.concatenate([b["id"] for b in full])
        assert sorted(ids.tolist()) == list(range(100))
        assert ids.tolist() != list(range(100))
