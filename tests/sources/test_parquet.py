"""Parquet source: rows as records across files and row groups, local and fsspec."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import operator
import os
import pathlib
import pickle

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, SampleIndexError, SourceError
from globalloader.sources import Parquet, Source


def _table(n: int, start: int = 0) -> pa.Table:
    ids = list(range(start, start + n))
    return pa.table(
        {
            "id": ids,
            "name": [f"row {i}" for i in ids],
            "blob": [bytes([i % 256]) * 3 for i in ids],
            "score": [None if i % 7 == 0 else i / 4 for i in ids],
            "vec": [list(range(i % 4)) for i in ids],
            "flag": [i % 2 == 0 for i in ids],
        }
    )


@pytest.fixture
def files(tmp_path: pathlib.Path) -> list[str]:
    paths = [str(tmp_path / "part-0.parquet"), str(tmp_path / "part-1.parquet")]
    pq.write_table(_table(50), paths[0], row_group_size=16)  # groups of 16, 16, 16, 2
    pq.write_table(_table(20, start=50), paths[1])
    return paths


def _check_row(record: dict, i: int, files: list[str]) -> None:
    file, row = (files[0], i) if i < 50 else (files[1], i - 50)
    assert record["__key__"] == f"{file}:{row}"
    assert record["id"] == i and type(record["id"]) is int
    assert record["name"] == f"row {i}" and record["blob"] == bytes([i]) * 3
    assert np.isnan(record["score"]) if i % 7 == 0 else record["score"] == i / 4
    assert isinstance(record["vec"], np.ndarray) and record["vec"].tolist() == list(range(i % 4))
    assert record["flag"] is (i % 2 == 0)


def test_every_row_in_order(files: list[str]) -> None:
    src = Parquet(files)
    assert isinstance(src, Source) and len(src) == 70
    for i in range(70):
        _check_row(src[i], i, files)


def test_nullable_numeric_columns_batch_to_numeric_arrays_with_nan(tmp_path: pathlib.Path) -> None:
    import globalloader as gl

    path = str(tmp_path / "nulls.parquet")
    pq.write_table(
        pa.table(
            {
                "score": [0.5, None, 2.5, 3.5],
                "count": pa.array([1, 2, None, 4], pa.int32()),
                "flag": [True, None, False, True],
                "id": [10, 11, 12, 13],
                "name": ["a", None, "c", "d"],
            }
        ),
        path,
        row_group_size=2,
    )  # the int column's nulls are in the second group only
    src = Parquet(path)
    assert src.int_columns_as_float == {"count", "flag"}
    (batch,) = list(gl.Dataset(src).batch(4))
    assert batch["score"].dtype == np.float64 and np.array_equal(
        batch["score"], [0.5, np.nan, 2.5, 3.5], equal_nan=True
    )
    assert batch["count"].dtype == np.float64 and np.array_equal(batch["count"], [1, 2, np.nan, 4], equal_nan=True)
    assert batch["flag"].dtype == np.float64 and np.array_equal(batch["flag"], [1, np.nan, 0, 1], equal_nan=True)
    assert batch["id"].dtype == np.int64 and batch["id"].tolist() == [10, 11, 12, 13]
    assert batch["name"] == ["a", None, "c", "d"]
    # Every batch of a column has one dtype, even one cut from a row group without nulls.
    first, second = list(gl.Dataset(src).batch(2))
    assert first["count"].dtype == second["count"].dtype == np.float64
    assert [type(r["count"]) for r in src.iter_records()] == [float] * 4


def test_a_nullable_int_column_without_a_null_count_is_read_as_float(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "nostats.parquet")
    schema = pa.schema([pa.field("maybe", pa.int64()), pa.field("never", pa.int64(), nullable=False)])
    pq.write_table(pa.table({"maybe": [1, 2], "never": [3, 4]}, schema=schema), path, write_statistics=False)
    src = Parquet(path)
    assert src.int_columns_as_float == {"maybe"}
    assert src[1] == {"__key__": f"{path}:1", "maybe": 2.0, "never": 4} and type(src[1]["never"]) is int


@pytest.mark.parametrize("read", ["record", "batch", "copy"])
def test_an_int_column_with_nulls_beyond_float_precision_is_refused(tmp_path: pathlib.Path, read: str) -> None:
    """Read as float64 for its nulls, 2**53 + 1 would round to 2**53: named, never changed."""
    path = str(tmp_path / "big.parquet")
    pq.write_table(pa.table({"x": pa.array([2**53 + 1, None, 3], pa.int64())}), path)
    source = Parquet(path)
    reads = {
        "record": lambda: source[2],
        "batch": lambda: list(gl.Dataset(source).batch(3)),
        "copy": lambda: source.local_copy(tmp_path / "copy")[2],
    }
    with pytest.raises(SourceError, match=r"Parquet column 'x' holds nulls, so it is read as float64, but .*740993"):
        reads[read]()


def read_second(source: Parquet, read: str, tmp_path: pathlib.Path) -> object:
    """Read `source` up to row 1 by one of three paths: a record, the record stream, the Arrow copy."""
    if read == "record":
        return source[1]
    if read == "iter":
        return list(source.iter_records())
    return source.local_copy(tmp_path / "copy")[1]


@pytest.mark.parametrize("read", ["record", "iter", "copy"])
def test_a_list_of_ints_with_a_null_item_beyond_float_precision_is_refused(tmp_path: pathlib.Path, read: str) -> None:
    """Arrow makes integer items with a null among them float64: 2**53 + 1 would round."""
    path = str(tmp_path / "lists.parquet")
    rows = [[1, None], [2**53 + 1], [2**53, 3]]
    pq.write_table(pa.table({"x": pa.array(rows, pa.list_(pa.int64()))}), path, row_group_size=3)
    source = Parquet(path)
    with pytest.raises(SourceError, match=r"Parquet column 'x' holds nulls, so it is read as float64, but .*740993"):
        read_second(source, read, tmp_path)
    pq.write_table(pa.table({"x": pa.array(rows[:1] + rows[2:], pa.list_(pa.int64()))}), path)
    exact = Parquet(path)  # 2**53 is held: the null item is NaN, the rest kept
    assert np.array_equal(exact[0]["x"], [1, np.nan], equal_nan=True) and exact[1]["x"].tolist() == [2**53, 3]


@pytest.mark.parametrize("read", ["record", "iter", "copy"])
def test_a_nanosecond_timestamp_python_cannot_hold_is_a_named_error(tmp_path: pathlib.Path, read: str) -> None:
    path = str(tmp_path / "times.parquet")
    pq.write_table(pa.table({"t": pa.array([1000, 1], pa.timestamp("ns"))}), path)
    source = Parquet(path)
    with pytest.raises(SourceError, match=r"Parquet column 't' holds a value Python cannot hold exactly"):
        read_second(source, read, tmp_path)
    assert source.local_copy(tmp_path / "copy")[0]["t"].microsecond == 1  # whole microseconds read


@pytest.mark.parametrize("bad", [[1.7], np.array([0.9]), [True], ["1"], [[0, 1]]])
@pytest.mark.parametrize("copied", [False, True])
def test_read_many_and_read_columns_take_only_flat_integer_indices(
    files: list[str], tmp_path: pathlib.Path, bad: object, copied: bool
) -> None:
    """1.7 -> row 1, True -> row 1 or "1" -> row 1 would read rows nobody asked for."""
    source = Parquet(files, columns=["id"])
    reader = source.local_copy(tmp_path / "copy") if copied else source
    for read in [getattr(reader, name) for name in ("read_many", "read_columns") if hasattr(reader, name)]:
        with pytest.raises(ArgumentError, match=r"indices must be a flat list of ints"):
            read(bad)
        with pytest.raises(SampleIndexError, match=r"index 18446744073709551615 is out of range"):
            read(np.array([2**64 - 1], np.uint64))  # not wrapped to -1
    assert reader.read_columns(np.array([3, 1], np.uint8))["id"].tolist() == [3, 1]


def test_dictionary_encoded_text_in_one_file_and_plain_in_another_read_alike(tmp_path: pathlib.Path) -> None:
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(pa.table({"s": pa.array(["x", "y"]).dictionary_encode()}), paths[0])  # a pandas categorical
    pq.write_table(pa.table({"s": pa.array(["z", "x"])}), paths[1])
    source = Parquet(paths)
    copy = source.local_copy(tmp_path / "copy")
    for reader in (source, copy):
        assert [reader[i]["s"] for i in range(4)] == ["x", "y", "z", "x"]
        assert next(iter(gl.Dataset(reader).batch(4)))["s"] == ["x", "y", "z", "x"]
    pq.write_table(pa.table({"s": pa.array([1, 2]).dictionary_encode()}), paths[0])
    with pytest.raises(SourceError, match=r"Parquet column 's' is int64 in .* but string in"):
        Parquet(paths)  # other kinds still refused


def test_a_uint64_column_beyond_int64_batches_as_uint64(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"id": pa.array([2**64 - 1, 0, 2**63, 5], pa.uint64())}), path)
    batches = [b["id"] for b in gl.Dataset(Parquet(path)).batch(2)]
    assert [b.dtype for b in batches] == [np.uint64, np.uint64]
    assert [b.tolist() for b in batches] == [[2**64 - 1, 0], [2**63, 5]]


def test_random_order_and_cache_bound(files: list[str]) -> None:
    src = Parquet(files, cached_row_groups=2)
    for i in np.random.default_rng(0).permutation(70).tolist():
        _check_row(src[i], i, files)
        assert len(src._groups) <= 2


def test_columns_glob_and_braces(files: list[str], tmp_path: pathlib.Path) -> None:
    by_glob = Parquet(str(tmp_path / "*.parquet"), columns=["name", "id"])
    assert by_glob.files == files
    assert by_glob[55] == {"__key__": f"{files[1]}:5", "name": "row 55", "id": 55}
    by_brace = Parquet(str(tmp_path / "part-{0,1}.parquet"))
    assert by_brace.files == files and len(by_brace) == 70


def test_iter_records_and_read_table(files: list[str]) -> None:
    src = Parquet(files, columns=["id"])
    assert [r["id"] for r in src.iter_records()] == list(range(70))
    assert [r["__key__"] for r in src.iter_records()] == [src[i]["__key__"] for i in range(70)]
    assert src.read_table(1).column("id").to_pylist() == list(range(50, 70))
    assert src.read_table(files[0]).num_rows == 50
    with pytest.raises(ArgumentError, match="file must be"):
        src.read_table(2)
    for bad in (True, "no-such-file.parquet"):  # True was file 1; an unknown URL a raw ValueError
        with pytest.raises(ArgumentError, match="file must be"):
            src.read_table(bad)


def test_fingerprint_tracks_content_and_columns(files: list[str]) -> None:
    first = Parquet(files)
    assert Parquet(files).fingerprint == first.fingerprint
    assert Parquet(files, columns=["id"]).fingerprint != first.fingerprint
    pq.write_table(_table(21, start=50), files[1])
    assert Parquet(files).fingerprint != first.fingerprint


def test_fsspec_memory_url(tmp_path: pathlib.Path) -> None:
    import fsspec

    url = f"memory://{tmp_path.name}/data.parquet"
    with fsspec.open(url, "wb") as f:
        pq.write_table(_table(30), f, row_group_size=8)
    src = Parquet(url)
    assert len(src) == 30 and src[29]["name"] == "row 29" and src[29]["__key__"] == f"{url}:29"


def test_pickle_fork_and_spawn(files: list[str]) -> None:
    src = Parquet(files)
    expected = [src[i] for i in (0, 20, 69)]
    clone = pickle.loads(pickle.dumps(src))
    assert [clone[i]["id"] for i in (0, 20, 69)] == [0, 20, 69]
    assert cloudpickle.loads(cloudpickle.dumps(src))[20]["name"] == "row 20"
    reader, writer = multiprocessing.Pipe(duplex=False)

    def child() -> None:
        inherited = bool(getattr(src._local, "handles", None))
        writer.send((inherited, [src[i]["name"] for i in (0, 20, 69)]))

    assert src._local.handles  # the parent has open files
    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    assert reader.recv() == (False, [r["name"] for r in expected])
    proc.join(30)
    assert proc.exitcode == 0
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        assert pool.submit(operator.getitem, src, 69).result()["name"] == "row 69"


def test_errors_name_file_column_and_index(files: list[str], tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "missing.parquet")
    with pytest.raises(SourceError, match=f"file not found: {missing}"):
        Parquet([files[0], missing])
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_bytes(os.urandom(100))
    with pytest.raises(SourceError, match=f"cannot read Parquet file {not_parquet}"):
        Parquet(str(not_parquet))
    with pytest.raises(SourceError, match=r"has no column\(s\) \['nope'\]"):
        Parquet(files, columns=["id", "nope"])
    with pytest.raises(ArgumentError, match="columns"):
        Parquet(files, columns="id")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="paths"):
        Parquet(7)
    src = Parquet(files)
    with pytest.raises(SampleIndexError, match=r"index 70 .*length 70"):
        src[70]
    with pytest.raises(SampleIndexError, match="index -1"):
        src[-1]


def test_read_many_is_getitem_for_each_index_in_the_given_order(files: list[str]) -> None:
    """The plan reads a task's rows with read_many (group by group); it must be exactly the
    records `src[i]` gives, in the order asked, repeats included."""
    src = Parquet(files, cached_row_groups=1)
    indices = np.random.default_rng(0).integers(0, len(src), size=200)
    indices[5] = indices[9]  # a repeat
    many = src.read_many(indices)
    assert len(many) == 200
    for record, i in zip(many, indices.tolist(), strict=True):
        expected = src[i]
        assert record.keys() == expected.keys() and record["__key__"] == expected["__key__"]
        assert record["id"] == i and record["name"] == f"row {i}"
    with pytest.raises(SampleIndexError, match="70"):
        src.read_many(np.array([3, 70]))


@pytest.mark.parametrize("change", ["content", "rows"])
def test_a_file_changed_after_the_source_was_made_is_refused(tmp_path: pathlib.Path, change: str) -> None:
    """Indices were laid out from the footers read at construction: a file rewritten since would
    silently yield other rows under the same indices, in this process and in a worker."""
    import globalloader as gl

    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": list(range(10))}), path, row_group_size=4)
    src = Parquet(path)
    rows = list(range(100, 110)) if change == "content" else list(range(12))
    before = os.stat(path).st_mtime_ns
    pq.write_table(pa.table({"id": rows}), path, row_group_size=4)
    os.utime(path, ns=(before, before + 10**9))  # a new version even where the clock is coarse
    with pytest.raises(SourceError, match=r"x\.parquet changed since the source was made"):
        src[3]
    loader = gl.Loader(gl.Dataset(src).batch(4), workers=1)
    with pytest.raises(SourceError, match="changed since the source was made"), loader:
        list(loader)
