"""What a sample read from a warm cache entry costs beyond the read itself.

A shard already in the object cache is read as a training job reads it: `--samples` reads of
`--sample-bytes` at random offsets of a `--entry-mib` entry, through `ObjectCache.open(...).pread`
(the shared lock, the block checks of what is read, the held-entries bookkeeping), against the
floor: `os.pread` of the same offsets from a plain file of the same bytes, in the same run,
taking turns, `--rounds` times. Each round opens the entry anew, so its blocks are checked again
as a new reader would. The figure is the median extra microseconds per sample and the ratio
cache / floor. JSON to benchmarks/results/cache_reads.json.

    python benchmarks/cache_reads.py [--samples 20000] [--sample-bytes 4096] [--entry-mib 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from globalloader.storage.cache import Entry, ObjectCache

RESULTS = Path(__file__).parent / "results" / "cache_reads.json"


def cache_us(cache: ObjectCache, entry: Entry, data: bytes, offsets: np.ndarray, length: int) -> float:
    """Microseconds per sample read through a new opening of the cached entry."""
    handle = cache.open(entry, lambda write: write(data))
    try:
        start = time.perf_counter()
        for offset in offsets.tolist():
            handle.pread(offset, length)
        return (time.perf_counter() - start) / len(offsets) * 1e6
    finally:
        handle.close()


def floor_us(path: Path, offsets: np.ndarray, length: int) -> float:
    """Microseconds per sample read with os.pread from a plain file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        for offset in offsets.tolist():
            os.pread(fd, length, offset)
        return (time.perf_counter() - start) / len(offsets) * 1e6
    finally:
        os.close(fd)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--sample-bytes", type=int, default=4096)
    parser.add_argument("--entry-mib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    size, length = args.entry_mib << 20, args.sample_bytes
    data = np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes()
    offsets = np.random.default_rng(1).integers(0, size - length, args.samples)
    entry = Entry("s3://bench/shard-000000.tar", size, "etag-1")
    with tempfile.TemporaryDirectory(prefix="gl-bench-reads-") as tmp:
        plain = Path(tmp) / "plain.bin"
        plain.write_bytes(data)
        cache = ObjectCache(Path(tmp) / "objects")
        cache.open(entry, lambda write: write(data)).close()  # the one download
        runs: dict[str, list[float]] = {"cache": [], "floor": []}
        for r in range(args.rounds):
            runs["cache"].append(cache_us(cache, entry, data, offsets, length))
            runs["floor"].append(floor_us(plain, offsets, length))
            print(f"round {r + 1}/{args.rounds}: cache {runs['cache'][-1]:.2f} us, floor {runs['floor'][-1]:.2f} us")
    result: dict[str, Any] = {k: summary(v) for k, v in runs.items()}
    extra = [c - f for c, f in zip(runs["cache"], runs["floor"], strict=True)]
    result["extra_us"] = summary(extra)
    result["ratio"] = result["cache"]["median"] / result["floor"]["median"]
    result["params"] = {k: v for k, v in vars(args).items() if k != "output"} | {"cpus": os.cpu_count()}
    result["params"]["python"] = platform.python_version()
    for key in ("cache", "floor", "extra_us"):
        s = result[key]
        print(f"{key:9s} {s['median']:7.2f} us per sample  [{s['min']:.2f}, {s['max']:.2f}]")
    print(f"cache / floor: {result['ratio']:.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
