"""Your data as it is: globalloader reading and writing other tools' formats vs those tools' own code.

One harness, one function per part: `main()` runs the parts named by `--only` (default: all), each
on the same synthetic JPEG folder (`--samples` photo-like 500x375 pictures of quality 90 in 10
classes, made once under `--data`), `--rounds` times with the systems taking turns, and merges each
part's results into benchmarks/results/formats.json under its name (parts not run keep their last
results): samples/s as the median with min and max, the ratio of medians to the goal, and where
measured samples per CPU second (a process and its workers), since on a busy machine the wall time
measures the neighbours too. The peers run in their own environment (`--peers-python`, default
$GLOBALLOADER_PEERS_PYTHON, built by .ci/peers-env), in a subprocess, with their imports untimed;
their reading parts share one augmentation (`_PEER_AUGMENT`).

Reading (warm unless said; shuffled; each sample JPEG-decoded, random-resized-cropped to 224,
flipped and normalized; batch 64, 2 workers; a stand-in step reads every batch). gl runs
`globalloader.vision.RandomResizedCropFlipNormalize` in `gl.Loader(workers=2)`; the peers run
torch's `DataLoader(num_workers=2)` with the usual Pillow + NumPy code (torchvision's crop box, one
bilinear resize of it, flip, normalize; torchvision itself does not load beside the CPU torch
wheel there).
- `mds`: an MDS dataset written by Mosaic's own `MDSWriter` (a `jpeg` and an `int` column, shards
  of about 8 MB): `gl.MDS` vs Mosaic's `StreamingDataset(local=, shuffle=True)`, one untimed epoch
  first to warm the page cache. Goal: >= 1.3x.
- `mds-s3`: the same, cold, the dataset in a local S3 server (moto, loopback) behind a proxy adding
  `--latency` (0.02 s) per request (`globalloader.demo.s3`): each epoch starts with an empty cache
  (gl: a fresh machine cache folder; Mosaic: a fresh `local=` folder) and is timed from the
  construction of the source; `gl.MDS("s3://...")` vs `StreamingDataset(remote="s3://...")`.
  Goal: >= 1.3x.
- `litdata`: LitData's optimized chunks read by `gl.LitData` vs LitData's own `StreamingDataset`
  in its `StreamingDataLoader(num_workers=2)`, the same augmentation. Goal: >= 1.3x.
- `litdata-s3`: the same, cold, from S3 as `mds-s3` (LitData: `StreamingDataset(Dir(path=a fresh
  cache folder, url="s3://..."))`). Goal: >= 1.3x.
- `hf`: a Hugging Face dataset written by `datasets` itself (`save_to_disk`, an Image and a
  ClassLabel feature, 4 files): `gl.HFDataset` vs `datasets.load_from_disk` (its Image feature
  decoding with Pillow), workers started inside each timed epoch, one epoch read first, untimed.
  Goal: >= 2x.

Writing:
- `write`: the JPEG folder written as shards, 2 workers, each timed inside its process from before
  the call to after the last file is written (the tool's worker start included): gl's
  `gl.write_shards(gl.Dataset(gl.ImageFolder(root)), ..., workers=2, maxcount=500)` (tar shards
  and their `.idx` sidecars; with maxcount each worker writes whole shards, the fast path) vs
  LitData's `optimize(fn, inputs, num_workers=2, chunk_bytes="64MB")`, each input a file's bytes
  and label, and Mosaic Streaming's `MDSWriter` (`bytes` and `int` columns, `size_limit` 64 MB) in
  one process, as its users write. Each round writes into a fresh folder. Goals: gl >= 1.5x
  litdata and >= 2x mds.

    python benchmarks/formats.py [--only mds,mds-s3,hf,write] [--rounds 3] [--samples 2000] [--latency 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch  # noqa: F401  # imported, as by any PyTorch training process: the crop resamples with its kernel

import globalloader as gl
from globalloader import storage, vision
from globalloader.synthetic import make_jpeg_folder

RESULTS = Path(__file__).parent / "results" / "formats.json"
BATCH, WORKERS, SIZE = 64, 2, 224
WRITE_MAXCOUNT = 500  # samples per shard gl writes (about 30 MB of these JPEGs)
PEER_SHARD_BYTES = 64 << 20  # the peers' chunk and shard size when writing

# -- the harness -------------------------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU seconds of this process and of its ended children (a loader's workers, once stopped)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# Put before every peer script: the same CPU clock as `_cpu_s`, and the shared augmentation.
_PEER_COMMON = """
import io, json, math, resource, sys, time
import numpy as np

