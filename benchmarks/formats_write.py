"""Datasets as they are: reading the formats other tools write, and writing shards in parallel.

Each part is a function `bench_<part>(args)` returning its results; `main()` runs the parts named
by `--only` (default: all) and merges each into benchmarks/results/formats.json under its name.

write: `--samples` JPEGs (default 2,000; the issue's full run uses 10,000) from an image folder
(synthetic, made once under `--data`) written as shards of 64 MB, 2 workers, by
- gl: `gl.write_shards(gl.Dataset(gl.ImageFolder(root)), ..., workers=2)` (tar shards and `.idx`);
- litdata: LitData's `optimize(fn, inputs, num_workers=2, chunk_bytes="64MB")`, each input a
  file's bytes and label;
- mds: Mosaic Streaming's `MDSWriter` (`bytes` and `int` columns, `size_limit` 64 MB) in one
  process, as its users write.
The peers run in their own environment (`--peers-python`, default $GLOBALLOADER_PEERS_PYTHON;
see .ci/peers-env), each timed inside its process from before the call to after the last file is
written (interpreter start excluded, the tool's worker start included, as gl's is). The tools
take turns, `--rounds` times, each into a fresh folder; samples/s as the median with min and max,
and paired ratios. Goals: gl >= 1.5x litdata and >= 2x mds.

    python benchmarks/formats.py --only write [--samples 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import globalloader as gl
from globalloader.synthetic import make_jpeg_folder

RESULTS = Path(__file__).parent / "results" / "formats.json"
SHARD_BYTES = 64 << 20
WRITE_GOALS = {"litdata": 1.5, "mds": 2.0}  # gl's samples/s over each peer's, at least

_PEER_WRITERS = {
    "litdata": """
        from litdata import optimize

        def sample(item):
            path, label = item
            with open(path, "rb") as f:
                return {"image": f.read(), "label": label}

        start = time.perf_counter()
        optimize(fn=sample, inputs=items, output_dir=out, num_workers=2, chunk_bytes="64MB")
    """,
    "mds": """
        from streaming import MDSWriter

        start = time.perf_counter()
        with MDSWriter(out=out, columns={"image": "bytes", "label": "int"}, size_limit="64mb") as writer:
            for path, label in items:
                with open(path, "rb") as f:
                    writer.write({"image": f.read(), "label": label})
    """,
}


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _items(root: Path) -> list[tuple[str, int]]:
    """The image folder's files and labels, in ImageFolder's order."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(str(f), label) for label, c in enumerate(classes) for f in sorted((root / c).iterdir())]


def _write_gl(root: Path, out: Path) -> float:
    start = time.perf_counter()
    gl.write_shards(
        gl.Dataset(gl.ImageFolder(root)), out / "shard-%06d.tar", workers=2, maxsize=SHARD_BYTES, progress=False
    )
    return time.perf_counter() - start


def _peer_writer(python: str, tool: str) -> Callable[[Path, Path], float]:
    def run(root: Path, out: Path) -> float:
        work = out.parent / f"{out.name}-script"
        work.mkdir(parents=True)
        (work / "items.json").write_text(json.dumps(_items(root)))
        body = textwrap.dedent(_PEER_WRITERS[tool])
        script = (
            "import json, sys, time\n\n"
            "if __name__ == '__main__':  # LitData's workers import this file again\n"
            "    items = [tuple(item) for item in json.load(open('items.json'))]\n"
            f"    out = {str(out)!r}\n" + textwrap.indent(body, "    ") + "\n"
            "    print(json.dumps({'seconds': time.perf_counter() - start}))\n"
        )
        (work / "write.py").write_text(script)
        done = subprocess.run([python, "write.py"], cwd=work, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])

    return run


def bench_write(args: argparse.Namespace) -> dict[str, Any]:
    root = make_jpeg_folder(args.data / f"jpegs-{args.samples}", args.samples, classes=10, progress=True)
    writers: dict[str, Callable[[Path, Path], float]] = {"gl": _write_gl}
    if args.peers_python:
        writers |= {tool: _peer_writer(args.peers_python, tool) for tool in _PEER_WRITERS}
    else:
        print("no peers' interpreter (--peers-python or $GLOBALLOADER_PEERS_PYTHON): gl alone")
    rates: dict[str, list[float]] = {name: [] for name in writers}
    for round_ in range(args.rounds):
        for name, write in writers.items():
            out = Path(tempfile.mkdtemp(prefix=f"formats-write-{name}-", dir=args.data)) / "out"
            try:
                seconds = write(root, out)
            finally:
                shutil.rmtree(out.parent, ignore_errors=True)
            rates[name].append(args.samples / seconds)
            print(f"write round {round_ + 1}/{args.rounds}: {name:8s} {args.samples / seconds:10,.0f} samples/s")
    result: dict[str, Any] = {
        "samples": args.samples,
        "workers": 2,
        "shard_bytes": SHARD_BYTES,
        "image_bytes": sum(os.path.getsize(path) for path, _ in _items(root)),
        "samples_per_s": {name: summary(values) for name, values in rates.items()},
    }
    ratios = {
        f"gl/{peer}": summary([a / b for a, b in zip(rates["gl"], rates[peer], strict=True)])
        for peer in WRITE_GOALS
        if peer in rates
    }
    result["ratios"] = ratios
    result["goals"] = {
        f"gl/{peer}": {"at_least": goal, "met": ratios[f"gl/{peer}"]["median"] >= goal}
        for peer, goal in WRITE_GOALS.items()
        if f"gl/{peer}" in ratios
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio['median']:.2f}x (min {ratio['min']:.2f}x, max {ratio['max']:.2f}x)")
    return result


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"write": bench_write}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each measurement (median, min, max)")
    parser.add_argument("--samples", type=int, default=2000, help="samples per dataset (the full run: 10000)")
    parser.add_argument(
        "--data",
        type=Path,
        default=Path(tempfile.gettempdir()) / "globalloader-bench-formats",
        help="where the datasets are made once and the outputs written",
    )
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("GLOBALLOADER_PEERS_PYTHON"),
        help="the peers' interpreter (built by .ci/peers-env); default $GLOBALLOADER_PEERS_PYTHON",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON file the parts are merged into")
    args = parser.parse_args()
    parts = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only: unknown parts {unknown}; known: {sorted(PARTS)}")
    args.data.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.output.read_text()) if args.output.exists() else {}
    for part in parts:
        results[part] = {
            **PARTS[part](args),
            "rounds": args.rounds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "globalloader": gl.__version__,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {args.output}")


if __name__ == "__main__":
    main()
