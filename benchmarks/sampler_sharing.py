"""Benchmark: how many loads the joint sampler shares between jobs, and how fast it decides.

Everything is simulated in index space: jobs ask `JointSampler.next`, a buffer pool of C
samples decides hits and misses and reports `loaded`/`evicted` back. Pool policies:
  lru     a hit refreshes the sample (what a plain LRU second tier does)
  fifo    samples leave in load order (the pool of the sharing table in docs/shared.md)
  wanted  LRU, but a sample that no job still wants this epoch (`JointSampler.wanted`) is
          put first in line for eviction
Scenarios, each with its baseline measured in the same run (independent plain shuffles through
the same pool):
  speed   two jobs over the same n indices, the fast one making r requests per request of the
          slow one, C = c * sqrt(r * n): loads saved per slow request (r + 1 - loads per slow
          request: 1.0 is perfect sharing, 0 none), and the share of the slow job's requests
          that were followed (the jobs may swap roles, the faster one following the slower,
          without changing the loads). For r = 1 the loads per step of the pair are printed.
  offset  the same with the fast job starting n/3 requests ahead, so the two jobs' epochs are
          out of phase (as for two jobs started at different times).
  lockstep  K = 2 and 4 jobs taking turns, identical / 50%-overlap / nested sets: loads per
          epoch of the largest set, relative to the size of the union. The slides' per-step
          coupling (`CoupledPair`, two jobs) is the reference.
  speed of decisions: `next` (with `loaded`/`evicted` reports) for K = 4 jobs over n = 1,000,000.

    python benchmarks/sampler_sharing.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
from coupled import CoupledPair  # benchmarks/coupled.py, beside this file
from tqdm import tqdm

from globalloader.sampling import JointSampler

RESULTS = Path(__file__).resolve().parent / "results" / "sampler_sharing.json"
POLICIES = ("lru", "fifo", "wanted")
TARGET_SAVED = {2: 0.96, 4: 0.97}  # loads saved per slow request at C = 0.25 * sqrt(r * n)
TARGET_IDENTICAL_LOADS = 1.01  # identical sets, K = 4, lock-step: loads per epoch / n
TARGET_DECISIONS_PER_S = 200_000.0  # K = 4 jobs over n = 1,000,000, one core


class _Pool:
    """A buffer pool of `capacity` samples that reports loads and evictions to the samplers."""

    def __init__(self, capacity: int, policy: str, samplers: list[Any]) -> None:
        self.capacity = capacity
        self.policy = policy
        self.samplers = samplers
        self.order: OrderedDict[int, None] = OrderedDict()  # first = next to evict
        self.loads = 0

    def request(self, index: int) -> bool:
        """Serve `index`: True on a hit, False when it had to be loaded."""
        order = self.order
        hit = index in order
        if hit:
            if self.policy != "fifo":
                order.move_to_end(index)
        else:
            self.loads += 1
            if len(order) >= self.capacity:
                old, _ = order.popitem(last=False)
                for sampler in self.samplers:
                    sampler.evicted(old)
            order[index] = None
            for sampler in self.samplers:
                sampler.loaded(index)
        if self.policy == "wanted" and not self.samplers[0].wanted(index):
            order.move_to_end(index, last=False)
        return hit


class _Jobs:
    """Jobs drawing through one pool, each from the joint sampler or alone (the baseline)."""

    def __init__(self, sets: list[range], capacity: int, policy: str, joint: bool, seed: int):
        self.names = [f"job{k}" for k in range(len(sets))]
        if joint:
            shared = JointSampler(seed)
            self.samplers = [shared] * len(sets)
            for name, indices in zip(self.names, sets, strict=True):
                shared.add_job(name, indices)
            reported = [shared]
        else:
            self.samplers = [JointSampler(seed + k) for k in range(len(sets))]
            for name, sampler, indices in zip(self.names, self.samplers, sets, strict=True):
                sampler.add_job(name, indices)
            reported = []  # alone, a job never follows: it needs no residency reports
            if policy == "wanted":
                policy = "lru"
        self.pool = _Pool(capacity, policy, reported)
        self.hits = [0] * len(sets)
        self.requests = [0] * len(sets)

    def request(self, k: int) -> None:
        sampler, name = self.samplers[k], self.names[k]
        try:
            index = sampler.next(name)
        except StopIteration:
            sampler.new_epoch(name)
            index = sampler.next(name)
        self.requests[k] += 1
        self.hits[k] += self.pool.request(index)

    def followed(self, k: int) -> int:
        return self.samplers[k].stats()[self.names[k]]["followed"]


def speed_ratio(n: int, r: int, c: float, policy: str, epochs: int, joint: bool, ahead: int = 0) -> dict:
    """Two identical-set jobs, the fast one making r requests per slow request and starting
    `ahead` requests early (not counted)."""
    capacity = max(1, round(c * math.sqrt(r * n)))
    jobs = _Jobs([range(n), range(n)], capacity, policy, joint, seed=17 * r + n)
    for _ in range(ahead):
        jobs.request(1)
    loads_before, followed_before, hits_before = jobs.pool.loads, jobs.followed(0), jobs.hits[0]
    for _ in range(epochs * n):
        for _ in range(r):
            jobs.request(1)
        jobs.request(0)
    slow = jobs.requests[0]
    loads = (jobs.pool.loads - loads_before) / slow
    return {
        "n": n,
        "r": r,
        "c": c,
        "capacity": capacity,
        "policy": policy,
        "ahead": ahead,
        "slow_epochs": epochs,
        "followed_share": round((jobs.followed(0) - followed_before) / slow, 4),
        "hit_share": round((jobs.hits[0] - hits_before) / slow, 4),
        "loads_per_slow_request": round(loads, 4),
        # r + 1 requests per slow request; r loads is perfect sharing, r + 1 none
        "loads_saved_per_slow_request": round(r + 1 - loads, 4),
    }


def lockstep(sets: list[range], capacity: int, policy: str, epochs: int, joint: bool) -> float:
    """Jobs taking turns; loads per epoch of the largest set, relative to the union's size."""
    jobs = _Jobs(sets, capacity, policy, joint, seed=len(sets))
    longest = max(len(s) for s in sets)
    for _ in range(epochs * longest):
        for k in range(len(sets)):
            jobs.request(k)
    union = len(set().union(*sets))
    return round(jobs.pool.loads / (epochs * union), 4)