def cpu_s():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
"""

_PEER_AUGMENT = """
import torch
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

def augment(image, rng):
    # torchvision's RandomResizedCrop box, one bilinear resize of it, a flip, normalize
    image = image.convert("RGB")
    left, top, w, h = random_resized_crop_box(image.size[0], image.size[1], rng)
    image = image.resize((224, 224), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return (np.asarray(image, np.float32) / 255.0 - MEAN) / STD

def read_epochs(data, batch, workers, seeds, shuffle=False):
    # (samples/s, samples per CPU second) of an epoch of `data(seed)` in torch's DataLoader
    runs = []
    for seed in seeds:
        start, cpu0, samples = time.perf_counter(), cpu_s(), 0
        loader = torch.utils.data.DataLoader(
            data(seed), batch_size=batch, shuffle=shuffle, num_workers=workers,
            generator=torch.Generator().manual_seed(seed),
        )
        for out in loader:
            float(out["image"].mean())
            samples += len(out["label"])
        del loader  # its workers stop here, so that their CPU time is counted
        runs.append((samples / (time.perf_counter() - start), samples / (cpu_s() - cpu0)))
    return runs
"""


def _peers_python(args: argparse.Namespace) -> str:
    if not args.peers_python:
        sys.exit("no peers' interpreter: set GLOBALLOADER_PEERS_PYTHON (built by .ci/peers-env) or --peers-python")
    return str(args.peers_python)


def _peer(args: argparse.Namespace, code: str, env: dict[str, str] | None = None, **inputs: Any) -> Any:
    """`main(INPUTS)` of `code` (top-level definitions, so that workers that import the script
    again find them) run by the peers' interpreter in a folder of its own; its return value back."""
    with tempfile.TemporaryDirectory(prefix="gl-bench-peer-", dir=args.data) as tmp:
        work = Path(tmp)
        (work / "inputs.pkl").write_bytes(pickle.dumps(inputs))
        (work / "peer.py").write_text(
            textwrap.dedent(_PEER_COMMON)
            + textwrap.dedent(code)
            + "\n\nif __name__ == '__main__':\n"
            + "    import pickle\n"
            + "    OUTPUT = main(pickle.load(open('inputs.pkl', 'rb')))\n"
            + "    pickle.dump(OUTPUT, open('output.pkl', 'wb'))\n"
        )
        done = subprocess.run(
            [_peers_python(args), "peer.py"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=3600,
            env={**os.environ, **(env or {})},
        )
        if done.returncode:
            sys.exit(f"the peer's script failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return pickle.loads((work / "output.pkl").read_bytes())


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _compare(runs: dict[str, list[tuple[float, float]]], goals: dict[str, float]) -> dict[str, Any]:
    """Samples/s and samples per CPU second of each system, and gl's ratios of medians to the
    peers' against `goals` ({peer: at least})."""
    rate = {name: [r for r, _ in values] for name, values in runs.items()}
    cpu = {name: [c for _, c in values] for name, values in runs.items()}
    ratios = {peer: statistics.median(rate["gl"]) / statistics.median(rate[peer]) for peer in goals}
    cpu_ratios = {peer: statistics.median(cpu["gl"]) / statistics.median(cpu[peer]) for peer in goals}
    for peer, goal in goals.items():
        print(f"gl/{peer}: {ratios[peer]:.2f}x (goal {goal}x); per CPU second {cpu_ratios[peer]:.2f}x")
    return {
        "samples_per_s": {name: _spread(values) for name, values in rate.items()},
        "samples_per_cpu_s": {name: _spread(values) for name, values in cpu.items()},
        "ratios": ratios,
        "cpu_ratios": cpu_ratios,
        "goals": {peer: {"at_least": goal, "met": ratios[peer] >= goal} for peer, goal in goals.items()},
    }


def _print_round(part: str, round_: int, args: argparse.Namespace, runs: dict[str, list[tuple[float, float]]]) -> None:
    rates = ", ".join(f"{name} {values[-1][0]:,.0f}" for name, values in runs.items())
    print(f"{part} round {round_ + 1}/{args.rounds}: {rates} samples/s")


def _jpegs(args: argparse.Namespace) -> Path:
    """The JPEG folder every part starts from (made once)."""
    return make_jpeg_folder(args.data / f"jpegs-{args.samples}", args.samples, classes=10, progress=True)


def _items(root: Path) -> list[tuple[str, int]]:
    """The image folder's files and labels, in ImageFolder's order."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(str(f), label) for label, c in enumerate(classes) for f in sorted((root / c).iterdir())]


def _gl_epoch(chain: gl.Dataset, seed: int) -> tuple[float, float]:
    """(samples/s, samples per CPU second) of one epoch, its workers started and stopped in it."""
    start, cpu0, samples = time.perf_counter(), _cpu_s(), 0
    with gl.Loader(chain, workers=WORKERS, prefetch=2 * WORKERS) as loader:
        loader.set_epoch(seed)
        for batch in loader:
            float(batch["image"].mean())
            samples += len(batch["label"])
    return samples / (time.perf_counter() - start), samples / (_cpu_s() - cpu0)


def _augmented(source: Any) -> gl.Dataset:
    return (
        gl.Dataset(source)
        .shuffle(seed=0)
        .map(vision.RandomResizedCropFlipNormalize(field="image", size=SIZE), name="decode+crop")
        .batch(BATCH)
    )


# -- mds, mds-s3 -------------------------------------------------------------------------------------

_MOSAIC_WRITE = """
from streaming import MDSWriter

def main(INPUTS):
    with MDSWriter(out=INPUTS["out"], columns={"image": "jpeg", "label": "int"}, size_limit=8 << 20) as writer:
        for path, label in INPUTS["items"]:
            with open(path, "rb") as f:
                writer.write({"image": f.read(), "label": label})
"""

_MOSAIC_READ = """
from streaming import StreamingDataset

class Augmented(StreamingDataset):
    def __getitem__(self, index):
        sample = super().__getitem__(index)
        return {"image": augment(sample["image"], np.random.default_rng(index)), "label": sample["label"]}

def main(INPUTS):
    folder, remote, batch = INPUTS["folder"], INPUTS["remote"], INPUTS["batch"]

    def data(seed):
        if remote:  # cold: a fresh local folder each epoch
            return Augmented(remote=remote, local=f"{folder}-{seed}", shuffle=True, shuffle_seed=seed, batch_size=batch)
        return Augmented(local=folder, shuffle=True, shuffle_seed=seed, batch_size=batch)

    if not remote:
        read_epochs(data, batch, INPUTS["workers"], [1000])  # warm
    return read_epochs(data, batch, INPUTS["workers"], INPUTS["seeds"])
"""


def _mds_dataset(args: argparse.Namespace) -> Path:
    """The JPEG folder as an MDS dataset written by Mosaic's MDSWriter (made once)."""
    folder = args.data / f"mds-{args.samples}"
    if not (folder / "index.json").exists():
        _peer(args, _MOSAIC_WRITE, out=str(folder), items=_items(_jpegs(args)))
    return folder


def bench_read_mds(args: argparse.Namespace) -> dict[str, Any]:
    """gl.MDS in gl.Loader vs Mosaic's StreamingDataset in torch's DataLoader, warm."""
    folder = _mds_dataset(args)
    source = gl.MDS(folder)
    chain = _augmented(source)
    _gl_epoch(chain, 1000)  # warm
    runs: dict[str, list[tuple[float, float]]] = {"gl": [], "mosaic": []}
    for round_ in range(args.rounds):
        runs["gl"].append(_gl_epoch(chain, round_))
        read = {"folder": str(folder), "remote": "", "batch": BATCH, "workers": WORKERS, "seeds": [round_]}
        runs["mosaic"] += _peer(args, _PEER_AUGMENT + _MOSAIC_READ, **read)
        _print_round("mds", round_, args, runs)
    return {"samples": len(source), "shards": len(source.shards), **_compare(runs, {"mosaic": 1.3})}


def _cold_s3(
    args: argparse.Namespace,
    folder: Path,
    part: str,
    peer: str,
    make: Callable[[str, dict[str, Any]], Any],
    peer_code: str,
    peer_inputs: Callable[[str, str, str, int], tuple[dict[str, str], dict[str, Any]]],
) -> dict[str, Any]:
    """`folder` uploaded to S3 (moto, loopback) behind a proxy adding `--latency` per request, then
    per round gl's cold epoch (an empty machine cache, timed from the construction of the source,
    `make(url, storage_options)`) and the peer's (`peer_inputs(url, endpoint, scratch, round)`
    gives its environment and inputs)."""
    from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

    server = MotoServer()
    proxy = FaultProxy(server.port)
    try:
        bucket = new_bucket(proxy.url)
        store = storage.Store(options(proxy.url))
        for file in folder.iterdir():
            with store.open_write(f"s3://{bucket}/{part}/{file.name}") as out:
                out.write(file.read_bytes())
        proxy.latency = args.latency
        url = f"s3://{bucket}/{part}"
        runs: dict[str, list[tuple[float, float]]] = {"gl": [], peer: []}
        with tempfile.TemporaryDirectory(prefix=f"gl-bench-{part}-", dir=args.data) as tmp:
            for round_ in range(args.rounds):
                os.environ["GLOBALLOADER_CACHE_DIR"] = f"{tmp}/gl-{round_}"  # an empty machine cache
                start, cpu0 = time.perf_counter(), _cpu_s()
                _gl_epoch(_augmented(make(url, options(proxy.url))), round_)
                seconds, cpu = time.perf_counter() - start, _cpu_s() - cpu0
                runs["gl"].append((args.samples / seconds, args.samples / cpu))
                env, inputs = peer_inputs(url, proxy.url, tmp, round_)
                runs[peer] += _peer(args, _PEER_AUGMENT + peer_code, env=env, **inputs)
                _print_round(f"{part}-s3", round_, args, runs)
    finally:
        proxy.stop()
        server.stop()
    return {"samples": args.samples, "latency_s": args.latency, **_compare(runs, {peer: 1.3})}


def bench_read_mds_s3(args: argparse.Namespace) -> dict[str, Any]:
    """The same as `bench_read_mds`, cold, from S3 (moto) at `--latency` seconds per request."""

    def mosaic(url: str, endpoint: str, scratch: str, round_: int) -> tuple[dict[str, str], dict[str, Any]]:
        env = {"S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        inputs = {"folder": f"{scratch}/mosaic-{round_}", "remote": url, "batch": BATCH, "workers": WORKERS}
        return env, {**inputs, "seeds": [round_]}

    return _cold_s3(
        args, _mds_dataset(args), "mds", "mosaic", lambda url, o: gl.MDS(url, storage_options=o), _MOSAIC_READ, mosaic
    )


# -- litdata -----------------------------------------------------------------------------------------

_LITDATA_WRITE = """
from litdata import optimize

def item(entry):
    path, label = entry
    with open(path, "rb") as f:
        return {"image": f.read(), "label": label}  # the JPEG's bytes, stored as they are

def main(INPUTS):
    optimize(fn=item, inputs=INPUTS["items"], output_dir=INPUTS["folder"], chunk_bytes="64MB", num_workers=2)
"""

_LITDATA_READ = """
import io
import litdata.streaming.downloader as downloader
from litdata import StreamingDataLoader, StreamingDataset
from litdata.streaming.resolver import Dir

downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # moto's http:// endpoint

class Augmented(StreamingDataset):
    def __getitem__(self, index):
        record = super().__getitem__(index)
        rng = np.random.default_rng(getattr(index, "index", index))
        return {"image": augment(Image.open(io.BytesIO(record["image"])), rng), "label": record["label"]}

def main(INPUTS):
    url, runs = INPUTS.get("url"), []
    seeds = INPUTS["seeds"] if url else [1000, *INPUTS["seeds"]]  # warm: a first epoch fills the page cache
    for seed in seeds:
        start, cpu0, samples = time.perf_counter(), cpu_s(), 0
        if url:  # cold: a fresh cache folder each epoch
            where = Dir(path=f"{INPUTS['cache']}-{seed}", url=url)
            data = Augmented(where, shuffle=True, seed=seed, storage_options=INPUTS["storage"])
        else:
            data = Augmented(INPUTS["folder"], shuffle=True, seed=seed)
        loader = StreamingDataLoader(data, batch_size=INPUTS["batch"], num_workers=INPUTS["workers"])
        for out in loader:
            float(out["image"].mean())
            samples += len(out["label"])
        del loader  # its workers stop here, so that their CPU time is counted
        runs.append((samples / (time.perf_counter() - start), samples / (cpu_s() - cpu0)))
    return runs if url else runs[1:]
"""


def bench_read_litdata(args: argparse.Namespace) -> dict[str, Any]:
    """gl.LitData in gl.Loader vs LitData's StreamingDataset in its StreamingDataLoader, warm."""
    folder = args.data / f"litdata-{args.samples}"
    if not (folder / "index.json").exists():
        _peer(args, _LITDATA_WRITE, items=_items(_jpegs(args)), folder=str(folder))
    source = gl.LitData(folder)
    chain = _augmented(source)
    _gl_epoch(chain, 1000)  # warm
    runs: dict[str, list[tuple[float, float]]] = {"gl": [], "litdata": []}
    for round_ in range(args.rounds):
        runs["gl"].append(_gl_epoch(chain, round_))
        read = {"folder": str(folder), "batch": BATCH, "workers": WORKERS, "seeds": [round_]}
        runs["litdata"] += _peer(args, _PEER_AUGMENT + _LITDATA_READ, **read)
        _print_round("litdata", round_, args, runs)
    return {"samples": len(source), **_compare(runs, {"litdata": 1.3})}


def bench_read_litdata_s3(args: argparse.Namespace) -> dict[str, Any]:
    """The same as `bench_read_litdata`, cold, from S3 (moto) at `--latency` seconds per request."""
    folder = args.data / f"litdata-{args.samples}"
    if not (folder / "index.json").exists():
        _peer(args, _LITDATA_WRITE, items=_items(_jpegs(args)), folder=str(folder))

    def litdata(url: str, endpoint: str, scratch: str, round_: int) -> tuple[dict[str, str], dict[str, Any]]:
        keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        inputs = {"url": url, "cache": f"{scratch}/litdata-{round_}", "storage": {"endpoint_url": endpoint, **keys}}
        return {}, {**inputs, "batch": BATCH, "workers": WORKERS, "seeds": [round_]}

    make = lambda url, o: gl.LitData(url, storage_options=o)  # noqa: E731
    return _cold_s3(args, folder, "litdata", "litdata", make, _LITDATA_READ, litdata)


# -- hf ----------------------------------------------------------------------------------------------

_HF_WRITE = """
import datasets

def main(INPUTS):
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    images = []
    for path, _ in INPUTS["items"]:
        with open(path, "rb") as f:
            images.append({"bytes": f.read(), "path": None})
    rows = {"image": images, "label": [label for _, label in INPUTS["items"]]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(INPUTS["folder"], num_shards=4)
    return datasets.__version__
"""

_HF_READ = """
import datasets

class Augmented(torch.utils.data.Dataset):
    def __init__(self, ds, seed):
        self.ds, self.seed = ds, seed
    def __len__(self):
        return len(self.ds)
    def __getitem__(self, i):
        row = self.ds[i]  # datasets decodes the Image feature with Pillow
        return {"image": augment(row["image"], np.random.default_rng((self.seed, i))), "label": row["label"]}

def main(INPUTS):
    ds = datasets.load_from_disk(INPUTS["folder"])
    return read_epochs(lambda seed: Augmented(ds, seed), INPUTS["batch"], INPUTS["workers"], INPUTS["seeds"], True)
"""


def bench_read_hf(args: argparse.Namespace) -> dict[str, Any]:
    """gl.HFDataset in gl.Loader vs datasets + torch's DataLoader, warm."""
    folder = args.data / f"hf-{args.samples}"
    version = None
    if not (folder / "state.json").exists():
        version = _peer(args, _HF_WRITE, items=_items(_jpegs(args)), folder=str(folder))
    chain = _augmented(gl.HFDataset(folder))
    _gl_epoch(chain, 1000)  # warm: the files in the page cache, for both
    runs: dict[str, list[tuple[float, float]]] = {"gl": [], "datasets_torch": []}
    for round_ in range(args.rounds):
        runs["gl"].append(_gl_epoch(chain, round_))
        read = {"folder": str(folder), "batch": BATCH, "workers": WORKERS, "seeds": [round_]}
        runs["datasets_torch"] += _peer(args, _PEER_AUGMENT + _HF_READ, **read)
        _print_round("hf", round_, args, runs)
    size = sum(f.stat().st_size for f in folder.glob("*.arrow"))
    return {
        "samples": args.samples,
        "arrow_mb": size / 1e6,
        **({"datasets": version} if version else {}),
        **_compare(runs, {"datasets_torch": 2.0}),
    }


# -- write -------------------------------------------------------------------------------------------

_PEER_WRITERS = {
    "litdata": """
        from litdata import optimize

        def sample(item):
            path, label = item
            with open(path, "rb") as f:
                return {"image": f.read(), "label": label}

        def main(INPUTS):
            start, cpu0 = time.perf_counter(), cpu_s()
            optimize(fn=sample, inputs=INPUTS["items"], output_dir=INPUTS["out"], num_workers=2, chunk_bytes="64MB")
            return time.perf_counter() - start, cpu_s() - cpu0
    """,
    "mds": """
        from streaming import MDSWriter

        def main(INPUTS):
            start, cpu0 = time.perf_counter(), cpu_s()
            with MDSWriter(out=INPUTS["out"], columns={"image": "bytes", "label": "int"}, size_limit="64mb") as writer:
                for path, label in INPUTS["items"]:
                    with open(path, "rb") as f:
                        writer.write({"image": f.read(), "label": label})
            return time.perf_counter() - start, cpu_s() - cpu0
    """,
}


def _write_gl(args: argparse.Namespace, root: Path, out: Path) -> tuple[float, float]:
    start, cpu0 = time.perf_counter(), _cpu_s()
    dataset = gl.Dataset(gl.ImageFolder(root))
    gl.write_shards(dataset, out / "shard-%06d.tar", workers=WORKERS, maxcount=WRITE_MAXCOUNT, progress=False)
    return time.perf_counter() - start, _cpu_s() - cpu0


def bench_write(args: argparse.Namespace) -> dict[str, Any]:
    """gl.write_shards vs LitData's optimize and Mosaic's MDSWriter, from the JPEG folder."""
    root = _jpegs(args)
    items = [tuple(item) for item in _items(root)]
    writers: dict[str, Callable[[Path], tuple[float, float]]] = {
        "gl": lambda out: _write_gl(args, root, out),
        **{
            tool: (lambda out, code=code: _peer(args, code, items=items, out=str(out)))
            for tool, code in _PEER_WRITERS.items()
        },
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in writers}
    for round_ in range(args.rounds):
        for name, write in writers.items():
            out = Path(tempfile.mkdtemp(prefix=f"formats-write-{name}-", dir=args.data)) / "out"
            try:
                seconds, cpu = write(out)
            finally:
                shutil.rmtree(out.parent, ignore_errors=True)
            runs[name].append((args.samples / seconds, args.samples / cpu))
            print(
                f"write round {round_ + 1}/{args.rounds}: {name:8s} {args.samples / seconds:8,.0f} samples/s, "
                f"{1e3 * cpu / args.samples:.2f} CPU ms per sample"
            )
    return {
        "samples": args.samples,
        "gl_maxcount": WRITE_MAXCOUNT,
        "peer_shard_bytes": PEER_SHARD_BYTES,
        "image_bytes": sum(os.path.getsize(path) for path, _ in items),
        **_compare(runs, {"litdata": 1.5, "mds": 2.0}),
    }


PARTS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "mds": bench_read_mds,
    "mds-s3": bench_read_mds_s3,
    "litdata": bench_read_litdata,
    "litdata-s3": bench_read_litdata_s3,
    "hf": bench_read_hf,
    "write": bench_write,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts to run, comma-separated: {', '.join(PARTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each measurement (median, min, max)")
    parser.add_argument("--samples", type=int, default=2000, help="pictures in the JPEG folder (the full run: 10000)")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added per S3 request (mds-s3)")
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
            "workers": WORKERS,
            "rounds": args.rounds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "globalloader": gl.__version__,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {args.output}")


if __name__ == "__main__":
    main()
