"""The demo's third act: three jobs reading the same tar shards from a local S3 server, first
without the machine-wide cache (every job downloads the shards itself, sample by sample), then
with it (one download for the machine). Needs moto's server and s3fs (the `test` extra); skipped
with a one-line note when they are missing."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

JOBS = 3
LATENCY = 0.005  # seconds the proxy adds per request, a nearby object store


def act_three(images: int, workers: int = 2, runs: int = 1) -> dict[str, Any] | None:
    """Write the demo's JPEGs as tar shards to a local S3 server, run 3 jobs at once `runs`
    times without and with the cache; print and return the medians."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        print("\nact 3 skipped: a local S3 server needs moto[server] and s3fs (pip install 'moto[server]' s3fs)")
        return None
    from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options
    from globalloader.demo.workload import demo_images
    from globalloader.sources import TarWriter

    server = MotoServer()
    proxy = FaultProxy(server.port)
    try:
        bucket = new_bucket(proxy.url)
        with TarWriter(f"s3://{bucket}/shard-%04d.tar", maxcount=100, storage_options=options(proxy.url)) as writer:
            for i, path in enumerate(sorted(Path(demo_images(images, progress=False)).rglob("*.jpg"))):
                writer.write({"__key__": f"s{i:06d}", "jpg": path.read_bytes(), "cls": i % 10})
        dataset = _bytes_of(writer.paths, proxy.url)
        print(
            f"\nact 3: {JOBS} jobs at once read {len(writer.paths)} tar shards ({dataset / 1e6:.1f} MB) from a local "
            f"S3 server (+{LATENCY * 1e3:.0f} ms per request), {workers} workers each, a windowed shuffle; "
            f"{runs} run(s) of each, median (min-max)"
        )
        proxy.latency = LATENCY
        result: dict[str, Any] = {"dataset_bytes": dataset}
        for label, cache in (("without the cache", False), ("with the machine cache", True)):
            rows = [_jobs(writer.paths, proxy, workers, cache) for _ in range(runs)]
            result[label] = {
                "bytes": statistics.median(r["bytes"] for r in rows),
                "wall_s": statistics.median(r["wall_s"] for r in rows),
                "samples": rows[0]["samples"],
            }
            shown = _spread([r["bytes"] / dataset for r in rows], "{:.2f}x")
            wall = _spread([r["wall_s"] for r in rows], "{:.2f}")
            print(f"{label:<24} downloaded {shown} the shards, all jobs done in {wall} s")
        return result
    finally:
        proxy.stop()
        server.stop()


def _spread(values: list[float], fmt: str) -> str:
    """The median with the min and max, as the other acts show them."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _bytes_of(urls: list[str], endpoint: str) -> int:
    from globalloader import storage
    from globalloader.demo.s3 import options

    store = storage.Store(options(endpoint))
    return sum(store.stat(url).size for url in urls)


def _jobs(urls: list[str], proxy: Any, workers: int, cache: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="gl-demo-remote-"))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    try:
        before, start = proxy.total_bytes(), time.perf_counter()
        jobs = [
            ctx.Process(target=_job, args=(urls, proxy.url, workers, cache, str(folder), seed, out))
            for seed in range(JOBS)
        ]
        for job in jobs:
            job.start()
        samples = [out.get(timeout=600) for _ in jobs]
        for job in jobs:
            job.join(60)
        return {"bytes": proxy.total_bytes() - before, "wall_s": time.perf_counter() - start, "samples": samples}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _job(urls: list[str], endpoint: str, workers: int, cache: bool, folder: str, seed: int, out: Any) -> None:
    os.environ["GLOBALLOADER_CACHE_DIR"] = folder  # one cache folder for the three jobs: one machine
    import globalloader as gl
    from globalloader.demo.s3 import options

    shards = gl.TarShards(urls, storage_options=options(endpoint), cache=cache)
    chain = gl.Dataset(shards).shuffle(seed=seed, window=2).map(_size).batch(32)
    with gl.Loader(chain, workers=workers) as loader:
        out.put(sum(len(batch["bytes"]) for batch in loader))


def _size(record: dict[str, Any]) -> dict[str, Any]:
    return {"bytes": len(record["jpg"])}
