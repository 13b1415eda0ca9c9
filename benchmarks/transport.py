"""Benchmark: moving 150 KB samples from a worker process to the consumer.

Compares, in the same run and with the same batches:
  shm    globalloader.transport.segments: the worker writes each batch into a reused shared-memory
         segment and sends a small message over a multiprocessing Pipe; the consumer rebuilds the
         batch as views, drops it, and the released segment names go back with the next request.
  queue  the baseline: the batch pickled through a multiprocessing.Queue (how a torch DataLoader
         moves NumPy batches from its workers).
Both keep `prefetch` batches in flight. A sample is a uint8 224x224x3 image (147 KiB) plus a
label and a key; batches are collated (a 4-d image array). Reports microseconds per sample
(median of the timed windows), the ratio queue/shm and whether the target is met. Run it on a
quiet machine: with batches of 1 the cost is mostly pipe round trips and process wake-ups,
which other load on the cores inflates.

    python benchmarks/transport.py [--samples 2048] [--repeats 5] [--batch-sizes 64 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from globalloader.transport.names import remove_leftovers
from globalloader.transport.segments import BatchReader, BatchWriter

SAMPLE_SHAPE = (224, 224, 3)
TARGET_US_PER_SAMPLE = 40.0
RESULTS = Path(__file__).resolve().parent / "results" / "transport.json"


def make_batch(batch_size: int, seq: int = 0) -> dict[str, Any]:
    """A collated batch of `batch_size` samples; the last image byte is 7, for a sanity check."""
    rng = np.random.default_rng(batch_size)
    image = rng.integers(0, 256, size=(batch_size, *SAMPLE_SHAPE), dtype=np.uint8)
    image.flat[-1] = 7
    return {
        "image": image,
        "label": np.arange(batch_size, dtype=np.int64),
        "key": [f"sample-{i:06d}" for i in range(batch_size)],
        "seq": seq,
    }


def _check(batch: dict[str, Any], seq: int) -> None:
    if batch["seq"] != seq or batch["image"].flat[-1] != 7:
        raise RuntimeError(f"batch {seq}: wrong or corrupted batch received")


def _shm_worker(conn: Any, prefix: str, batch_size: int) -> None:
    """Answer each request (the names released since the last one) with one batch message."""
    writer = BatchWriter(prefix)
    batch = make_batch(batch_size)
    seq = 0
    try:
        while True:
            released = conn.recv()
            if released is None:
                return
            writer.free(released)
            batch["seq"] = seq
            conn.send(writer.write(batch))
            seq += 1
    finally:
        writer.close()


def _queue_worker(queue: Any, batch_size: int, count: int) -> None:
    """Put `count` batches; each is a new dict because the queue pickles it later, in a thread."""
    batch = make_batch(batch_size)
    for seq in range(count):
        queue.put({**batch, "seq": seq})


def _timed_windows(receive: Callable[[int], None], batches: int, warmup: int, repeats: int) -> list[float]:
    """Seconds taken by each of `repeats` windows of `batches` calls to `receive(seq)`."""
    seq = 0
    for _ in range(warmup):
        receive(seq)
        seq += 1
    windows = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batches):
            receive(seq)
            seq += 1
        windows.append(time.perf_counter() - start)
    return windows


def run_shm(ctx: Any, batch_size: int, batches: int, warmup: int, repeats: int, prefetch: int) -> list[float]:
    """Time the shared-memory transport; returns seconds per window."""
    prefix = f"gl-bench-{os.getpid()}-{batch_size}-"
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_shm_worker, args=(child, prefix, batch_size), daemon=True)
    worker.start()
    child.close()
    reader = BatchReader()
    released: list[str] = []
    for _ in range(prefetch):
        parent.send([])

    def receive(seq: int) -> None:
        batch = reader.read(parent.recv(), released.append)
        _check(batch, seq)
        del batch  # the consumer is done: the segment is released here
        names = released[:]
        del released[: len(names)]
        parent.send(names)

    try:
        return _timed_windows(receive, batches, warmup, repeats)
    finally:
        parent.send(None)
        worker.join()
        reader.close()
        leftovers = remove_leftovers(prefix)
        if leftovers:
            raise RuntimeError(f"{leftovers} shared-memory segments left behind by {prefix!r}")


def run_queue(ctx: Any, batch_size: int, batches: int, warmup: int, repeats: int, prefetch: int) -> list[float]:
    """Time the pickled multiprocessing.Queue baseline; returns seconds per window."""
    queue = ctx.Queue(maxsize=prefetch)
    total = warmup + batches * repeats
    worker = ctx.Process(target=_queue_worker, args=(queue, batch_size, total), daemon=True)
    worker.start()

    def receive(seq: int) -> None:
        batch = queue.get()
        _check(batch, seq)

    try:
        return _timed_windows(receive, batches, warmup, repeats)
    finally:
        worker.join()


def measure(batch_size: int, samples: int, repeats: int, prefetch: int, bar: tqdm | None = None) -> dict[str, Any]:
    """Both transports for one batch size, as a result row (us per sample, medians).

    The two alternate, one window each per round, so a load change on a shared machine hits
    both rather than one.
    """
    ctx = mp.get_context("spawn")
    batches = max(1, samples // batch_size)
    warmup = max(2 * prefetch, 256 // batch_size)
    shm: list[float] = []
    queue: list[float] = []
    for _ in range(repeats):
        shm += run_shm(ctx, batch_size, batches, warmup, 1, prefetch)
        queue += run_queue(ctx, batch_size, batches, warmup, 1, prefetch)
        if bar is not None:
            bar.update(1)
    per_sample = batches * batch_size / 1e6
    shm_us = statistics.median(shm) / per_sample
    queue_us = statistics.median(queue) / per_sample
    return {
        "batch_size": batch_size,
        "samples_per_window": batches * batch_size,
        "windows": repeats,
        "shm_us_per_sample": round(shm_us, 2),
        "shm_us_per_sample_windows": [round(w / per_sample, 2) for w in shm],
        "queue_us_per_sample": round(queue_us, 2),
        "queue_us_per_sample_windows": [round(w / per_sample, 2) for w in queue],
        "speedup_vs_queue": round(queue_us / shm_us, 2),
        "target_met": shm_us <= TARGET_US_PER_SAMPLE,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048, help="samples per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="timed windows per transport")
    parser.add_argument("--prefetch", type=int, default=4, help="batches in flight")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    total = len(args.batch_sizes) * args.repeats
    with tqdm(total=total, desc="transport rounds", unit="round") as bar:
        rows = [measure(b, args.samples, args.repeats, args.prefetch, bar) for b in args.batch_sizes]
    report = {
        "benchmark": "transport",
        "sample": {"shape": list(SAMPLE_SHAPE), "dtype": "uint8", "bytes": int(np.prod(SAMPLE_SHAPE))},
        "prefetch": args.prefetch,
        "target_us_per_sample": TARGET_US_PER_SAMPLE,
        "results": rows,
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "platform": sys.platform,
            "start_method": "spawn",
            "load_average_1min_after": round(os.getloadavg()[0], 2),
        },
    }
    for row in rows:
        print(
            f"batch {row['batch_size']:>3}: shm {row['shm_us_per_sample']:8.2f} us/sample, "
            f"queue {row['queue_us_per_sample']:8.2f} us/sample, "
            f"ratio {row['speedup_vs_queue']:.2f}x, "
            f"target <= {TARGET_US_PER_SAMPLE:g} us: {'met' if row['target_met'] else 'NOT met'}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
