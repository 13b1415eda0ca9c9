"""Sources over s3:// on a real S3 server: exact resume in local and shared mode, Parquet column
reads by cached blocks, and no traceback from the S3 client at exit in any mode."""

from __future__ import annotations

import datetime as dt
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader import storage
from globalloader.demo.s3 import write_shards
from globalloader.errors import SourceError
from globalloader.sources import Parquet, TarShards
from globalloader.storage import _fs
from helpers import Server, check_resume, damaged_tars


@pytest.mark.parametrize("window", [None, 2])
def test_resume_over_s3_shards_is_exact_with_process_workers(s3: dict[str, Any], window: int | None) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=30, per_shard=4, size=300)
    src = TarShards(urls, storage_options=s3["options"])
    ds = (gl.Dataset(src).shuffle(seed=2, window=window) if window else gl.Dataset(src).shuffle(seed=2)).batch(3)
    full = check_resume(lambda: gl.Loader(ds, workers=2), at=4)
    keys = [k for batch in full for k in batch["__key__"]]
    assert sorted(keys) == [f"s{i:05d}" for i in range(30)] and keys != sorted(keys)


@pytest.mark.parametrize(
    "case", ["size smaller, over zero bytes", "size larger, over the next member", "cut at a header"]
)
def test_a_damaged_shard_over_s3_is_an_error_on_every_read_path(
    s3: dict[str, Any], tmp_path: pathlib.Path, case: str
) -> None:
    """Indexed from the machine cache's copy, indexed by ranged requests (cache=False), streamed:
    each refuses the shard, naming it and the offset, and no index of it is kept."""
    data, message = damaged_tars()[case]
    url = f"s3://{s3['bucket']}/shard-000.tar"
    with storage.Store(s3["options"]).open_write(url) as out:
        out.write(data)
    match = message.replace("{url}", re.escape(url))
    for cache in (True, False):
        src = TarShards(url, storage_options=s3["options"], cache=cache, index_dir=tmp_path / "index")
        with pytest.raises(SourceError, match=match):
            src[0]
        with pytest.raises(SourceError, match=match):
            list(src.iter_records())
    assert not list((tmp_path / "index").glob("*.npz"))


