"""Reading data as it is: globalloader's readers of other tools' formats vs those tools' own loaders.

Each part is a function `bench_read_<part>(args)` returning its results; `main()` runs the parts
named by `--only` (default all) and writes each under its key in benchmarks/results/formats.json,
keeping the other parts' results there.

- hf: a Hugging Face dataset written by `datasets` itself (`save_to_disk`, `--samples` photo-like
  500x375 JPEGs from `globalloader.synthetic`, quality 90, and int labels), read warm (one epoch
  read first, untimed) by 2 workers, each sample JPEG-decoded and random-resized-cropped to 224
  (with flip and normalize): `gl.HFDataset` in `gl.Loader(workers=2)` with
  `vision.RandomResizedCropFlipNormalize`, vs `datasets` (`load_from_disk`, its Image feature
  decoding with Pillow) in a torch `DataLoader(num_workers=2)` with the same augmentation written
  with Pillow and NumPy, run in the peers' environment (`GLOBALLOADER_PEERS_PYTHON`, built by
  `.ci/peers-env`). Both shuffle, batch 64, workers started inside the timed epoch; the rounds
  alternate the two. Reported: samples/s per round (median, min, max) and the ratio of medians.
  Also samples per CPU second (the main process and its workers): on a busy machine the wall
  time measures the neighbours too. Goal: gl >= 2x.

    python benchmarks/formats.py [--only hf] [--rounds 3] [--samples 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch  # noqa: F401  # imported, as by any PyTorch training process: the crop resamples with its kernel

import globalloader as gl
from globalloader import synthetic, vision

RESULTS = Path(__file__).parent / "results" / "formats.json"
BATCH = 64
WORKERS = 2


def _peer(code: str, workdir: Path, **inputs: Any) -> Any:
    """Run `code` under the peers' interpreter in `workdir`: `INPUTS` in, `OUTPUT` back (pickled)."""
    python = os.environ.get("GLOBALLOADER_PEERS_PYTHON")
    if not python:
        sys.exit("GLOBALLOADER_PEERS_PYTHON is not set: build the peers' environment with .ci/peers-env")
    (workdir / "inputs.pkl").write_bytes(pickle.dumps(inputs))
    script = workdir / "peer.py"
    script.write_text(
        "import pickle\nif __name__ == '__main__':\n    INPUTS = pickle.load(open('inputs.pkl', 'rb'))\n"
        + textwrap.indent(textwrap.dedent(code), "    ")
        + "\n    pickle.dump(OUTPUT, open('output.pkl', 'wb'))\n"
    )
    done = subprocess.run([python, script.name], cwd=workdir, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        sys.exit(f"the peer's script failed:\n{done.stderr[-4000:]}")
    return pickle.loads((workdir / "output.pkl").read_bytes())


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


# -- hf ----------------------------------------------------------------------------------------------

_HF_WRITE = """
import datasets
images, labels = INPUTS["images"], INPUTS["labels"]
features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
rows = {"image": [{"bytes": b, "path": None} for b in images], "label": labels}
datasets.Dataset.from_dict(rows, features=features).save_to_disk(INPUTS["folder"], num_shards=4)
OUTPUT = datasets.__version__
"""

_HF_READ = """
import io, resource, time
import numpy as np, torch, datasets
from PIL import Image
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)

def random_resized_crop_box(width, height, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
        w, h = int(round(np.sqrt(target * aspect))), int(round(np.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, side, side

class Augmented(torch.utils.data.Dataset):
    def __init__(self, ds):
        self.ds = ds
    def __len__(self):
        return len(self.ds)
    def __getitem__(self, i):
        row = self.ds[i]  # datasets decodes the Image feature with Pillow
        rng = np.random.default_rng(i)
        img = row["image"].convert("RGB")
        left, top, w, h = random_resized_crop_box(img.size[0], img.size[1], rng)
        img = img.resize((224, 224), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return {"image": (np.asarray(img, np.float32) / 255.0 - MEAN) / STD, "label": row["label"]}

def cpu_s():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

data = Augmented(datasets.load_from_disk(INPUTS["folder"]))
start, cpu0, samples = time.perf_counter(), cpu_s(), 0
loader = torch.utils.data.DataLoader(
    data, batch_size=INPUTS["batch"], shuffle=True, num_workers=INPUTS["workers"],
    generator=torch.Generator().manual_seed(INPUTS["epoch"]),
)
for batch in loader:
    samples += len(batch["label"])
del loader  # its workers stop here, so that their CPU time is counted
OUTPUT = samples / (time.perf_counter() - start), samples / (cpu_s() - cpu0)
"""


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended children (the loaders' workers, once stopped)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _gl_epoch(folder: Path, epoch: int) -> tuple[float, float]:
    """(samples per second, samples per CPU second) of one epoch, workers started and stopped
    inside it."""
    chain = (
        gl.Dataset(gl.HFDataset(folder)).shuffle(0).map(vision.RandomResizedCropFlipNormalize(size=224)).batch(BATCH)
    )
    start, cpu0, samples = time.perf_counter(), _cpu_s(), 0
    with gl.Loader(chain, workers=WORKERS) as loader:
        loader.set_epoch(epoch)
        for batch in loader:
            samples += len(batch["label"])
    return samples / (time.perf_counter() - start), samples / (_cpu_s() - cpu0)


def bench_read_hf(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    images = [synthetic.make_jpeg_bytes(rng, (500, 375), label=i % 10, classes=10) for i in range(args.samples)]
    with tempfile.TemporaryDirectory(prefix="gl-bench-hf-") as tmp:
        work, folder = Path(tmp), Path(tmp) / "saved"
        version = _peer(
            _HF_WRITE, work, images=images, labels=[i % 10 for i in range(args.samples)], folder=str(folder)
        )
        read = {"folder": str(folder), "batch": BATCH, "workers": WORKERS}
        _gl_epoch(folder, 0)  # warm: the files in the page cache, for both
        gl_runs, peer_runs = [], []
        for epoch in range(1, args.rounds + 1):
            gl_runs.append(_gl_epoch(folder, epoch))
            peer_runs.append(_peer(_HF_READ, work, epoch=epoch, **read))
        size = sum(f.stat().st_size for f in folder.glob("*.arrow"))
    gl_rate, gl_cpu = [r for r, _ in gl_runs], [c for _, c in gl_runs]
    peer_rate, peer_cpu = [r for r, _ in peer_runs], [c for _, c in peer_runs]
    return {
        "samples": args.samples,
        "image": "500x375 JPEG, quality 90",
        "arrow_mb": size / 1e6,
        "workers": WORKERS,
        "batch": BATCH,
        "rounds": args.rounds,
        "samples_per_s": {"gl": _spread(gl_rate), "datasets_torch": _spread(peer_rate)},
        "ratio": statistics.median(gl_rate) / statistics.median(peer_rate),
        "samples_per_cpu_s": {"gl": _spread(gl_cpu), "datasets_torch": _spread(peer_cpu)},
        "cpu_ratio": statistics.median(gl_cpu) / statistics.median(peer_cpu),
        "goal": 2.0,
        "datasets": version,
    }


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"hf": bench_read_hf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, of {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    parts = [p for p in args.only.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
    results = json.loads(args.output.read_text()) if args.output.exists() else {}
    for part in parts:
        results[part] = {
            **PARTS[part](args),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "globalloader": gl.__version__},
        }
        print(json.dumps({part: results[part]}, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
