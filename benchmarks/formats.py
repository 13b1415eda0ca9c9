"""Your data as it is: globalloader reading other tools' formats vs those tools' own loaders.

Each part is a function `bench_<part>(args)` returning its summary; `main()` runs the parts named by
`--only` and keeps each part's summary under its name in benchmarks/results/formats.json (parts
not run keep their last results).

- `mds`: warm reading of a Mosaic Streaming dataset (`--samples` synthetic 500x375 JPEGs of
  quality 90 + an int label, written by Mosaic's own `MDSWriter` in shards of about 8 MB),
  shuffled, with a JPEG decode + random resized crop to 224 + flip + normalize per sample, batch
  64, 2 workers, a stand-in step that reads every batch: `gl.MDS` in `gl.Loader(workers=2)` with
  `globalloader.vision.RandomResizedCropFlipNormalize` against Mosaic's `StreamingDataset(local=,
  shuffle=True)` in torch's `DataLoader(num_workers=2)` with the usual Pillow + NumPy code on the
  PIL image Mosaic decodes (torchvision's crop box, one bilinear resize of it, flip, normalize;
  torchvision itself does not load beside the CPU torch wheel there). Mosaic runs in the peers'
  environment (`GLOBALLOADER_PEERS_PYTHON`, built by .ci/peers-env), in a subprocess. One untimed
  epoch warms the page cache, then `--rounds` (3) timed epochs each, the two systems taking turns;
  medians with min and max, and the ratio (goal: >= 1.3x).
- `mds-s3`: the same, cold, the dataset in a local S3 server (moto, loopback) behind a proxy adding
  `--latency` (0.02 s) per request (`globalloader.demo.s3`): each epoch starts with an empty cache
  (gl: a fresh machine cache folder; Mosaic: a fresh `local=` folder) and is timed from the
  construction of the source; `gl.MDS("s3://...")` against `StreamingDataset(remote="s3://...")`.

    python benchmarks/formats.py [--only mds,mds-s3] [--rounds 3] [--samples 5000] [--latency 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import globalloader as gl
from globalloader import demo, storage, vision

RESULTS = Path(__file__).parent / "results" / "formats.json"
BATCH, WORKERS, SIZE = 64, 2, 224
PEERS_ENV = "GLOBALLOADER_PEERS_PYTHON"

_MOSAIC_WRITE = """
import json, sys
from pathlib import Path
from streaming import MDSWriter

folder, out = Path(sys.argv[2]), sys.argv[3]
files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[: int(sys.argv[4])]
with MDSWriter(out=out, columns={"image": "jpeg", "label": "int"}, size_limit=8 << 20) as writer:
    for i, path in enumerate(files):
        writer.write({"image": path.read_bytes(), "label": i % 100})
"""

_MOSAIC_READ = """
import json, math, random, sys, time
import numpy as np
import torch
from PIL import Image
from streaming import StreamingDataset

folder, remote = sys.argv[2], sys.argv[6]
rounds, batch, workers = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
MEAN, STD = np.float32([0.485, 0.456, 0.406]) * 255, np.float32([0.229, 0.224, 0.225]) * 255

def augment(image):
    # torchvision's RandomResizedCrop box, one bilinear resize of it, a flip, normalize
    width, height = image.size
    for _ in range(10):
        area = width * height * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = random.randint(0, width - w), random.randint(0, height - h)
            break
    else:
        left, top, w, h = 0, 0, width, height
    image = image.convert("RGB").resize((224, 224), Image.BILINEAR, box=(left, top, left + w, top + h))
    if random.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    return torch.from_numpy((np.asarray(image, np.float32) - MEAN) / STD)

class Augmented(StreamingDataset):
    def __getitem__(self, index):
        sample = super().__getitem__(index)
        return {"image": augment(sample["image"]), "label": sample["label"]}

def epoch(seed):
    start = time.perf_counter()
    if remote:  # cold: a fresh local folder each epoch
        local = f"{folder}-{seed}"
        data = Augmented(remote=remote, local=local, shuffle=True, shuffle_seed=seed, batch_size=batch)
    else:
        data = Augmented(local=folder, shuffle=True, shuffle_seed=seed, batch_size=batch)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, num_workers=workers)
    samples = 0
    for out in loader:
        float(out["image"].mean())
        samples += len(out["label"])
    return {"samples": samples, "seconds": time.perf_counter() - start}

if not remote:
    epoch(1000)  # warm
