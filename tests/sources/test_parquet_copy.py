"""ArrowCopy: a local memory-mapped Arrow copy of a Parquet source, for the exact global shuffle."""

from __future__ import annotations

import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, SampleIndexError, SourceError
from globalloader.sources.arrow_copy import ArrowCopy
from helpers import check_resume, every_arrow_type, strictly_equal


@pytest.fixture
def files(write_parts: Callable[[pa.Table], list[str]]) -> list[str]:
    return write_parts(every_arrow_type(100))


def test_copy_yields_exactly_the_parquet_records(files: list[str], tmp_path: pathlib.Path) -> None:
    src = gl.Parquet(files)
    copy = src.local_copy(tmp_path / "copies")
    assert copy.built and copy.path.parent == tmp_path / "copies" and len(copy) == len(src) == 100
    assert np.array_equal(copy.block_starts, src.block_starts) and len(src.block_starts) == 10
    assert copy.int_columns_as_float == {"int_with_null", "flag_with_null"}
    for i in np.random.default_rng(0).permutation(100).tolist():
        expected, got = src[i], copy[i]
        assert strictly_equal(got, expected), [
            (k, got[k], expected[k]) for k in got if not strictly_equal(got[k], expected[k])
        ]
    assert all(strictly_equal(a, b) for a, b in zip(copy.iter_records(), src.iter_records(), strict=True))
    assert copy.fingerprint != src.fingerprint and copy.fingerprint.startswith("ArrowCopy:")
    with pytest.raises(SampleIndexError, match="index 100"):
        copy[100]


def test_columns_and_batches_match(files: list[str], tmp_path: pathlib.Path) -> None:
    src = gl.Parquet(files, columns=["id", "f32", "text"])
    copy = src.local_copy(tmp_path)
    assert copy[61] == {"__key__": f"{files[1]}:1", "id": 61, "f32": pytest.approx(61 / 3), "text": "s61é"}
    from_parquet = list(gl.Dataset(src).batch(30))
    from_copy = list(gl.Dataset(copy).batch(30))
    for a, b in zip(from_parquet, from_copy, strict=True):
        assert a.keys() == b.keys()
        assert a["id"].dtype == b["id"].dtype and np.array_equal(a["id"], b["id"])
        assert a["f32"].dtype == b["f32"].dtype and np.array_equal(a["f32"], b["f32"], equal_nan=True)
        assert a["text"] == b["text"]


def test_copy_is_reused_by_later_constructions_and_processes(files: list[str], tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "copies"
    first = gl.Parquet(files).local_copy(folder)
    again = gl.Parquet(files).local_copy(folder)
    assert first.built and not again.built and again.path == first.path
    assert sorted(os.listdir(folder)) == sorted([first.path.name, f"{first.path.name}.crc32"])
    code = textwrap.dedent(
        f"""
        import globalloader as gl
        copy = gl.Parquet({files!r}).local_copy({str(folder)!r}, progress=False)
        print(copy.built, copy.path, copy[98]["text"])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", str(first.path), "s98é"]
    clone = pickle.loads(pickle.dumps(first))
    assert strictly_equal(clone[42], first[42])


def test_processes_building_the_same_copy_at_once_agree(tmp_path: pathlib.Path) -> None:
    """Writers racing to publish the copy and its checksum leave one consistent pair that every
    reader accepts, and each reads the source's rows."""
    path = str(tmp_path / "data.parquet")
    pq.write_table(pa.table({"id": list(range(3000)), "text": [f"t{i}" for i in range(3000)]}), path, row_group_size=50)
    folder = tmp_path / "copies"
    code = textwrap.dedent(
        f"""
        import sys, time
        import globalloader as gl
        while time.time() < float(sys.argv[1]):
            pass
        copy = gl.Parquet({path!r}).local_copy({str(folder)!r}, progress=False)
        print(copy.built, all((copy[i]["id"], copy[i]["text"]) == (i, f"t{{i}}") for i in range(3000)))
        """
    )
    start = str(time.time() + 3)  # past every interpreter's start-up: the builds overlap
    procs = [subprocess.Popen([sys.executable, "-c", code, start], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [proc.communicate(timeout=120)[0].split() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs) and all(out[1] == "True" for out in outs)
    assert sorted(p.name for p in folder.iterdir()) == sorted([p.name for p in folder.glob("*.arrow*")])
    assert not gl.Parquet(path).local_copy(folder).built  # the published pair passes the check


def test_copy_is_rebuilt_when_a_file_changes(files: list[str], tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "copies"
    old = gl.Parquet(files).local_copy(folder)
    pq.write_table(every_arrow_type(103).slice(60), files[1], row_group_size=7)  # a changed file: new size and mtime
    src = gl.Parquet(files)
    fresh = src.local_copy(folder)
    assert fresh.built and fresh.path != old.path and len(fresh) == 103
    assert strictly_equal([fresh[i] for i in range(103)], [src[i] for i in range(103)])
    assert not old.path.exists() and sorted(p.name for p in folder.iterdir()) == [
        fresh.path.name,
        f"{fresh.path.name}.crc32",
    ]
    other = gl.Parquet(files, columns=["id"]).local_copy(folder)  # other columns: another copy beside it
    assert other.built and sorted(p.name for p in folder.glob("*.arrow")) == sorted([fresh.path.name, other.path.name])


def test_a_copy_cut_short_by_an_error_leaves_nothing(tmp_path: pathlib.Path) -> None:
    good, bad = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"id": list(range(40))}), good, row_group_size=10)
    pq.write_table(pa.table({"id": pa.array([1, 2, 3], pa.int32())}), bad)  # the source reads both as ints
    folder = tmp_path / "copies"
    with pytest.raises(SourceError, match=rf"{bad}: column 'id' is int32, other files have 'id' as int64"):
        gl.Parquet([good, bad]).local_copy(folder)
    assert list(folder.iterdir()) == []  # neither a copy nor a temporary file


_SLOW_COPY = """
import sys, time
import globalloader as gl

class SlowParquet(gl.Parquet):
    def read_block(self, block):
        time.sleep(0.2)
        return super().read_block(block)

SlowParquet(sys.argv[1]).local_copy(sys.argv[2], progress=False)
"""


def test_a_copy_killed_while_written_is_never_used(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "data.parquet")
    pq.write_table(pa.table({"id": list(range(400)), "text": [f"t{i}" for i in range(400)]}), path, row_group_size=10)
    folder = tmp_path / "copies"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_COPY, path, str(folder)])
    try:
        deadline = time.monotonic() + 60
        while not list(folder.glob(".*.tmp")):
            assert proc.poll() is None and time.monotonic() < deadline, "the copying process never started writing"
            time.sleep(0.01)
        time.sleep(0.5)  # a few row groups into the copy
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    (leftover,) = folder.glob(".*.tmp")
    assert not list(folder.glob("*.arrow"))  # the final name never held the partial copy
    copy = gl.Parquet(path).local_copy(folder)
    assert copy.built and [copy[i]["id"] for i in range(400)] == list(range(400))
    assert not leftover.exists()  # the dead writer's temporary file was cleared
    assert sorted(p.name for p in folder.iterdir()) == [copy.path.name, f"{copy.path.name}.crc32"]


