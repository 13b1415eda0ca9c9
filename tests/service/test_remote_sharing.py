"""Jobs sharing remote shards through a real server: tar shards in a moto S3 bucket behind the
counting proxy, the server's decode workers reading them through the machine cache."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import globalloader as gl
from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options, write_shards
from globalloader.service.launcher import request

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]

SAMPLES, PER_SHARD = 48, 8


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def shards(moto: MotoServer) -> Iterator[tuple[FaultProxy, str, list[str]]]:
    proxy = FaultProxy(moto.port)
    bucket = new_bucket(proxy.url)
    paths = write_shards(bucket, options(proxy.url), n=SAMPLES, per_shard=PER_SHARD, index=True)
    yield proxy, f"s3://{bucket}/shard-*.tar", paths
    proxy.stop()


def label(record: dict[str, Any]) -> dict[str, Any]:
    """The shared map: the sample's label and the sum of its bytes (what the server stores)."""
    return {"cls": int(record["cls"]), "sum": int(np.frombuffer(record["bin"], np.uint8).sum())}


def test_two_jobs_share_remote_shards_each_epoch_exact_each_shard_downloaded_once(server, shards):
    proxy, url, paths = shards
    seen: dict[int, list[int]] = {}
    failures: list[BaseException] = []

    def job(k: int) -> None:
        try:
            src = gl.TarShards(url, storage_options=options(proxy.url))
            chain = gl.Dataset(src).shuffle(seed=k).map(label, shared=True).batch(5)
            with gl.Loader(chain, share=True, server=str(server.socket), name=f"job-{k}") as loader:
                seen[k] = [int(c) for batch in loader for c in batch["cls"]]
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    threads = [threading.Thread(target=job, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not failures, failures
    for k in range(2):
        assert Counter(seen[k]) == Counter(range(SAMPLES)), f"job {k} did not see its set exactly once"
    keys = [path.split("://", 1)[1] for path in paths]
    gets = {key: proxy.requests[f"GET /{key}"] for key in keys}
    assert gets == dict.fromkeys(keys, 1), "a shard was downloaded more than once (or never)"
    status = request(server.socket, "status")[1]
    assert status["requests"] == 2 * SAMPLES
    assert status["decodes"] == SAMPLES, "a sample was decoded for each job instead of once for both"


def clients_imported(index: int) -> dict[str, Any]:
    """The shared map run by a decode worker: whether the S3 client was there before any read."""
    import sys

    return {"index": index, "s3fs": "s3fs" in sys.modules}


def test_decode_workers_start_with_the_remote_clients_imported(server):
    # A local source: nothing in the worker imports s3fs, unless the server did before forking it
    # (else each worker, and each restarted one, imports it on its first remote load).
    chain = gl.Dataset(gl.from_sequence(list(range(8)))).map(clients_imported, shared=True).batch(4)
    with gl.Loader(chain, share=True, server=str(server.socket)) as loader:
        imported = [bool(flag) for batch in loader for flag in batch["s3fs"]]
    assert imported == [True] * 8
