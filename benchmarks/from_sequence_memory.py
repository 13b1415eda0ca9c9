"""What a list of a million path strings costs forked workers in private memory, for one pass.

Reading an item of a Python list writes its reference count, so each forked worker copies every
page of the list it reads (PyTorch issue 13246): its private memory (USS) grows with the list,
and again with every worker. `gl.from_sequence` keeps a list of str, bytes or numbers in flat
buffers the workers read without writing. Three loaders over the same `--items` path strings,
`--workers` forked workers, batches of `--batch-size`, each in a fresh process, taking turns for
`--rounds` rounds:

  gl             gl.Loader over gl.Dataset(gl.from_sequence(paths))
  gl_list        gl.Loader over gl.Dataset(paths): the bare list, as torch has it
  torch          torch.utils.data.DataLoader over a Dataset returning paths[i]

After one whole pass, with the workers still alive (persistent), the sum of the workers' USS
(psutil if installed, else Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) is read.
The ratio gl / torch (medians of this run) is the figure; the goal is <= 0.25. JSON to
benchmarks/results/from_sequence_memory.json.

    python benchmarks/from_sequence_memory.py [--items 1000000] [--workers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "from_sequence_memory.json"
CONTENDERS = ("gl", "gl_list", "torch")
TARGET_RATIO = 0.25  # gl's workers' USS / torch's


def paths(n: int) -> list[str]:
    """`n` ImageNet-like file paths, about 50 characters each."""
    return [f"/data/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG" for i in range(n)]


def uss_bytes(pid: int) -> int:
    """Memory only this process holds: what it would give back if it exited."""
    try:
        import psutil
    except ImportError:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            fields = dict(line.split(":", 1) for line in rollup if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))
    return int(psutil.Process(pid).memory_full_info().uss)


def children() -> set[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(pid) for pid in f.read().split()}


class _Paths:
    """A torch map-style dataset over the list, as users write it."""

    def __init__(self, items: list[str]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> str:
        return self.items[i]


def workers_uss(contender: str, n: int, workers: int, batch_size: int) -> dict[str, Any]:
    """Run in a fresh process: one pass of `contender` over `n` paths; its workers' USS after it."""
    items = paths(n)
    before = children()
    if contender == "torch":
        import torch

        loader: Any = torch.utils.data.DataLoader(
            _Paths(items),
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=True,
            multiprocessing_context="fork",
        )
    else:
        import globalloader as gl

        source = gl.from_sequence(items) if contender == "gl" else items
        loader = gl.Loader(gl.Dataset(source).batch(batch_size), workers=workers, start_method="fork")
    seen = sum(len(batch) for batch in loader)
    assert seen == n, (contender, seen, n)
    pids = sorted(children() - before)
    assert len(pids) == workers, (contender, pids)
    result = {"uss_mb": sum(uss_bytes(pid) for pid in pids) / 1e6, "workers": len(pids)}
    if contender != "torch":
        loader.close()
    return result


def _report(conn: Any, *args: Any) -> None:
    conn.send(workers_uss(*args))


def in_fresh_process(context: Any, *args: Any) -> float:
    """`workers_uss(*args)` in a new interpreter (not a pool's: those may not have children)."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_report, args=(send, *args))
    process.start()
    send.close()
    result = receive.recv()
    process.join()
    return float(result["uss_mb"])


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    spawn = multiprocessing.get_context("spawn")
    for r in range(args.rounds):
        for contender in CONTENDERS:
            runs[contender].append(in_fresh_process(spawn, contender, args.items, args.workers, args.batch_size))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{c} {v[-1]:.1f} MB" for c, v in runs.items()))
    result: dict[str, Any] = {c: summary(v) for c, v in runs.items()}
    result["runs_mb"] = runs
    result["ratio_gl_to_torch"] = result["gl"]["median"] / result["torch"]["median"]
    result["ratio_gl_list_to_torch"] = result["gl_list"]["median"] / result["torch"]["median"]
    result["target_ratio"] = TARGET_RATIO
    result["params"] = {k: v for k, v in vars(args).items() if k != "output"} | {"cpus": os.cpu_count()}
    result["params"]["python"] = platform.python_version()
    for contender in CONTENDERS:
        s = result[contender]
        print(f"{contender:8s} workers' USS {s['median']:7.1f} MB  [{s['min']:.1f}, {s['max']:.1f}]")
    print(
        f"gl / torch: {result['ratio_gl_to_torch']:.3f} (goal <= {TARGET_RATIO}); "
        f"gl over the bare list / torch: {result['ratio_gl_list_to_torch']:.2f}"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
