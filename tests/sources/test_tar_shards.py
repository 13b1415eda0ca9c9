"""TarShards against real tar files and the real webdataset library."""

from __future__ import annotations

import concurrent.futures
import gzip
import io
import multiprocessing
import operator
import os
import pathlib
import pickle
import tarfile
import threading
from collections.abc import Callable

import cloudpickle
import numpy as np
import pytest
import webdataset as wds

from globalloader.errors import ArgumentError, SampleIndexError, SourceError
from globalloader.sources import Source, TarShards, TarWriter


def _wds_records(urls: str | list[str]) -> list[dict]:
    """What webdataset yields, minus `__local_path__`, a webdataset-only convenience field."""
    dataset = wds.WebDataset(urls, shardshuffle=False)
    return [{k: v for k, v in s.items() if k != "__local_path__"} for s in dataset]


def _all(src: TarShards) -> list[dict]:
    return [src[i] for i in range(len(src))]


def _write_with_webdataset(path: pathlib.Path, n: int) -> None:
    with wds.TarWriter(str(path)) as writer:
        for i in range(n):
            writer.write(
                {
                    "__key__": f"dir.v1/s{i:04d}",
                    "jpg": os.urandom(100 + 37 * i),
                    "seg.png": b"p" * (i % 3),
                    "TXT": f"text {i}",
                    "cls": str(i),
                }
            )


def test_reads_webdataset_written_shards_identically(tmp_path: pathlib.Path) -> None:
    for s in range(3):
        _write_with_webdataset(tmp_path / f"wds-{s:02d}.tar", 5 + s)
    pattern = str(tmp_path / "wds-{00..02}.tar")
    src = TarShards(pattern)
    expected = _wds_records(pattern)
    assert len(src) == 18
    assert _all(src) == expected
    assert list(src.iter_records()) == expected
    assert set(expected[0]) == {"__key__", "__url__", "jpg", "seg.png", "txt", "cls"}


