"""`globalloader demo`: both acts, each measured `runs` times and shown as median (min-max).

One run of a few seconds on a shared machine can be off by tens of percent, so every figure
the demo prints is the median of its runs with their spread, and each ratio is the median of
the ratios of paired runs (run k of one loader against run k of the other, alternated so that
both see the same machine), never the ratio of two single runs.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from globalloader.demo.jobs import JobSpec, run_jobs
from globalloader.demo.remote import act_three
from globalloader.demo.workload import demo_images, run_globalloader, run_torch
from globalloader.errors import ArgumentError, check_int


def spread(values: Sequence[float]) -> dict[str, float]:
    """The median of `values` with their min and max (and how many there were)."""
    if not values:
        raise ArgumentError("spread: no values (runs must be >= 1)")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def _show(values: Sequence[float], fmt: str) -> str:
    s = spread(values)
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def _ratios(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(mine, theirs, strict=True)]


def main(
    images: int = 1000,
    workers: int = 2,
    batch_size: int = 64,
    runs: int = 3,
    shared: bool = True,
    shared_memory: str = "256M",
) -> None:
    """Make the data once; act 1: one epoch with each loader, `runs` times, compared; act 2
    (unless `shared` is False): three concurrent jobs, independent then through one server,
    `runs` times; act 3: three jobs over shards in a local S3 server, without and with the
    machine-wide cache (skipped with a note when moto is not installed)."""
    check_int(runs, "demo: runs", 1)
    root = demo_images(images)
    print(f"dataset: {images} synthetic JPEGs (500x375) in {root}")
    print(
        "work per sample: decode + random resized crop 224 + flip + normalize; "
        f"batch {batch_size}, {workers} workers; a stand-in step reads every batch; {runs} run(s) of each\n"
    )
    loaders: list[tuple[str, Callable[..., dict[str, float]]]] = [("globalloader", run_globalloader)]
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401 - only to know whether the comparison can run

        loaders.append(("torch DataLoader", run_torch))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in loaders}
    for run in range(runs):
        for name, fn in loaders:
            results[name].append(fn(root, workers, batch_size, epoch=run))
    print(f"median (min-max) of {runs} run(s)")
    print(f"{'loader':<18}{'samples/s':>22}{'epoch s':>20}{'first batch s':>24}")
    for name, rows in results.items():
        print(
            f"{name:<18}{_show([r['samples_per_s'] for r in rows], '{:.1f}'):>22}"
            f"{_show([r['seconds'] for r in rows], '{:.2f}'):>20}"
            f"{_show([r['first_batch_s'] for r in rows], '{:.3f}'):>24}"
        )
    if len(loaders) == 1:
        print("\n(torch is not installed: pip install 'globalloader[torch]' to compare)")
    else:
        ratio = spread(_ratios(results["globalloader"], results["torch DataLoader"], "samples_per_s"))
        print(
            f"\ngloballoader / torch DataLoader: {ratio['median']:.2f}x samples/s (median of {runs} paired "
            f"runs; min {ratio['min']:.2f}x, max {ratio['max']:.2f}x)"
        )
    if shared:
        act_two(root, images, workers, shared_memory, runs)
    act_three(images, workers, runs)


def act_two(
    root: Path | str, images: int, workers: int = 2, memory: str | int = "256M", runs: int = 3, progress: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Three jobs with overlapping sets at different speeds, run independently then through one
    server, `runs` times; prints both side by side and returns the summaries of every run."""
    specs = [
        JobSpec("A", tuple(range(images))),
        JobSpec("B", tuple(range(images * 7 // 10)), sleep=0.01),
        JobSpec("C", tuple(range(images - images * 6 // 10, images)), sleep=0.03),
    ]
    print(
        f"\nact 2: three training jobs at once, each its own process: A all {images} images, "
        f"B the first {len(specs[1].indices)}, C the last {len(specs[2].indices)}; "
        "a step of +0 / +0.01 / +0.03 s per batch"
    )
    print("shared part: decode + resize to 256; each job's own: random crop 224 + flip + normalize, batch 32")
    print(
        f"independent: {workers} workers per job; shared: one server with {3 * workers} decode workers "
        f"and a {memory} pool, the jobs crop in their own process; {runs} run(s) of each\n"
    )
    alone: list[dict[str, Any]] = []
    together: list[dict[str, Any]] = []
    for _ in range(runs):
        alone.append(run_jobs(root, specs, "independent", workers=workers, progress=progress))
        together.append(run_jobs(root, specs, "shared", workers=workers, memory=memory, progress=progress))
    print(f"median (min-max) of {runs} run(s)")
    print(f"{'':<22}{'independent':>24}{'shared':>24}")
    for label, fmt, key in (
        ("decodes", "{:.0f}", "decodes"),
        ("wall time s", "{:.2f}", "wall_s"),
        ("samples/s (all jobs)", "{:.1f}", "samples_per_s"),
    ):
        print(f"{label:<22}{_show([r[key] for r in alone], fmt):>24}{_show([r[key] for r in together], fmt):>24}")
    for j, spec in enumerate(specs):
        followed = [r["jobs"][j]["followed_share"] for r in together]
        note = "" if None in followed else f"   followed {_show([100 * f for f in followed], '{:.0f}%')} of its samples"
        mine = _show([r["jobs"][j]["samples_per_s"] for r in alone], "{:.1f}")
        theirs = _show([r["jobs"][j]["samples_per_s"] for r in together], "{:.1f}")
        print(f"{'job ' + spec.name + ' samples/s':<22}{mine:>24}{theirs:>24}{note}")
    saved = spread([a["decodes"] - s["decodes"] for a, s in zip(alone, together, strict=True)])
    time_ratio = spread(_ratios(together, alone, "wall_s"))
    print(
        f"\nshared: {saved['median']:.0f} decodes saved (median; {saved['median'] / alone[0]['decodes']:.0%}; "
        f"|union of the sets| = {together[0]['union']}), all jobs done in {time_ratio['median']:.2f}x the time "
        f"(median of {runs} paired runs; min {time_ratio['min']:.2f}x, max {time_ratio['max']:.2f}x)"
    )
    return alone, together
