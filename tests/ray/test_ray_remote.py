"""The Ray shuffle over s3:// on a real S3 server (moto), through the public sources and the
machine-wide cache: files with storage_options=, a source object, and a gl.Dataset's source."""

from __future__ import annotations

import gzip
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.cloudpickle

import globalloader as gl
from globalloader import storage
from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options, write_shards
from globalloader.ray import ShufflingDataset
from helpers import stop_ray

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Iterator[dict[str, Any]]:
    server = MotoServer()
    proxy = FaultProxy(server.port)
    cache = tmp_path_factory.mktemp("ray-s3-cache")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(
        address="local",  # a cluster of its own, even when another one runs on this machine
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
        runtime_env={"env_vars": {"GLOBALLOADER_CACHE_DIR": str(cache)}},
    )
    yield {
        "bucket": new_bucket(proxy.url),
        "options": options(proxy.url),
        "proxy": proxy,
        "tmp": cache.parent,
        "cache": cache,
    }
    stop_ray()
    proxy.stop()
    server.stop()


def epoch_keys(data: Any, column: str, **kwargs: Any) -> list[list[Any]]:
    with ShufflingDataset(data, num_epochs=2, num_trainers=1, batch_size=7, rank=0, **kwargs) as ds:
        return [[k for batch in ds for k in batch[column].tolist()] for _ in range(2)]


def test_parquet_files_on_s3_with_storage_options_are_shuffled_once_per_epoch(s3: dict[str, Any]) -> None:
    urls = []
    for f in range(3):
        local = s3["tmp"] / f"part-{f}.parquet"
        pq.write_table(pa.table({"key": np.arange(f * 40, f * 40 + 40), "v": np.arange(40) * 0.5}), local)
        urls.append(f"s3://{s3['bucket']}/part-{f}.parquet")
        storage.Store(s3["options"]).filesystem(urls[-1])[0].put_file(str(local), urls[-1])
    epochs = epoch_keys(urls, "key", columns=["key"], storage_options=s3["options"])
    assert all(sorted(keys) == list(range(120)) for keys in epochs) and epochs[0] != epochs[1]
    # The same files as a source object shuffle exactly alike: parts are the files either way.
    source = gl.Parquet(urls, columns=["key"], storage_options=s3["options"])
    assert epoch_keys(gl.Dataset(source), "key", columns=["key"]) == epochs


def test_columns_of_parquet_files_on_s3_download_only_the_blocks_they_are_in(s3: dict[str, Any], monkeypatch) -> None:
    """`columns=` reaches the files' source: a key column beside a 40 MiB payload downloads the
    footer's and the key's blocks of the cache (8 MiB each: 16 MiB of 40), not the payload's."""
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(s3["cache"]))  # the machine's cache, as Ray's tasks have it
    local = s3["tmp"] / "wide.parquet"
    payload = [np.random.default_rng(i).bytes(1 << 20) for i in range(40)]
    pq.write_table(pa.table({"key": np.arange(40), "payload": payload}), local, row_group_size=40)
    url = f"s3://{s3['bucket']}/wide.parquet"
    storage.Store(s3["options"]).filesystem(url)[0].put_file(str(local), url)
    before = s3["proxy"].total_bytes(f"/{s3['bucket']}/wide.parquet")
    epochs = epoch_keys([url], "key", columns=["key"], storage_options=s3["options"])
    assert all(sorted(keys) == list(range(40)) for keys in epochs)
    downloaded = s3["proxy"].total_bytes(f"/{s3['bucket']}/wide.parquet") - before
    assert 0 < downloaded < local.stat().st_size / 2  # every column: the whole file


def test_tar_shards_on_s3_are_read_through_the_cache_once(s3: dict[str, Any], monkeypatch) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(s3["cache"]))  # the machine's cache, as Ray's tasks have it
    urls = write_shards(s3["bucket"], s3["options"], n=30, per_shard=8, size=300)
    prefix = f"/{s3['bucket']}/shard"
    source = gl.TarShards(urls, storage_options=s3["options"])
    before = s3["proxy"].total_bytes(prefix)
    epochs = epoch_keys(source, "__key__")
    assert all(sorted(keys) == [f"s{i:05d}" for i in range(30)] for keys in epochs)
    sizes = sum(storage.Store(s3["options"]).stat(u).size for u in urls)
    assert s3["proxy"].total_bytes(prefix) - before <= sizes  # index, both epochs: each shard downloaded once


def test_gzip_tar_shards_on_s3_stream_like_the_same_local_tar_shards(s3: dict[str, Any], monkeypatch) -> None:
    monkeypatch.setenv("GLOBALLOADER_CACHE_DIR", str(s3["cache"]))
    with gl.TarWriter(str(s3["tmp"] / "plain-%03d.tar"), maxcount=8) as writer:
        for i in range(30):
            writer.write({"__key__": f"g{i:05d}", "cls": i})
    urls = []
    for n, path in enumerate(writer.paths):
        urls.append(f"s3://{s3['bucket']}/packed-{n:03d}" + (".tgz" if n % 2 else ".tar.gz"))
        with storage.Store(s3["options"]).filesystem(urls[-1])[0].open(urls[-1], "wb") as out:
            out.write(gzip.compress(pathlib.Path(path).read_bytes()))
    before = s3["proxy"].total_bytes(f"/{s3['bucket']}/packed")
    epochs = epoch_keys(urls, "__key__", storage_options=s3["options"])
    assert all(sorted(keys) == [f"g{i:05d}" for i in range(30)] for keys in epochs) and epochs[0] != epochs[1]
    sizes = sum(storage.Store(s3["options"]).stat(u).size for u in urls)
    assert s3["proxy"].total_bytes(f"/{s3['bucket']}/packed") - before == sizes  # counted, read twice: downloaded once
    assert epochs == epoch_keys(writer.paths, "__key__")  # the same seed: the order of the uncompressed shards