def test_grouping_rules_match_webdataset(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        entries = [
            ("__meta__", b"m"),
            ("noext", b"z"),
            ("a.jpg", b"1"),
            ("a.cls", b"2"),
            ("b.jpg", b"3"),
            ("a.txt", b"4"),
            ("d/" + "L" * 200 + ".JPG", b"5"),
            ("__index__/a.txt", b"6"),
            ("d/.hidden.txt", b"7"),
        ]
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    src = TarShards(str(path))
    assert _all(src) == _wds_records(str(path))
    # a non-consecutive repeat of a key starts a new sample, as in webdataset
    assert [r["__key__"] for r in _all(src)][:3] == ["a", "b", "a"]


def test_records_of_generated_shards(make_shards: Callable[..., list[str]]) -> None:
    paths = make_shards(10, per_shard=4)
    src = TarShards(paths)
    assert isinstance(src, Source)
    assert src.shards == paths and len(src) == 10
    assert src[5] == {"__key__": "k000005", "__url__": paths[1], "txt": b"sample 5", "cls": b"5"}


def test_brace_pattern_and_list_of_patterns(make_shards: Callable[..., list[str]], tmp_path: pathlib.Path) -> None:
    paths = make_shards(12, per_shard=3)
    folder = str(tmp_path)
    src = TarShards(folder + "/shard-{000000..000003}.tar")
    assert src.shards == paths
    mixed = TarShards([folder + "/shard-00000{0,1}.tar", folder + "/shard-00000[23].tar"])
    assert mixed.shards == paths and _all(mixed) == _all(src)


def test_index_is_cached_and_reused(make_shards: Callable[..., list[str]], isolated_cache: pathlib.Path) -> None:
    paths = make_shards(10, per_shard=4)
    first = TarShards(paths)
    first.build_index()
    assert first.scanned == 3
    files = sorted((isolated_cache / "tar-index").glob("*.npz"))
    assert len(files) == 3
    mtimes = [f.stat().st_mtime_ns for f in files]
    second = TarShards(paths)
    assert len(second) == 10 and second.scanned == 0
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    assert _all(second) == _all(first)
    assert second.fingerprint == first.fingerprint


def test_changed_shard_is_rescanned(make_shards: Callable[..., list[str]]) -> None:
    paths = make_shards(8, per_shard=4)
    before = TarShards(paths)
    before.build_index()
    with TarWriter(paths[1]) as writer:
        writer.write({"__key__": "new", "txt": "replaced"})
    after = TarShards(paths)
    assert len(after) == 5 and after.scanned == 1
    assert after[4]["txt"] == b"replaced"
    assert after.fingerprint != before.fingerprint


def test_unreadable_cached_index_is_rebuilt(make_shards: Callable[..., list[str]], tmp_path: pathlib.Path) -> None:
    paths = make_shards(4, per_shard=4)
    folder = tmp_path / "my-index"
    TarShards(paths, index_dir=folder).build_index()
    (index_file,) = folder.glob("*.npz")
    index_file.write_bytes(b"garbage")
    src = TarShards(paths, index_dir=folder)
    assert len(src) == 4 and src.scanned == 1 and src[3]["txt"] == b"sample 3"


@pytest.mark.parametrize("by", ["index_dir", "environment"])
def test_unwritable_cache_still_works(
    make_shards: Callable[..., list[str]], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the index folder should be")
    if by == "environment":  # the default folder, under the machine's cache folder
        monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(blocker))
    src = TarShards(make_shards(3), index_dir=blocker / "index" if by == "index_dir" else None)
    assert len(src) == 3 and src.scanned == 1 and src[2]["txt"] == b"sample 2"


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_urls(scheme: str, tmp_path: pathlib.Path) -> None:
    base = f"memory://{tmp_path.name}" if scheme == "memory" else f"file://{tmp_path}"
    with TarWriter(base + "/remote-%02d.tar", maxcount=3) as writer:
        for i in range(7):
            writer.write({"__key__": f"r{i}", "bin": os.urandom(700 * i), "txt": str(i)})
    src = TarShards(base + "/remote-{00..02}.tar")
    assert src.shards == writer.paths and len(src) == 7
    records = _all(src)
    assert [r["__url__"] for r in records] == [writer.paths[i // 3] for i in range(7)]
    assert [r["txt"] for r in records] == [str(i).encode() for i in range(7)]
    assert [len(r["bin"]) for r in records] == [700 * i for i in range(7)]
    assert list(src.iter_records()) == records
    again = TarShards(base + "/remote-{00..02}.tar")
    assert len(again) == 7 and again.scanned == 0


def test_iter_records_single_shard_and_gzip(tmp_path: pathlib.Path, make_shards: Callable[..., list[str]]) -> None:
    paths = make_shards(6, per_shard=3)
    src = TarShards(paths)
    assert [r["__key__"] for r in src.iter_records([1])] == ["k000003", "k000004", "k000005"]
    with pytest.raises(ArgumentError, match="shards"):
        list(src.iter_records([5]))
    gz = tmp_path / "packed.tar.gz"
    gz.write_bytes(gzip.compress(pathlib.Path(paths[0]).read_bytes()))
    packed = TarShards(str(gz))
    assert [r["txt"] for r in packed.iter_records()] == [b"sample 0", b"sample 1", b"sample 2"]
    with pytest.raises(SourceError, match="gzip"):
        len(packed)


@pytest.mark.parametrize("damage", ["crc", "cut", "deflate"])
def test_iter_records_names_a_damaged_gzip_shard(
    tmp_path: pathlib.Path, make_shards: Callable[..., list[str]], damage: str
) -> None:
    """The record stream stops at the tar's end marker; the gzip trailer (CRC, length) past it is
    still checked, and a zlib/EOF fault is a SourceError naming the shard, never a silent end."""
    packed = bytearray(gzip.compress(pathlib.Path(make_shards(3, per_shard=3)[0]).read_bytes()))
    if damage == "crc":
        packed[-8] ^= 0xFF
    elif damage == "cut":
        del packed[len(packed) // 2 :]
    else:
        packed[len(packed) // 2] ^= 0xFF
    gz = tmp_path / "damaged.tar.gz"
    gz.write_bytes(bytes(packed))
    with pytest.raises(SourceError, match=f"cannot read gzip tar shard {gz}|truncated tar {gz}"):
        list(TarShards(str(gz)).iter_records())


def test_missing_shard_names_it(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "nope-000.tar")
    with pytest.raises(SourceError, match=f"file not found: {missing}"):
        TarShards(missing)
    with pytest.raises(SourceError, match="no file matches"):
        TarShards(str(tmp_path / "nope-*.tar"))


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (2048 + 512 + 4, "member 'k000001.txt' at offset 2048 needs 8 bytes"),  # inside data
        (2048 + 512 + 100, "the file ends at byte 2660, before offset 3072"),  # inside padding
        (3072 + 100, "partial header at offset 3072"),
    ],
)
def test_truncated_shard_names_shard_and_offset(make_shards: Callable[..., list[str]], cut: int, message: str) -> None:
    (path,) = make_shards(3, per_shard=3)  # members: 512-byte header + one data block each
    data = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(data[:cut])
    src = TarShards(path)
    with pytest.raises(SourceError, match=f"truncated tar {path}: {message}"):
        len(src)
    with pytest.raises(SourceError, match=f"truncated tar {path}"):
        list(src.iter_records())


def test_corrupt_header_names_shard_and_offset(make_shards: Callable[..., list[str]]) -> None:
    (path,) = make_shards(3, per_shard=3)
    with tarfile.open(path) as tar:
        offsets = [m.offset_data - 512 for m in tar]
    data = bytearray(pathlib.Path(path).read_bytes())
    data[offsets[2] + 3] ^= 0x55
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(SourceError, match=f"corrupt tar {path}: bad header checksum at offset {offsets[2]}"):
        TarShards(path).build_index()


def test_shard_changed_after_indexing(make_shards: Callable[..., list[str]]) -> None:
    (path,) = make_shards(3, per_shard=3)
    src = TarShards(path)
    src.build_index()
    pathlib.Path(path).write_bytes(pathlib.Path(path).read_bytes()[:1024])
    with pytest.raises(SourceError, match=f"{path} is shorter than its index"):
        src[2]


def test_index_errors(make_shards: Callable[..., list[str]]) -> None:
    src = TarShards(make_shards(5, per_shard=5))
    for bad in (5, 100, -1):
        with pytest.raises(SampleIndexError, match=f"index {bad}.*length 5"):
            src[bad]
    for bad in ("1", 1.0, None, True, slice(0, 2)):
        with pytest.raises(ArgumentError, match="index must be an int"):
            src[bad]  # type: ignore[index]
    assert src[np.int64(4)]["__key__"] == "k000004"


@pytest.mark.parametrize("bad", [123, b"x.tar", [1], [], {"a": 1}])
def test_wrong_argument_types(bad: object) -> None:
    with pytest.raises(ArgumentError, match="urls"):
        TarShards(bad)


def test_wrong_option_types(make_shards: Callable[..., list[str]]) -> None:
    paths = make_shards(2)
    with pytest.raises(ArgumentError, match="threads"):
        TarShards(paths, threads=0)
    with pytest.raises(ArgumentError, match="max_open"):
        TarShards(paths, max_open="4")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="index_dir"):
        TarShards(paths, index_dir=3)  # type: ignore[arg-type]
    for option in ("threads", "max_open"):  # True was 1 thread, False no open file kept
        with pytest.raises(ArgumentError, match=option):
            TarShards(paths, **{option: True})
    with pytest.raises(ArgumentError, match=r"shards must hold indices in 0..1, got True"):
        list(TarShards(make_shards(4, per_shard=2)).iter_records(shards=[True]))  # was shard 1


def test_pickle_and_spawned_process(make_shards: Callable[..., list[str]]) -> None:
    src = TarShards(make_shards(9, per_shard=4))
    expected = _all(src)
    clone = pickle.loads(pickle.dumps(src))
    assert _all(clone) == expected
    assert _all(cloudpickle.loads(cloudpickle.dumps(src))) == expected
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        assert pool.submit(operator.getitem, src, 7).result() == expected[7]


def test_forked_child_reopens_files(make_shards: Callable[..., list[str]]) -> None:
    src = TarShards(make_shards(9, per_shard=4))
    expected = _all(src)  # the parent now holds open descriptors
    reader, writer = multiprocessing.Pipe(duplex=False)

    def child() -> None:
        records = _all(src)
        writer.send((records, src._reader._pid == os.getpid()))

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    records, reopened = reader.recv()
    proc.join(30)
    assert proc.exitcode == 0
    assert records == expected and reopened
    assert _all(src) == expected  # the parent's descriptors still work


def test_concurrent_threads(make_shards: Callable[..., list[str]]) -> None:
    src = TarShards(make_shards(40, per_shard=7), max_open=2)  # most reads open and close
    expected = _all(src)
    results: list[list[dict]] = [[] for _ in range(4)]

    def work(t: int) -> None:
        results[t] = [src[i] for i in range(len(src) - 1, -1, -1)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r == expected[::-1] for r in results)