@pytest.mark.slow
@pytest.mark.integration
def test_resume_over_s3_shards_in_shared_mode_serves_exactly_what_remains(
    s3: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    """Shared mode's resume promise (docs/resume.md): the rest of the epoch, each sample once."""
    urls = write_shards(s3["bucket"], s3["options"], n=30, per_shard=4, size=300)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    src = TarShards(urls, storage_options=s3["options"])
    ds = gl.Dataset(src).shuffle(seed=5, window=2).batch(3)
    server = Server(tmp_path / "s.sock")
    try:
        with gl.Loader(ds, workers=2, share=True, server=str(server.socket)) as loader:
            it = iter(loader)
            head = [k for _ in range(4) for k in next(it)["__key__"]]
            state = loader.state_dict()
        for share in (True, False):
            with gl.Loader(ds, workers=2, share=share, server=str(server.socket)) as resumed:
                resumed.load_state_dict(state)
                rest = [k for batch in resumed for k in batch["__key__"]]
            assert sorted(head + rest) == [f"s{i:05d}" for i in range(30)]
    finally:
        server.stop()
    assert proxy.total_bytes(prefix) == sum(st.size for st in src._stats)  # all read from one cache
    log = (tmp_path / "s.log").read_text()
    assert "Traceback" not in log and "different loop" not in log, log


@pytest.mark.integration
def test_the_servers_decoders_download_each_shard_once_and_ahead(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    """Through share=True, a windowed shuffle over s3:// shards: the decode workers read through
    the machine cache (each shard downloaded once in an epoch, none in the next), and the shards
    of a pass are downloaded ahead: while the job holds its first batch, the few loads of its
    window touch only some shards, yet all of them arrive."""
    urls = write_shards(s3["bucket"], s3["options"], n=64, per_shard=4, size=300)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard"
    indexed = TarShards(urls, storage_options=s3["options"])
    indexed.build_index()  # kept on disk: a later TarShards over these shards reads no shard to index them
    dataset_bytes = sum(st.size for st in indexed._stats)
    indexed.close()
    assert storage.ObjectCache().clear() >= dataset_bytes  # the shards must come again
    before = proxy.total_bytes(prefix)
    src = TarShards(urls, storage_options=s3["options"])
    ds = gl.Dataset(src).shuffle(seed=3, window=2).batch(4)
    server = Server(tmp_path / "s.sock")
    try:
        with gl.Loader(ds, workers=0, prefetch=1, share=True, server=str(server.socket)) as loader:
            it = iter(loader)
            keys = list(next(it)["__key__"])
            deadline = time.monotonic() + 30
            while proxy.total_bytes(prefix) - before < dataset_bytes and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proxy.total_bytes(prefix) - before == dataset_bytes, "the pass's shards were not downloaded ahead"
            keys += [k for batch in it for k in batch["__key__"]]
            loader.set_epoch(1)
            again = [k for batch in loader for k in batch["__key__"]]
    finally:
        server.stop()
    assert sorted(keys) == sorted(again) == [f"s{i:05d}" for i in range(64)]
    assert proxy.total_bytes(prefix) - before <= 1.02 * dataset_bytes  # both epochs: each shard once
    log = (tmp_path / "s.log").read_text()
    assert "Traceback" not in log, log


def test_parquet_over_s3_reads_the_same_rows(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    table = pa.table({"a": np.arange(5000, dtype=np.int64), "b": [f"row {i}" for i in range(5000)]})
    local = str(tmp_path / "t.parquet")
    pq.write_table(table, local, row_group_size=1000)
    url = f"s3://{s3['bucket']}/t.parquet"
    storage.Store(s3["options"]).filesystem(url)[0].put_file(local, url)
    remote, here = Parquet(url, storage_options=s3["options"]), Parquet(local)
    rows = [7, 4999, 0, 2500]
    assert [remote[i]["a"] for i in rows] == [here[i]["a"] for i in rows] == rows
    assert remote[2500]["b"] == "row 2500"


def test_a_parquet_column_read_downloads_only_its_blocks(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(0)
    table = pa.table({name: rng.random(250_000) for name in "abcdefgh"})  # 8 columns of 2 MB
    local = str(tmp_path / "wide.parquet")
    pq.write_table(table, local, compression="none")
    url = f"s3://{s3['bucket']}/wide.parquet"
    store = storage.Store(s3["options"], block_size="1MiB", cache_limit="4MB")  # whole objects up to 1 MB
    store.filesystem(url)[0].put_file(local, url)
    proxy, size = s3["proxy"], os.path.getsize(local)
    with storage.open_read(store, url, whole=False) as f:
        column = pq.ParquetFile(f).read(columns=["c"]).column("c").to_numpy()
    assert np.array_equal(column, table.column("c").to_numpy())
    downloaded = proxy.total_bytes(f"/{s3['bucket']}/wide")
    assert downloaded <= size / 3  # the footer's block and the column's: not the whole file


_JOB = """
import globalloader as gl
from globalloader.sources import TarShards
from globalloader.demo.s3 import options
src = TarShards({urls!r}, storage_options=options({endpoint!r}), cache={cache!r})
chain = gl.Dataset(src).shuffle(seed=0, window=2).batch(4)
with gl.Loader(chain, workers=2, mode={mode!r}) as loader:
    print(sum(len(b["cls"]) for b in loader))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "cache"), [("process", False), ("process", True), ("thread", False)])
def test_no_traceback_at_exit_from_the_s3_client(s3: dict[str, Any], mode: str, cache: bool) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=24, per_shard=4, size=300)
    code = _JOB.format(urls=urls, endpoint=s3["proxy"].url, cache=cache, mode=mode)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "24", result.stderr
    assert result.stderr.strip() == "", result.stderr  # no "attached to a different loop", no warnings


def test_image_folder_on_a_url_reads_through_the_cache(s3: dict[str, Any], tmp_path: pathlib.Path) -> None:
    local = tmp_path / "images"
    for cls in ("cat", "dog"):
        (local / cls / "sub").mkdir(parents=True)
        for i in range(3):
            (local / cls / f"{i}.jpg").write_bytes(os.urandom(500 + i))
        (local / cls / "sub" / "x.png").write_bytes(b"png" * 10)
        (local / cls / "notes.txt").write_text("not an image")
    fs = storage.Store(s3["options"]).filesystem(f"s3://{s3['bucket']}")[0]
    fs.put(f"{local}/", f"{s3['bucket']}/images/", recursive=True)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/images"
    remote = gl.ImageFolder(f"s3://{s3['bucket']}/images/", storage_options=s3["options"])
    here = gl.ImageFolder(local)
    assert remote.classes == here.classes == ["cat", "dog"] and len(remote) == len(here) == 8
    assert proxy.count("HEAD", prefix) == 0  # sizes and versions came with the listing
    for i in range(len(here)):
        assert remote[i] == here[i]
    assert proxy.count("GET", prefix) == 8  # each image downloaded once
    with gl.Loader(gl.Dataset(remote).shuffle(seed=0), workers=2) as loader:
        assert sorted(r["__key__"] for r in loader) == sorted(here[i]["__key__"] for i in range(8))
    assert proxy.count("GET", prefix) == 8  # the workers read the machine cache
    again = gl.ImageFolder(f"s3://{s3['bucket']}/images", storage_options=s3["options"])
    assert again.fingerprint == remote.fingerprint
    fs.pipe_file(f"{s3['bucket']}/images/dog/0.jpg", b"changed")
    changed = gl.ImageFolder(f"s3://{s3['bucket']}/images", storage_options=s3["options"])
    dog0 = [changed[i]["image"] for i in range(8) if changed[i]["__key__"] == "dog/0"]
    assert changed.fingerprint != remote.fingerprint and dog0 == [b"changed"]


def test_sizes_and_versions_come_from_the_listing_else_one_request_each(s3: dict[str, Any]) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=24, per_shard=8, size=300)
    proxy, prefix = s3["proxy"], f"/{s3['bucket']}/shard-"
    asked = storage.Store(s3["options"]).stats(urls)  # named one by one: a HEAD each
    assert proxy.count("HEAD", prefix) == len(urls) == 3
    listed = TarShards(f"s3://{s3['bucket']}/shard-*.tar", storage_options=s3["options"])
    assert proxy.count("HEAD", prefix) == 3  # the listing answered every shard
    assert listed.shards == urls and listed._stats == asked
    assert all(st.size > 0 and st.version for st in asked)


def test_listed_times_are_the_instants_botocore_s_own_parser_reads(s3: dict[str, Any]) -> None:
    """The S3 client reads an ISO 8601 time in UTC (each listed object's LastModified) with the
    standard library, not botocore's dateutil parse (a third of a LIST's client CPU); any other form
    is still botocore's, errors included."""
    from botocore.utils import parse_timestamp

    for value in ("2026-11-30T06:01:02.000Z", "2026-11-30T06:01:02.123456Z", "2024-02-29T23:59:59Z"):
        assert _fs._timestamp(value) == parse_timestamp(value) and _fs._timestamp(value).utcoffset() == dt.timedelta(0)
    for value in ("Mon, 30 Nov 2026 06:01:02 GMT", "2026-11-30T06:01:02+01:00", "1764482462", 1764482462):
        assert _fs._timestamp(value) == parse_timestamp(value)
    with pytest.raises(ValueError, match="2026-02-29T00:00:00Z"):
        _fs._timestamp("2026-02-29T00:00:00Z")  # no such day: botocore's own error
    [url] = write_shards(s3["bucket"], s3["options"], n=1, per_shard=2, size=100)
    fs, path = storage.Store(s3["options"]).filesystem(url)
    listed = fs.ls(s3["bucket"], detail=True, refresh=True)[0]["LastModified"]  # ISO 8601, from a LIST
    fs.invalidate_cache()
    headed = fs.info(path)["LastModified"]  # RFC 1123, from a HEAD
    assert listed == headed and listed.utcoffset() == dt.timedelta(0)
    parser = _fs._SESSION[0].get_component("response_parser_factory").create_parser("rest-xml")
    assert parser._timestamp_parser is _fs._timestamp  # the session the S3 clients share reads them so


def test_publish_puts_a_file_another_process_wrote_at_its_url_whole(tmp_path: pathlib.Path, s3: dict[str, Any]) -> None:
    # what write_shards' workers hand to the main process: a finished temporary file
    store = storage.Store(s3["options"])
    for url in (str(tmp_path / "out" / "a.bin"), f"s3://{s3['bucket']}/out/a.bin"):
        (tmp_path / "out").mkdir(exist_ok=True)
        temporary = tmp_path / "out" / ".a.bin.worker.tmp"
        temporary.write_bytes(b"whole" * 1000)
        store.publish(str(temporary), url)
        assert store.read_optional(url, 1 << 20) == b"whole" * 1000
        assert not temporary.exists()
    temporary.write_bytes(b"x")
    with pytest.raises(SourceError, match="cannot write"):
        store.publish(str(temporary), str(tmp_path / "no-such-folder" / "a.bin"))
    assert not temporary.exists()


# obstore (the S3 GETs' client) keeps a tokio runtime whose threads a fork does not copy: every
# call in a child forked after the parent's first GET through it would hang, even with a store
# made in the child. Such a child reads through s3fs.
@pytest.mark.timeout(120)
def test_process_workers_forked_after_the_parent_read_through_obstore_read_every_record(
    s3: dict[str, Any], isolated_cache: pathlib.Path
) -> None:
    urls = write_shards(s3["bucket"], s3["options"], n=24, per_shard=4, size=300, index=True)
    src = TarShards(urls, storage_options=s3["options"])  # indexed from the sidecars: no GET of a shard
    assert src[0]["__key__"] == "s00000"  # the parent reads shard 0: a GET through obstore here
    assert [os.getpid()] == _fs._OBSTORE_PID
    proxy = s3["proxy"]
    before = proxy.count("GET", suffix=".tar")
    with gl.Loader(gl.Dataset(src), workers=2) as loader:
        keys = sorted(r["__key__"] for r in loader)
    assert keys == [f"s{i:05d}" for i in range(24)]
    assert proxy.count("GET", suffix=".tar") - before == len(urls) - 1  # the workers downloaded the others