def lockstep_coupled(sets: list[range], capacity: int, epochs: int) -> dict:
    """The slides' per-step coupling for two jobs: loads with no pool and through the pool."""
    pair = CoupledPair(sets[0], sets[1], random.Random(0))
    pool = _Pool(capacity, "lru", [])
    longest = max(len(s) for s in sets)
    per_step = 0
    for _ in range(epochs * longest):
        e1, e2 = pair.step()
        per_step += 1 if e1 == e2 else 2
        pool.request(e1)
        pool.request(e2)
    union = len(set().union(*sets))
    return {
        "no_pool": round(per_step / (epochs * union), 4),
        "with_pool": round(pool.loads / (epochs * union), 4),
    }


def decisions_per_second(n: int, identical: bool, total: int) -> dict:
    """K = 4 jobs with speeds 1, 1, 2, 3 and a load-order window of 4096 resident samples.

    The time covers the whole loop: next, loaded, evicted and the window's own bookkeeping.
    """
    rng = np.random.default_rng(0)
    sampler = JointSampler(0)
    start = time.perf_counter()
    for k in range(4):
        indices = np.arange(n) if identical else np.flatnonzero(rng.random(n) < 0.75)
        sampler.add_job(k, indices)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    sampler.new_epoch(0)
    epoch_start = time.perf_counter() - start
    window: deque[int] = deque()
    resident: set[int] = set()
    next_, loaded, evicted = sampler.next, sampler.loaded, sampler.evicted
    speeds = (1, 1, 2, 3)
    done = 0
    start = time.perf_counter()
    while done < total:
        for k in range(4):
            for _ in range(speeds[k]):
                try:
                    index = next_(k)
                except StopIteration:
                    sampler.new_epoch(k)
                    index = next_(k)
                done += 1
                if index not in resident:
                    resident.add(index)
                    window.append(index)
                    loaded(index)
                    if len(window) > 4096:
                        old = window.popleft()
                        resident.discard(old)
                        evicted(old)
    elapsed = time.perf_counter() - start
    stats = sampler.stats()
    return {
        "n": n,
        "jobs": 4,
        "sets": "identical" if identical else "random 75% each",
        "decisions": done,
        "seconds": round(elapsed, 3),
        "decisions_per_s": round(done / elapsed),
        "followed_share": round(sum(s["followed"] for s in stats.values()) / done, 4),
        "add_4_jobs_s": round(setup, 3),
        "new_epoch_s": round(epoch_start, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs and sizes")
    args = parser.parse_args()
    small_epochs, large_epochs = (3, 1) if args.quick else (10, 2)
    cs = (0.1, 0.25, 0.5, 1.0, 2.0)
    speed_runs = [(10_000, r, c, p, small_epochs) for r in (1, 2, 4) for c in cs for p in POLICIES]
    speed_runs += [(100_000, r, c, p, large_epochs) for r in (2, 4) for c in (0.25, 1.0) for p in POLICIES]
    offset_runs = [(10_000, r, c, "fifo", small_epochs) for r in (1, 2) for c in (0.25, 1.0)]
    overlap2 = [range(1000), range(500, 1500)]
    nested2 = [range(1000), range(500)]
    scenarios = {
        "identical K=2": [range(10_000)] * 2,
        "identical K=4": [range(10_000)] * 4,
        "overlap50 K=2": overlap2,
        "overlap50 K=4": [range(500 * k, 500 * k + 1000) for k in range(4)],
        "nested K=2": nested2,
        "nested K=4": [range(1000), range(500), range(250), range(125)],
    }
    lock_runs = [(name, p) for name in scenarios for p in POLICIES]
    bar = tqdm(total=2 * len(speed_runs) + 2 * len(offset_runs) + len(lock_runs) + 2, desc="sampler_sharing")

    speed = []
    for n, r, c, policy, epochs in speed_runs:
        row = speed_ratio(n, r, c, policy, epochs, joint=True)
        bar.update()
        alone = speed_ratio(n, r, c, policy, epochs, joint=False)
        bar.update()
        row["independent_hit_share"] = alone["hit_share"]
        row["independent_loads_per_slow_request"] = alone["loads_per_slow_request"]
        row["loads_saved_ratio"] = round(alone["loads_per_slow_request"] / row["loads_per_slow_request"], 3)
        speed.append(row)

    offset = []
    for n, r, c, policy, epochs in offset_runs:
        row = speed_ratio(n, r, c, policy, epochs, joint=True, ahead=n // 3)
        bar.update()
        alone = speed_ratio(n, r, c, policy, epochs, joint=False, ahead=n // 3)
        bar.update()
        row["independent_loads_saved_per_slow_request"] = alone["loads_saved_per_slow_request"]
        offset.append(row)

    lock = []
    for name, policy in lock_runs:
        sets = scenarios[name]
        capacity = max(1, max(len(s) for s in sets) // 10)
        epochs = 3 if len(sets[0]) > 1000 else 20
        row = {
            "scenario": name,
            "sizes": [len(s) for s in sets],
            "union": len(set().union(*sets)),
            "capacity": capacity,
            "policy": policy,
            "epochs": epochs,
            "loads_per_epoch_over_union": lockstep(sets, capacity, policy, epochs, True),
            "independent": lockstep(sets, capacity, policy, epochs, False),
        }
        if len(sets) == 2 and policy == "lru":
            row["coupled_reference"] = lockstep_coupled(sets, capacity, epochs)
        lock.append(row)
        bar.update()

    total = 300_000 if args.quick else 1_000_000
    rate = [decisions_per_second(1_000_000, identical, total) for identical in (True, False)]
    bar.update(2)
    bar.close()

    targets = [
        {
            "target": f"loads saved per slow request >= {TARGET_SAVED[row['r']]} "
            f"(r={row['r']}, n={row['n']}, C={row['capacity']}, {row['policy']})",
            "value": row["loads_saved_per_slow_request"],
            "met": row["loads_saved_per_slow_request"] >= TARGET_SAVED[row["r"]],
        }
        for row in speed
        if row["r"] in TARGET_SAVED and row["c"] == 0.25
    ]
    targets += [
        {
            "target": f"identical K=4 lock-step loads/epoch <= {TARGET_IDENTICAL_LOADS} n ({row['policy']})",
            "value": row["loads_per_epoch_over_union"],
            "met": row["loads_per_epoch_over_union"] <= TARGET_IDENTICAL_LOADS,
        }
        for row in lock
        if row["scenario"] == "identical K=4"
    ]
    targets += [
        {
            "target": f"next >= {TARGET_DECISIONS_PER_S:.0f} decisions/s (K=4, n=1e6, {row['sets']})",
            "value": row["decisions_per_s"],
            "met": row["decisions_per_s"] >= TARGET_DECISIONS_PER_S,
        }
        for row in rate
    ]

    print(
        "\nspeed ratio: loads saved per slow request, slow job's followed share (hit share) | "
        "independent hit share | loads ratio independent/joint (r=1: loads per step of the pair instead)"
    )
    for row in speed:
        head = f"  n={row['n']:>6} r={row['r']} C={row['capacity']:>4} ({row['c']:>4}) {row['policy']:>6}: "
        if row["r"] == 1:
            print(
                f"{head}loads/step {row['loads_per_slow_request']:.4f} | independent "
                f"{row['independent_loads_per_slow_request']:.4f} | "
                f"ratio {row['loads_saved_ratio']:.2f}"
            )
            continue
        print(
            f"{head}loads saved {row['loads_saved_per_slow_request']:.4f}, followed {row['followed_share']:.4f} "
            f"(hits {row['hit_share']:.4f}) | independent {row['independent_hit_share']:.4f} | "
            f"ratio {row['loads_saved_ratio']:.2f}"
        )
    print("\nphase offset (fast job n/3 requests ahead): loads saved per slow request | independent")
    for row in offset:
        print(
            f"  n={row['n']:>6} r={row['r']} C={row['capacity']:>4} ({row['c']:>4}) {row['policy']:>6}: "
            f"{row['loads_saved_per_slow_request']:.4f}, followed {row['followed_share']:.4f} | "
            f"{row['independent_loads_saved_per_slow_request']:.4f}"
        )
    print("\nlock-step: loads per epoch / union (joint | independent | coupled reference)")
    for row in lock:
        ref = row.get("coupled_reference")
        ref_text = ""
        if ref:
            ref_text = f" | coupled {ref['no_pool']} no pool, {ref['with_pool']} with pool"
        print(
            f"  {row['scenario']:<14} C={row['capacity']:>4} {row['policy']:>6}: "
            f"{row['loads_per_epoch_over_union']:.4f} | {row['independent']:.4f} "
            f"(ratio {row['independent'] / row['loads_per_epoch_over_union']:.2f}){ref_text}"
        )
    print("\ndecisions per second (whole loop, one core)")
    for row in rate:
        print(
            f"  {row['sets']}: {row['decisions_per_s']:,}/s, followed {row['followed_share']}, "
            f"add_job x4 {row['add_4_jobs_s']} s, new_epoch {row['new_epoch_s']} s"
        )
    print("\ntargets")
    for t in targets:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']}")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "sampler_sharing",
                "quick": args.quick,
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "speed_ratio": speed,
                "offset": offset,
                "lockstep": lock,
                "decisions": rate,
                "targets": targets,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