def test_a_damaged_copy_is_written_again(files: list[str], tmp_path: pathlib.Path) -> None:
    copy = gl.Parquet(files).local_copy(tmp_path)
    data = copy.path.read_bytes()
    copy.path.write_bytes(data[: len(data) // 2])
    again = gl.Parquet(files).local_copy(tmp_path)
    assert again.built and strictly_equal(again[99], gl.Parquet(files)[99])


@pytest.mark.parametrize("where", [0.3, 0.6, 0.9])
def test_a_copy_with_flipped_bytes_of_the_same_size_is_written_again(
    files: list[str], tmp_path: pathlib.Path, where: float
) -> None:
    source = gl.Parquet(files)
    copy = source.local_copy(tmp_path)
    data = bytearray(copy.path.read_bytes())
    at = int(len(data) * where)
    data[at : at + 8] = bytes(b ^ 0xFF for b in data[at : at + 8])
    copy.path.write_bytes(bytes(data))  # same size, same Arrow framing at both ends
    again = source.local_copy(tmp_path)
    assert again.built and again.path == copy.path
    assert strictly_equal([again[i] for i in range(len(source))], [source[i] for i in range(len(source))])
    assert not gl.Parquet(files).local_copy(tmp_path).built  # the rewritten copy passes its check


def test_a_copy_whose_checksum_is_lost_is_written_again(files: list[str], tmp_path: pathlib.Path) -> None:
    copy = gl.Parquet(files).local_copy(tmp_path)
    copy.path.with_name(copy.path.name + ".crc32").unlink()
    assert gl.Parquet(files).local_copy(tmp_path).built


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00 not text", b"", b"00000000", b"0" * 100_000])
def test_a_copy_whose_checksum_is_garbage_is_written_again(
    files: list[str], tmp_path: pathlib.Path, garbage: bytes
) -> None:
    source = gl.Parquet(files)
    copy = source.local_copy(tmp_path)
    copy.path.with_name(copy.path.name + ".crc32").write_bytes(garbage)
    again = source.local_copy(tmp_path)
    assert again.built and strictly_equal(again[99], source[99])
    assert not source.local_copy(tmp_path).built  # the rewritten sidecar matches


def test_exact_shuffle_over_the_copy_resumes_through_the_loader(files: list[str], tmp_path: pathlib.Path) -> None:
    copy = gl.Parquet(files, columns=["id", "text", "floats"]).local_copy(tmp_path)
    ds = gl.Dataset(copy).shuffle(seed=5).batch(8)

    def make() -> gl.Loader:
        loader = gl.Loader(ds, workers=2)
        loader.set_epoch(1)
        return loader

    full = check_resume(make, at=4)
    ids = np.concatenate([b["id"] for b in full])
    assert sorted(ids.tolist()) == list(range(100)) and ids.tolist() != list(range(100))
    assert np.array_equal(ids, np.concatenate([b["id"] for b in ds.iterator(1)]))
    window = gl.Dataset(copy).shuffle(seed=5, window=2)  # the copy has the source's row groups too
    assert sorted(r["id"] for r in window) == list(range(100))


def test_arguments_and_folders_are_checked(files: list[str], tmp_path: pathlib.Path) -> None:
    with pytest.raises(ArgumentError, match=r"ArrowCopy copies a gl\.Parquet source, got SequenceSource"):
        ArrowCopy(gl.from_sequence([1, 2]))
    with pytest.raises(ArgumentError, match="folder must be"):
        gl.Parquet(files).local_copy(3)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="progress must be"):
        gl.Parquet(files).local_copy(tmp_path, progress="yes")  # type: ignore[arg-type]
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(SourceError, match=f"cannot create the Arrow copy's folder {not_a_folder}"):
        gl.Parquet(files).local_copy(not_a_folder)


def test_default_folder_is_the_cache_folder(
    files: list[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(tmp_path / "cache"))
    copy = gl.Parquet(files).local_copy()
    assert copy.path.parent == tmp_path / "cache" / "arrow-copy" and copy.path.exists()
