"""Elastic resume at 1M samples: how big a state is and what loading one costs.

A chain of `--samples` samples (default 1M: shuffle, a random map, shard, batch(32)) checkpointed
at 40% of the epoch by a world of 8 ranks, loaded by rank 1 of a world of 6:

- exact (baseline): rank 1 of 8 loads its own state, the resume of before;
- lockstep: rank 0's state stands for all 8 ranks (one state, what a framework saves);
- out_of_step: the list of all 8 states, each rank at another position (up to 1% apart);
- twice_changed: the world went 8 -> 6 (out of step) -> 4; rank 0 of 4's state, loaded by rank 1 of 3.

Each round builds a fresh chain (the user's setup, not timed) and times `load_state_dict` alone,
then the first batch after it separately. Targets: every single state < 2 KB of JSON and a load
< 50 ms (median). JSON to benchmarks/results/elastic_state.json (`--output`).

    python benchmarks/elastic_state.py [--samples 1000000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import globalloader as gl

RESULTS = Path(__file__).parent / "results" / "elastic_state.json"


def noisy(x: Any, rng: np.random.Generator) -> dict[str, Any]:
    return {"x": x, "noise": rng.normal()}


def chain(samples: int, rank: int, world: int) -> gl.Dataset:
    return gl.Dataset(np.arange(samples)).shuffle(seed=1).map(noisy).shard(rank, world).batch(32)


def state_at(samples: int, rank: int, world: int, task: int, loaded: Any = None) -> dict[str, Any]:
    """A real state of `rank` after `task` batches (positioned by loading, not by iterating)."""
    it = chain(samples, rank, world).iterator()
    if loaded is not None:
        it.load_state_dict(loaded)
    here = it.state_dict()
    it.load_state_dict({**here, "task": here["task"] + task, "samples": here["samples"] + task * 32})
    return it.state_dict()


def scenarios(samples: int) -> dict[str, tuple[Any, int, int]]:
    """name -> (what is loaded, rank, world that loads it)."""
    at = int(samples / 8 * 0.4) // 32  # batches per rank at 40% of the epoch
    spread = max(1, int(samples / 8 * 0.01) // 32)
    own = state_at(samples, 1, 8, at)
    lockstep = state_at(samples, 0, 8, at)
    every = [state_at(samples, r, 8, at + (r * spread) // 7) for r in range(8)]
    middle = [state_at(samples, r, 6, 100 + r, every) for r in range(6)]
    twice = state_at(samples, 0, 4, 50, middle)
    return {
        "exact": (own, 1, 8),
        "lockstep": (lockstep, 1, 6),
        "out_of_step": (every, 1, 6),
        "twice_changed": (twice, 1, 3),
    }


def measure(samples: int, loaded: Any, rank: int, world: int) -> tuple[float, float]:
    ds = chain(samples, rank, world)
    loader = gl.Loader(ds)
    t0 = time.perf_counter()
    loader.load_state_dict(loaded)
    t1 = time.perf_counter()
    next(iter(loader))
    t2 = time.perf_counter()
    loader.close()
    return t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (a median of 3 or more)")

    cases = scenarios(args.samples)
    times: dict[str, dict[str, list[float]]] = {name: {"load": [], "first_batch": []} for name in cases}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, (loaded, rank, world) in cases.items():  # the scenarios take turns in every round
            load, first = measure(args.samples, loaded, rank, world)
            times[name]["load"].append(load)
            times[name]["first_batch"].append(first)

    summary: dict[str, Any] = {
        "samples": args.samples,
        "rounds": args.rounds,
        "machine": platform.platform(),
        "targets": {"state_bytes": 2048, "load_ms": 50},
        "scenarios": {},
    }
    base = statistics.median(times["exact"]["load"])
    print(
        f"{'scenario':<14} {'state bytes':>12} {'load ms (median, min-max)':>28} {'vs exact':>9} {'1st batch ms':>13}"
    )
    for name, (loaded, _rank, _world) in cases.items():
        states = loaded if isinstance(loaded, list) else [loaded]
        sizes = [len(json.dumps(s)) for s in states]
        load = [t * 1000 for t in times[name]["load"]]
        first = [t * 1000 for t in times[name]["first_batch"]]
        row = {
            "states": len(states),
            "state_bytes_max": max(sizes),
            "state_bytes_total": sum(sizes),
            "load_ms_median": statistics.median(load),
            "load_ms_min": min(load),
            "load_ms_max": max(load),
            "load_vs_exact": statistics.median(times[name]["load"]) / base,
            "first_batch_ms_median": statistics.median(first),
            "first_batch_ms_min": min(first),
            "first_batch_ms_max": max(first),
            "meets_targets": max(sizes) < 2048 and statistics.median(load) < 50,
        }
        summary["scenarios"][name] = row
        span = f"{row['load_ms_median']:.2f} ({row['load_ms_min']:.2f}-{row['load_ms_max']:.2f})"
        print(
            f"{name:<14} {max(sizes):>12} {span:>28} {row['load_vs_exact']:>8.1f}x "
            f"{row['first_batch_ms_median']:>13.1f}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
