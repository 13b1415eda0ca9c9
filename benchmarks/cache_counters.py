"""What the object cache's machine-wide counters cost: one update per open of a cached entry.

An open of an entry already in the cache (a hit: open, shared lock, trailer check, access-time
refresh, the counters' update, and the release: the last reader's reads the record's size) is
timed against the counters' update alone (open the record, lock, read, write, close), in the
same run, taking turns, `--rounds` times of `--opens` each; then the same with `--procs`
processes opening at once (the update's lock is shared by the machine). The ratio update / open
is the share of a hit's time the counters take; a hit happens once per opening of a shard or
block, not per sample. A hit reads no data (its blocks are checked as they are read), so its
cost does not depend on the entry's size (`--entry-bytes`, 4 KiB). JSON to
benchmarks/results/cache_counters.json.

    python benchmarks/cache_counters.py [--opens 5000] [--rounds 5] [--procs 2] [--entry-bytes 4096]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from globalloader.storage.cache import Entry, ObjectCache

RESULTS = Path(__file__).parent / "results" / "cache_counters.json"


def _entry(size: int) -> Entry:
    return Entry("s3://bench/shard-000000.tar", size, "etag-1")


def hit_us(root: str, opens: int, size: int) -> float:
    """Microseconds per open of a cached entry (counters included)."""
    cache, entry = ObjectCache(root), _entry(size)
    start = time.perf_counter()
    for _ in range(opens):
        cache.open(entry, lambda write: write(b"x" * size)).close()
    return (time.perf_counter() - start) / opens * 1e6


def update_us(root: str, opens: int, size: int) -> float:
    """Microseconds per update of the counters alone."""
    stats = ObjectCache(root).stats
    start = time.perf_counter()
    for _ in range(opens):
        with stats.update() as record:
            record["hits"] += 1
    return (time.perf_counter() - start) / opens * 1e6


def _in_procs(what: str, root: str, opens: int, procs: int, size: int) -> float:
    """Mean microseconds per call with `procs` processes calling at once."""
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        return statistics.fmean(pool.starmap(globals()[what], [(root, opens, size)] * procs))


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--opens", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--entry-bytes", type=int, default=4096)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gl-bench-cache-") as tmp:
        root = str(Path(tmp) / "objects")
        size = args.entry_bytes
        hit_us(root, 1, size)  # the one download
        runs: dict[str, list[float]] = {k: [] for k in ("hit", "update", "hit_procs", "update_procs")}
        for r in range(args.rounds):
            runs["hit"].append(hit_us(root, args.opens, size))
            runs["update"].append(update_us(root, args.opens, size))
            runs["hit_procs"].append(_in_procs("hit_us", root, args.opens, args.procs, size))
            runs["update_procs"].append(_in_procs("update_us", root, args.opens, args.procs, size))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f} us" for k, v in runs.items()))
    result: dict[str, Any] = {k: summary(v) for k, v in runs.items()}
    result["share_of_a_hit"] = result["update"]["median"] / result["hit"]["median"]
    result["share_of_a_hit_procs"] = result["update_procs"]["median"] / result["hit_procs"]["median"]
    result["params"] = {k: v for k, v in vars(args).items() if k != "output"} | {"cpus": os.cpu_count()}
    result["params"]["python"] = platform.python_version()
    for key in ("hit", "update", "hit_procs", "update_procs"):
        s = result[key]
        print(f"{key:13s} {s['median']:8.1f} us per call  [{s['min']:.1f}, {s['max']:.1f}]")
    print(
        f"counters' share of a hit: {result['share_of_a_hit']:.2f} (1 process), "
        f"{result['share_of_a_hit_procs']:.2f} ({args.procs} processes at once)"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
