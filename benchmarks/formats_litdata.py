"""Reading datasets in the formats other tools wrote: globalloader against each format's own loader.

litdata: `--samples` synthetic 500x375 JPEGs (quality 90) written by LitData's own `optimize`
(64 MB chunks, the JPEG kept as its file's bytes). Per sample: JPEG decode + random resized crop
to 224 + flip + normalize; batches of 64; 2 worker processes; warm (the files in the page cache,
one epoch read before the timed ones). Contestants, run in turns for `--rounds` rounds:
- gl: `gl.LitData` in `gl.Loader(workers=2)`, `vision.RandomResizedCropFlipNormalize`;
- litdata: `litdata.StreamingDataset` + `StreamingDataLoader(num_workers=2)` in the peers'
  environment ($GLOBALLOADER_PEERS_PYTHON, a subprocess), decoding with Pillow (its image decoder
  needs torchvision) and the same crop with Pillow and NumPy.
Reported: median samples/s with min/max, and the ratio gl / litdata (median of the rounds).
JSON: benchmarks/results/formats.json, one key per part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import globalloader as gl
from globalloader import synthetic, vision

RESULTS = Path(__file__).parent / "results" / "formats.json"
BATCH = 64

# Run by the peers' interpreter: argv = mode ("write" or "read"), the image list or dataset, rounds.
_LITDATA_PEER = """
import io, json, sys, time
import numpy as np
from PIL import Image

def open_jpeg(path):
    return {"image": Image.open(path), "label": int(path.split("class_")[1][:2])}

def crop(data, rng):
    image = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = image.size
    area = w * h * rng.uniform(0.08, 1.0)
    ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw, ch = min(w, int(round((area * ratio) ** 0.5))), min(h, int(round((area / ratio) ** 0.5)))
    x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
    out = image.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return (np.asarray(out, np.float32) / 255 - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)

if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "write":
        from litdata import optimize
        paths = json.load(open(sys.argv[3]))
        optimize(fn=open_jpeg, inputs=paths, output_dir=where, chunk_bytes="64MB", num_workers=2)
        sys.exit(0)
    import torch
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming.serializers import BytesSerializer

    class Cropped(StreamingDataset):
        def __getitem__(self, index):
            record = super().__getitem__(index)
            rng = np.random.default_rng(getattr(index, "index", index))
            return {"image": torch.from_numpy(crop(bytes(record["image"]), rng)), "label": record["label"]}

    ds = Cropped(where, shuffle=True, serializers={"jpeg": BytesSerializer()})
    loader = StreamingDataLoader(ds, batch_size=64, num_workers=2)
    rates = []
    for epoch in range(int(sys.argv[3]) + 1):
        start, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch["label"])
        if epoch:  # the first epoch warms the page cache and the workers
            rates.append(n / (time.perf_counter() - start))
    print(json.dumps(rates))
"""


def _peers_python() -> str:
    python = os.environ.get("GLOBALLOADER_PEERS_PYTHON")
    if not python:
        sys.exit("set GLOBALLOADER_PEERS_PYTHON to the peers' interpreter (bash .ci/peers-env <folder>)")
    return python


def _run_peer(script: Path, *args: str) -> str:
    done = subprocess.run([_peers_python(), str(script), *args], capture_output=True, text=True, cwd=script.parent)
    if done.returncode:
        sys.exit(f"the LitData peer failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _gl_rates(root: Path, rounds: int) -> list[float]:
    ds = gl.Dataset(gl.LitData(root)).shuffle(seed=0).map(vision.RandomResizedCropFlipNormalize(size=224)).batch(BATCH)
    rates = []
    with gl.Loader(ds, workers=2) as loader:
        for epoch in range(rounds + 1):
            start, n = time.perf_counter(), 0
            for batch in loader:
                n += len(batch["label"])
            if epoch:  # the first epoch warms the page cache and the workers
                rates.append(n / (time.perf_counter() - start))
    return rates


def _summary(rates: list[float]) -> dict[str, float]:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def bench_read_litdata(args: argparse.Namespace) -> dict[str, Any]:
    """gl.LitData vs LitData's own loader over the same optimized JPEG dataset (see the docstring)."""
    work = Path(args.workdir)
    images = synthetic.make_jpeg_folder(work / f"jpegs-{args.samples}", n=args.samples, progress=False)
    root = work / f"litdata-{args.samples}"
    script = work / "litdata_peer.py"
    script.write_text(_LITDATA_PEER)
    if not (root / "index.json").exists():
        listing = work / "jpegs.json"
        listing.write_text(json.dumps(sorted(str(p) for p in images.rglob("*.jpg"))))
        _run_peer(script, "write", str(root), str(listing))
    gl_rates, peer_rates = [], []
    for _ in range(args.rounds):  # in turns, so drift on a shared machine hits both alike
        gl_rates += _gl_rates(root, 1)
        peer_rates += json.loads(_run_peer(script, "read", str(root), "1").strip().splitlines()[-1])
    ratios = [g / p for g, p in zip(gl_rates, peer_rates, strict=True)]
    return {
        "samples": args.samples,
        "workers": 2,
        "gl_samples_per_s": _summary(gl_rates),
        "litdata_samples_per_s": _summary(peer_rates),
        "ratio_gl_over_litdata": _summary(ratios),
        "goal": 1.3,
    }


PARTS = {"litdata": bench_read_litdata}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {','.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "gl-bench-formats"))
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for part in args.only.split(","):
        if part not in PARTS:
            sys.exit(f"unknown part {part!r}; parts: {', '.join(PARTS)}")
        results[part] = PARTS[part](args)
        print(part, json.dumps(results[part], indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