runs = [epoch(seed) for seed in range(rounds)]
print(json.dumps(runs))
"""


def _peers_python() -> str:
    python = os.environ.get(PEERS_ENV)
    if not python:
        sys.exit(f"{PEERS_ENV} is not set: build the peers' environment with .ci/peers-env and point it there")
    return python


def _peer(script: str, *args: Any, env: dict[str, str] | None = None) -> str:
    """Run a script in the peers' environment (a file: Mosaic's workers re-import the main module)."""
    with tempfile.TemporaryDirectory(prefix="gl-bench-peer-") as tmp:
        path = Path(tmp) / "peer.py"
        path.write_text(script)
        done = subprocess.run(
            [_peers_python(), str(path), *map(str, args)],
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp,
            env={**os.environ, **(env or {})},
        )
    if done.returncode:
        sys.exit(f"peer script failed:\n{done.stderr[-8000:]}")
    return done.stdout


def _gl_epoch(chain: gl.Dataset, seed: int) -> dict[str, float]:
    start = time.perf_counter()
    samples = 0
    with gl.Loader(chain, workers=WORKERS, prefetch=2 * WORKERS) as loader:
        loader.set_epoch(seed)
        for batch in loader:
            float(batch["image"].mean())
            samples += len(batch["label"])
    return {"samples": samples, "seconds": time.perf_counter() - start}


def _summary(runs: dict[str, list[dict[str, float]]], ours: str, theirs: str, goal: float) -> dict[str, Any]:
    rates = {name: [r["samples"] / r["seconds"] for r in rs] for name, rs in runs.items()}
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = median[ours] / median[theirs]
    return {
        "median_samples_per_s": median,
        "min_max_samples_per_s": {name: [min(v), max(v)] for name, v in rates.items()},
        "ratio": ratio,
        "goal": f"{ours} >= {goal}x {theirs}",
        "met": ratio >= goal,
        "runs": runs,
    }


def _mds_dataset(samples: int) -> Path:
    """The demo's JPEGs in an MDS dataset written by Mosaic's MDSWriter (made once)."""
    folder = Path(tempfile.gettempdir()) / f"gl-bench-mds-{samples}"
    if not (folder / "index.json").exists():
        _peer(_MOSAIC_WRITE, "write", demo.demo_images(samples), folder, samples)
    return folder


def _chain(source: gl.MDS) -> gl.Dataset:
    return (
        gl.Dataset(source)
        .shuffle(seed=0)
        .map(vision.RandomResizedCropFlipNormalize(field="image", size=SIZE), name="decode+crop")
        .batch(BATCH)
    )


def bench_read_mds(args: argparse.Namespace) -> dict[str, Any]:
    """gl.MDS in gl.Loader vs Mosaic's StreamingDataset in torch's DataLoader, warm, 2 workers."""
    folder = _mds_dataset(args.samples)
    source = gl.MDS(folder)
    chain = _chain(source)
    _gl_epoch(chain, 1000)  # warm
    runs: dict[str, list[dict[str, float]]] = {"gl": [], "mosaic": []}
    for round_ in range(args.rounds):
        runs["gl"].append(_gl_epoch(chain, round_))
        print(f"round {round_} gl     {runs['gl'][-1]['samples'] / runs['gl'][-1]['seconds']:8.1f} samples/s")
        # Mosaic's rounds in one process after its own warm epoch: its start-up (imports) is not timed.
        runs["mosaic"].extend(json.loads(_peer(_MOSAIC_READ, "read", folder, 1, BATCH, WORKERS, "")))
        print(f"round {round_} mosaic {runs['mosaic'][-1]['samples'] / runs['mosaic'][-1]['seconds']:8.1f} samples/s")
    return {
        "workload": "warm epoch, shuffled; JPEG decode + random resized crop 224 + flip + normalize per sample; "
        f"batch {BATCH}, {WORKERS} workers, a stand-in step reads every batch",
        "samples": len(source),
        "shards": len(source.shards),
        "image_size": [500, 375],
        **_summary(runs, "gl", "mosaic", 1.3),
    }


def bench_read_mds_s3(args: argparse.Namespace) -> dict[str, Any]:
    """The same as `bench_read_mds`, cold, from S3 (moto) at `--latency` seconds per request."""
    from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

    folder = _mds_dataset(args.samples)
    server = MotoServer()
    proxy = FaultProxy(server.port)
    try:
        bucket = new_bucket(proxy.url)
        store = storage.Store(options(proxy.url))
        for file in folder.iterdir():
            with store.open_write(f"s3://{bucket}/mds/{file.name}") as out:
                out.write(file.read_bytes())
        proxy.latency = args.latency
        url = f"s3://{bucket}/mds"
        peer_env = {"S3_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        runs: dict[str, list[dict[str, float]]] = {"gl": [], "mosaic": []}
        with tempfile.TemporaryDirectory(prefix="gl-bench-mds-s3-") as tmp:
            for round_ in range(args.rounds):
                os.environ["GLOBALLOADER_CACHE_DIR"] = f"{tmp}/gl-{round_}"  # an empty machine cache
                start = time.perf_counter()
                result = _gl_epoch(_chain(gl.MDS(url, storage_options=options(proxy.url))), round_)
                runs["gl"].append({**result, "seconds": time.perf_counter() - start})
                print(f"round {round_} gl     {result['samples'] / runs['gl'][-1]['seconds']:8.1f} samples/s (cold)")
                printed = _peer(_MOSAIC_READ, "read", f"{tmp}/mosaic-{round_}", 1, BATCH, WORKERS, url, env=peer_env)
                runs["mosaic"].extend(json.loads(printed))
                rate = runs["mosaic"][-1]["samples"] / runs["mosaic"][-1]["seconds"]
                print(f"round {round_} mosaic {rate:8.1f} samples/s (cold)")
    finally:
        proxy.stop()
        server.stop()
    return {
        "workload": f"cold epoch from S3 (moto) at {args.latency} s per request, timed from the source's "
        "construction; shuffled; JPEG decode + random resized crop 224 + flip + normalize per sample; "
        f"batch {BATCH}, {WORKERS} workers",
        "samples": args.samples,
        "latency_s": args.latency,
        **_summary(runs, "gl", "mosaic", 1.3),
    }


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "mds": bench_read_mds,
    "mds-s3": bench_read_mds_s3,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added per S3 request (mds-s3)")
    args = parser.parse_args()
    chosen = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for part in chosen:
        summary = PARTS[part](args)
        summary["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "rounds": args.rounds}
        results[part] = summary
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
