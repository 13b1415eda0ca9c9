"""Shuffling Parquet: sequential read vs exact global shuffle (Arrow copy) vs windowed shuffle.

A Parquet file of `--rows` rows (default 10M) in row groups of `--group` rows (columns: id int64,
x float32, label int32, text str of ~16 chars), generated once into `--data` (default: a folder
under the system's temporary folder; reused by later invocations). Every mode runs one epoch
through `gl.Loader` with `batch(--batch)` and `--workers` worker processes, and the modes take
turns, `--rounds` times:

- sequential: `gl.Dataset(gl.Parquet(f)).batch(n)`, the baseline;
- exact: `gl.Dataset(gl.Parquet(f).local_copy(d)).shuffle(seed).batch(n)`, after the one-time
  copy, whose time is measured separately (`--rounds` fresh copies);
- windowed: `gl.Dataset(gl.Parquet(f)).shuffle(seed, window=--window).batch(n)`;
- naive (context only): the exact shuffle on the Parquet file itself, timed over its first
  `--naive-batches` batches.

Nothing stands between the source and the batch, so these modes' batches are gathered by column
(`read_columns`; the JSON says so per mode). For comparison, `sequential_by_record` reads in order
through a map that changes nothing, which makes the workers build records and collate them.

Targets: exact >= 0.5x and windowed >= 0.8x sequential rows/s (medians). Shuffle quality is
computed in index space on the same layout (no data read) for the exact, windowed (several
windows) and stream buffer shuffles. JSON to benchmarks/results/parquet_shuffle.json (`--output`).

    python benchmarks/parquet_shuffle.py [--rows 10000000] [--rounds 3] [--window 8] [--gather-rows 0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import globalloader as gl
from globalloader.dataset.shuffle import BufferShuffle
from globalloader.sampling.permutation import Permutation

RESULTS = Path(__file__).parent / "results" / "parquet_shuffle.json"
COMPARED = ("sequential_by_record", "exact", "windowed", "naive")  # each against "sequential"


def make_parquet(path: Path, rows: int, group: int) -> None:
    """Write the benchmark file in slices, so memory stays small whatever `rows`."""
    rng = np.random.default_rng(0)
    schema = pa.schema([("id", pa.int64()), ("x", pa.float32()), ("label", pa.int32()), ("text", pa.string())])
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, rows, group):
            ids = np.arange(start, min(start + group, rows))
            text = pa.array([f"sample {i:09d}" for i in ids.tolist()])
            table = pa.table(
                [ids, rng.random(len(ids), dtype=np.float32), rng.integers(0, 1000, len(ids), dtype=np.int32), text],
                schema=schema,
            )
            writer.write_table(table, row_group_size=group)
    tmp.rename(path)


def unchanged(record: dict[str, Any]) -> dict[str, Any]:
    """A map that changes nothing: its chain builds batches from records, as before batches were
    gathered by column."""
    return record


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended children (the Loader's workers, once closed)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def epoch_rows_per_s(ds: gl.Dataset, workers: int, epoch: int, max_batches: int | None = None) -> tuple[float, float]:
    """(rows per second, rows per CPU second) of one epoch (or its first `max_batches`), workers'
    start and stop included. The second counts the loader process and its workers; on a machine
    shared with other work it is the steadier measure of what each shuffle costs."""
    rows = 0
    cpu0, t0 = _cpu_s(), time.perf_counter()
    with gl.Loader(ds, workers=workers) as loader:
        loader.set_epoch(epoch)
        for batch in itertools.islice(loader, max_batches):
            rows += len(batch["id"])
    return rows / (time.perf_counter() - t0), rows / (_cpu_s() - cpu0)


# -- shuffle quality, in index space ------------------------------------------------------------------


def quality(order: np.ndarray, n: int, group: int, batch: int) -> dict[str, float]:
    """How random an order looks from the trainer's side.

    position_correlation: Pearson correlation of output position and source row (0: no trend).
    mean_displacement: mean |source row - output position| / n (1/3 for a uniform shuffle).
    groups_per_batch: distinct row groups among a batch's rows (mean over batches).
    same_group_pairs: chance that two rows of one batch come from the same row group.
    """
    m = len(order)
    position = np.arange(m, dtype=np.float64)
    source = order.astype(np.float64)
    batches = order[: m - m % batch].reshape(-1, batch) // group
    distinct, pairs = [], []
    for row in batches:
        counts = np.unique(row, return_counts=True)[1]
        distinct.append(len(counts))
        pairs.append(float((counts * (counts - 1)).sum()) / (batch * (batch - 1)))
    return {
        "position_correlation": float(np.corrcoef(position, source)[0, 1]),
        "mean_displacement": float(np.abs(source - position).mean() / n),
        "groups_per_batch": float(np.mean(distinct)),
        "same_group_pairs": float(np.mean(pairs)),
        "rows_measured": m,
    }


def quality_table(src: gl.Parquet, group: int, batch: int, windows: list[int], buffers: list[int]) -> dict[str, Any]:
    n = len(src)
    out: dict[str, Any] = {"exact": quality(Permutation(n, 0, 0).array(), n, group, batch)}
    for w in windows:
        out[f"window={w}"] = quality(gl.Dataset(src).shuffle(seed=0, window=w).plan.indices(0), n, group, batch)
    head = min(n, 2_000_000)  # the buffer shuffle runs record by record in Python: its first rows only
    for size in buffers:
        shuffled = BufferShuffle(size, 0).apply(iter(range(n)), 0, n)
        out[f"buffer={size}"] = quality(np.fromiter(itertools.islice(shuffled, head), np.int64, head), n, group, batch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--group", type=int, default=20_000, help="rows per row group")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--window", type=int, default=8, help="row groups per window of the windowed shuffle")
    parser.add_argument("--naive-batches", type=int, default=6)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--gather-rows",
        type=int,
        default=None,
        help="rows a worker may gather at once (Parquet.gather_rows; 0: one batch per gather; default: the source's)",
    )
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "globalloader-bench-parquet")
    args = parser.parse_args()

    args.data.mkdir(parents=True, exist_ok=True)
    path = args.data / f"rows{args.rows}-group{args.group}.parquet"
    if not path.exists():
        t0 = time.perf_counter()
        make_parquet(path, args.rows, args.group)
        print(f"generated {path} in {time.perf_counter() - t0:.1f} s")
    print(f"data: {path} ({path.stat().st_size / 1e6:.0f} MB)")
    src = gl.Parquet(str(path))
    copies = args.data / "copies"

    copy_s = []
    for _ in range(args.rounds):
        shutil.rmtree(copies, ignore_errors=True)
        t0 = time.perf_counter()
        copy = src.local_copy(copies, progress=False)
        copy_s.append(time.perf_counter() - t0)
        assert copy.built
        print(f"copy built in {copy_s[-1]:.1f} s: {copy.path} ({copy.path.stat().st_size / 1e6:.0f} MB)", flush=True)

    def parquet() -> gl.Parquet:  # a source each: the windowed shuffle grows its source's row-group cache
        source = gl.Parquet(str(path))
        if args.gather_rows is not None:
            source.gather_rows = args.gather_rows
        return source

    modes = {
        "sequential": gl.Dataset(parquet()).batch(args.batch),
        "sequential_by_record": gl.Dataset(parquet()).map(unchanged).batch(args.batch),
        "exact": gl.Dataset(parquet().local_copy(copies)).shuffle(seed=0).batch(args.batch),
        "windowed": gl.Dataset(parquet()).shuffle(seed=0, window=args.window).batch(args.batch),
    }
    runs: dict[str, list[float]] = {name: [] for name in (*modes, "naive")}
    cpu_runs: dict[str, list[float]] = {name: [] for name in (*modes, "naive")}
    for round_ in range(args.rounds):
        with warnings.catch_warnings():  # the warning this chain earns is the point of the comparison
            warnings.simplefilter("ignore")
            naive = gl.Dataset(gl.Parquet(str(path))).shuffle(seed=0).batch(args.batch)
        for name, ds in (*modes.items(), ("naive", naive)):
            batches = args.naive_batches if name == "naive" else None
            rate, cpu_rate = epoch_rows_per_s(ds, args.workers, round_, batches)
            runs[name].append(rate)
            cpu_runs[name].append(cpu_rate)
            print(f"round {round_} {name:<10} {rate:12,.0f} rows/s {cpu_rate:12,.0f} rows/CPU-s", flush=True)

    median = {name: statistics.median(values) for name, values in runs.items()}
    cpu_median = {name: statistics.median(values) for name, values in cpu_runs.items()}
    ratio = {name: median[name] / median["sequential"] for name in COMPARED}
    cpu_ratio = {name: cpu_median[name] / cpu_median["sequential"] for name in COMPARED}
    # Each round's ratio against that round's sequential run: load from other work that drifts
    # between rounds cancels within one.
    paired = {name: sorted(r / s for r, s in zip(runs[name], runs["sequential"], strict=True)) for name in COMPARED}
    t0 = time.perf_counter()
    shuffle_quality = quality_table(src, args.group, args.batch, [1, 4, args.window, 32], [10_000, 100_000])
    print(f"quality measured in {time.perf_counter() - t0:.1f} s")
    for name, q in shuffle_quality.items():
        print(f"  {name:<14} " + "  ".join(f"{k}={v:.4g}" for k, v in q.items()))
    summary = {
        "benchmark": "parquet_shuffle",
        "data": str(path),
        "rows": args.rows,
        "rows_per_group": args.group,
        "columns": "id int64, x float32, label int32, text str (16 chars)",
        "parquet_mb": path.stat().st_size / 1e6,
        "copy_mb": copy.path.stat().st_size / 1e6,
        "batch": args.batch,
        "workers": args.workers,
        "window": args.window,
        "gather_rows": modes["sequential"].plan.source.gather_rows,
        "rounds": args.rounds,
        "copy_seconds": {"median": statistics.median(copy_s), "min_max": [min(copy_s), max(copy_s)], "runs": copy_s},
        "median_rows_per_s": median,
        "min_max_rows_per_s": {name: [min(v), max(v)] for name, v in runs.items()},
        "ratio_vs_sequential": ratio,
        "paired_ratio_vs_sequential": {
            name: {"median": statistics.median(v), "min_max": [v[0], v[-1]]} for name, v in paired.items()
        },
        "median_rows_per_cpu_s": cpu_median,
        "min_max_rows_per_cpu_s": {name: [min(v), max(v)] for name, v in cpu_runs.items()},
        "cpu_ratio_vs_sequential": cpu_ratio,
        "targets": {"exact >= 0.5x": ratio["exact"] >= 0.5, "windowed >= 0.8x": ratio["windowed"] >= 0.8},
        "targets_per_cpu_s": {
            "exact >= 0.5x": cpu_ratio["exact"] >= 0.5,
            "windowed >= 0.8x": cpu_ratio["windowed"] >= 0.8,
        },
        "gathered_by_column": {name: ds.plan.columnar for name, ds in modes.items()},
        "shuffle_quality": shuffle_quality,
        "note": (
            "modes take turns in each round (drift hits all alike); each run is a fresh Loader, one full epoch, "
            f"except naive: the first {args.naive_batches} batches of an exact shuffle read from Parquet directly; "
            "buffer shuffle quality over its first 2M outputs"
        ),
        "runs": runs,
        "cpu_runs": cpu_runs,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "pyarrow": pa.__version__},
    }
    for name, r in ratio.items():
        print(
            f"{name}: {median[name]:,.0f} rows/s = {r:.2f}x sequential ({median['sequential']:,.0f} rows/s); "
            f"per CPU second {cpu_ratio[name]:.2f}x; median of per-round ratios {statistics.median(paired[name]):.2f}x"
        )
    args.output.parent.mkdir(exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
