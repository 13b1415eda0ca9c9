"""Benchmark: the Ray global shuffle against Ray Data (and a NumPy ceiling), in three parts.

One harness; `--only` picks parts (default all), each merged into benchmarks/results/ray_shuffle.json
under its name (parts not run keep their last results). In every part the methods take turns,
round after round: one untimed warm-up round (cold object store, first imports), then `--repeats`
timed rounds; ratios are taken within a round and reported as the median over rounds with their
range [min, max], so load that comes and goes on a shared machine moves both sides of a ratio.

**parquet** (goal: globalloader_ray >= 3x ray_data). `--rows` rows (int64 `key` = the row's position
in file order, 100-byte random `payload`, the shape of a token data set) in `--files` Parquet files,
written once into a cache folder. Every method delivers `--epochs` epochs of `--batch-size`-row
batches, each epoch a fresh global shuffle, to `--trainers` consumers:

- numpy_ceiling: one process reads every file, draws a permutation, gathers, cuts batches
  (the practical ceiling on this machine: no scheduling, no object store, no copies between
  processes; it needs the whole epoch in one process's memory). It runs one untimed warm-up
  epoch first: a fresh process's first gigabyte-sized allocations wait for the kernel to
  compact memory into huge pages and take several times longer than later epochs here, and
  the ceiling should be the best case.
- globalloader_ray: `globalloader.ray.ShufflingDataset`, one trainer actor per rank.
- ray_data: `ray.data.read_parquet(...).random_shuffle()` split across the trainer actors with
  `streaming_split(equal=True)` and read with `iter_batches` (pyarrow batches: Ray Data's
  fastest path; NumPy batches would turn the binary payload into Python bytes objects).

Both Ray methods run on one local Ray (`--cpus` CPUs, `--object-store-gb` of object store) with
the same warm worker pool. With `--nodes N` (N > 1) a second phase starts a local cluster of N
nodes (each its own raylet and object store, `--node-cpus` CPUs) and runs globalloader_ray there,
trainers pinned to different nodes, paired round by round with the ceiling again. Reported per
method: rows/s over all epochs (from creating the dataset to the last batch), time to first batch
per epoch, peak memory (proportional set size of this process tree, which counts the object
store's touched pages once), MiB the object store spilled to disk so far in the Ray session
(needs grpcio), the outputs trainers pulled from other nodes (globalloader_ray), and shuffle
quality: Spearman correlation between input and output position, distinct files per batch,
correlation between consecutive epochs' positions of each row.

The next two parts run on one local cluster of `--cluster-nodes` (4) nodes started as the tests
start one (`ray.cluster_utils.Cluster`, each node its own raylet and object store of
`--cluster-store-gb`, `--node-cpus` CPUs, a resource `node-i`), one trainer actor per node (rank r
on node r, no CPU of its own), both methods on the same nodes, CPUs and warm worker pool. Each
trainer times every fetch of a batch (`iter`, `next`, and making what its step consumes) in wall
time and in its thread's CPU time, then runs a fixed step, a sleep standing for an accelerator's
step (the CPU stays free for the pipeline); `process_cpu_s` is its whole process's CPU (every
thread: the loader's fetch thread, Ray's own) over the loop. Reported: samples/s over all trainers
(from creating the data set to the last batch), and as shares of the trainers' loop time: process
CPU (the goal's figure, an upper bound on time in loader code), CPU in fetch, wall in fetch
(waiting for the pipeline included: near 1 when the pipeline sets the pace); and the process's CPU
milliseconds per batch, which does not depend on how long the trainer waited.

**jpeg** (goal: globalloader_ray >= 1.5x ray_data). `--images` synthetic 500x375 photos
(`globalloader.synthetic`) written once as tar shards of 128 (`gl.write_shards`); decode
(`vision.Decode`), random 224x224 crop and flip (`vision.RandomCropFlipNormalize`, uint8), global
shuffle, batches of 64 into the trainers as torch uint8 tensors, `--jpeg-epochs` epochs, step
`--step-ms`:
- globalloader_ray: `TorchShufflingDataset(gl.Dataset(gl.TarShards(shards)).map(Decode).map(crop),
  feature_columns="image")`, the maps in Ray's map tasks, each sample's crop from its own generator,
  new every epoch.
- ray_data: `read_webdataset(shards, decoder=None)` -> `map_batches` (the same Decode and crop)
  -> `random_shuffle()` -> `streaming_split(4, equal=True)` -> `iter_torch_batches(batch_size=64)`.
  The same per-image code on both sides: the engines differ, not the decoder.

**trainer-cost** (goal: globalloader_ray's process CPU share <= 10%). The parquet part's data
(`--cost-rows` rows in 16 files), 2 epochs of 4096-row batches with a `--cost-step-ms` step, long
enough that the trainers, not the shuffle, set the pace (wall in fetch small): what the loader
costs a trainer that is kept fed (gl only: the jpeg part reports Ray Data's trainers the same way).

    python benchmarks/ray_shuffle.py --quick          # every part small, one round: checks the harness only
    python benchmarks/ray_shuffle.py --only jpeg,trainer-cost   # the cluster parts (a few minutes)
    python benchmarks/ray_shuffle.py --only parquet   # 10 to 30 minutes on 2 busy cores
    python benchmarks/ray_shuffle.py --only parquet --nodes 3   # and on a 3-node local cluster
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import pathlib
import platform
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

import globalloader as gl
from globalloader import vision
from globalloader.synthetic import make_jpeg_folder

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_CACHE = pathlib.Path(tempfile.gettempdir()) / "globalloader-bench" / "ray_shuffle"
PAYLOAD = 100
TARGETS = {
    "vs_ray_data": 3.0,
    "vs_numpy_ceiling": 0.8,
    "later_first_batch_s": 1.0,
    "abs_spearman": 0.01,
    "files_per_batch": 60,
}
LOWER_IS_BETTER = ("later_first_batch_s", "abs_spearman")
PARTS = ("parquet", "jpeg", "trainer-cost")
SIZES = {  # argument: (full run, --quick)
    "repeats": (3, 1),
    "rows": (10_000_000, 200_000),
    "files": (64, 8),
    "epochs": (3, 2),
    "images": (2048, 256),
    "jpeg_epochs": (2, 1),
    "cost_rows": (2_000_000, 200_000),
}
IMAGE_SIZE = (500, 375)  # width, height of the synthetic photos
IMAGES_PER_SHARD = 128
JPEG_BATCH = 64
DECODE = vision.Decode(field="image")
CROP = vision.RandomCropFlipNormalize(field="image", size=224, normalize=False)  # uint8 224x224x3, half of them flipped
COST_FILES = 16
CLUSTER_TARGETS = {"vs_ray_data": 1.5, "trainer_cpu_share": 0.10}  # jpeg; trainer-cost: the share only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts to run: {', '.join(PARTS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round: checks the harness, not speed")
    parser.add_argument("--repeats", type=int, help="timed rounds after one untimed warm-up round (3; --quick 1)")
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", type=pathlib.Path, help="results/ray_shuffle.json (--quick: in --cache)")
    parquet = parser.add_argument_group("parquet part")
    parquet.add_argument("--rows", type=int, help="10,000,000 (--quick 200,000)")
    parquet.add_argument("--files", type=int, help="64 (--quick 8)")
    parquet.add_argument("--epochs", type=int, help="3 (--quick 2)")
    parquet.add_argument("--trainers", type=int, default=2)
    parquet.add_argument("--batch-size", type=int, default=4096)
    parquet.add_argument("--cpus", type=int, default=2)
    parquet.add_argument("--object-store-gb", type=float, default=4.0)
    parquet.add_argument("--nodes", type=int, default=1, help="also run globalloader_ray on a local cluster this big")
    parquet.add_argument("--skip-ray-data", action="store_true")
    cluster = parser.add_argument_group("jpeg and trainer-cost parts (one trainer per node of a local cluster)")
    cluster.add_argument("--cluster-nodes", type=int, default=4)
    cluster.add_argument("--node-cpus", type=int, default=1, help="CPUs of each cluster node (also --nodes > 1)")
    cluster.add_argument("--cluster-store-gb", type=float, default=1.0, help="object store of each cluster node")
    cluster.add_argument("--images", type=int, help="JPEGs (2048; --quick 256)")
    cluster.add_argument("--jpeg-epochs", type=int, help="2 (--quick 1)")
    cluster.add_argument("--step-ms", type=float, default=10.0, help="the jpeg trainers' simulated step per batch")
    cluster.add_argument("--cost-rows", type=int, help="rows of the trainer-cost part (2,000,000; --quick 200,000)")
    cluster.add_argument("--cost-step-ms", type=float, default=20.0, help="the trainer-cost part's step per batch")
    args = parser.parse_args()
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.out is None:  # a quick run never overwrites measured results
        args.out = args.cache / "ray_shuffle_quick.json" if args.quick else HERE / "results" / "ray_shuffle.json"
    parts = args.only.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--only: unknown part(s) {unknown}; the parts are {', '.join(PARTS)}")

    results: dict[str, Any] = {}
    if "parquet" in parts:
        results["parquet"] = parquet_part(args)
    if "jpeg" in parts or "trainer-cost" in parts:
        results.update(cluster_parts(args, parts))
    merged = json.loads(args.out.read_text()) if args.out.exists() else {}
    merged.update(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=2, default=float) + "\n")
    print(f"results of {', '.join(results)} written to {args.out}")


def parquet_part(args: argparse.Namespace) -> dict[str, Any]:
    """gl against Ray Data's random_shuffle and the NumPy ceiling on one node (and --nodes)."""
    files = ensure_data(args.cache, args.rows, args.files)
    cfg = {
        "rows": args.rows,
        "files": args.files,
        "epochs": args.epochs,
        "trainers": args.trainers,
        "batch_size": args.batch_size,
        "cpus": args.cpus,
        "object_store_gb": args.object_store_gb,
        "repeats": args.repeats,
        "quick": args.quick,
        "nodes": args.nodes,
        "node_cpus": args.node_cpus,
        "payload_bytes": PAYLOAD,
        "parquet_compression": "snappy (pyarrow default)",
        "notes": "numpy_ceiling runs one untimed warm-up epoch per run; every method runs one untimed "
        "warm-up round; Ray methods share a warm worker pool; ray_data reads pyarrow batches",
    }
    import ray

    methods: dict[str, Callable[[], dict[str, Any]]] = {
        "numpy_ceiling": lambda: run_numpy_ceiling(files, cfg),
        "globalloader_ray": lambda: run_on_ray("globalloader_ray", files, cfg),
    }
    if not args.skip_ray_data:
        methods["ray_data"] = lambda: run_on_ray("ray_data", files, cfg)
    ray.init(
        num_cpus=args.cpus,
        object_store_memory=int(args.object_store_gb * 2**30),
        include_dashboard=False,
        log_to_driver=False,
    )
    _warm_workers(ray, args.cpus)
    try:
        runs = run_rounds(methods, args.repeats, "parquet, one node")
    finally:
        ray.shutdown()
    if args.nodes > 1:
        cluster = start_cluster(args.nodes, args.node_cpus, args.object_store_gb)
        try:
            on_cluster = run_rounds(
                {
                    "numpy_ceiling": lambda: run_numpy_ceiling(files, cfg),
                    "globalloader_ray": lambda: run_on_ray("globalloader_ray", files, cfg, nodes=args.nodes),
                },
                args.repeats,
                f"parquet, {args.nodes} nodes",
            )
        finally:
            ray.shutdown()
            cluster.shutdown()
        runs["numpy_ceiling_cluster_phase"] = on_cluster["numpy_ceiling"]
        runs[f"globalloader_ray_{args.nodes}_nodes"] = on_cluster["globalloader_ray"]
    return report(cfg, runs)


def run_rounds(methods: dict[str, Callable[[], dict[str, Any]]], repeats: int, phase: str) -> dict[str, list[Any]]:
    """One untimed warm-up round, then `repeats` rounds; each round runs every method once."""
    runs: dict[str, list[Any]] = {name: [] for name in methods}
    with tqdm(total=(repeats + 1) * len(methods), desc=phase, unit="run") as bar:
        for round_ in range(-1, repeats):
            for name, method in methods.items():
                bar.set_postfix_str(f"{'warm-up' if round_ < 0 else f'round {round_}'} {name}")
                result = method()
                if round_ >= 0:
                    runs[name].append(result)
                bar.update()
    return runs


def start_cluster(nodes: int, node_cpus: int, store_gb: float) -> Any:
    """A local cluster of `nodes` raylets, node i holding resource `node-i`; this process joins it."""
    import ray
    from ray.cluster_utils import Cluster

    store = int(store_gb * 2**30)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": node_cpus, "resources": {"node-0": 1}, "object_store_memory": store},
    )
    for i in range(1, nodes):
        cluster.add_node(num_cpus=node_cpus, resources={f"node-{i}": 1}, object_store_memory=store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    _warm_workers(ray, nodes * node_cpus)
    return cluster


# --- data -----------------------------------------------------------------------------------


def ensure_data(cache: pathlib.Path, rows: int, n_files: int) -> list[str]:
    """Write the data set once (a marker file says it is complete); return the file paths."""
    folder = cache / f"rows{rows}-files{n_files}"
    paths = [str(folder / f"part-{i:04d}.parquet") for i in range(n_files)]
    marker = folder / "COMPLETE"
    if marker.exists():
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    bounds = np.linspace(0, rows, n_files + 1).astype(np.int64)
    for i in tqdm(range(n_files), desc="writing parquet", unit="file"):
        n = int(bounds[i + 1] - bounds[i])
        payload = rng.integers(0, 256, size=n * PAYLOAD, dtype=np.uint8)
        table = pa.table(
            {
                "key": np.arange(bounds[i], bounds[i + 1], dtype=np.int64),
                "payload": pa.FixedSizeBinaryArray.from_buffers(pa.binary(PAYLOAD), n, [None, pa.py_buffer(payload)]),
            }
        )
        pq.write_table(table, paths[i])
    marker.write_text(json.dumps({"rows": rows, "files": n_files}))
    return paths


# --- NumPy ceiling --------------------------------------------------------------------------


def run_numpy_ceiling(files: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """Run in a fresh process, so its peak RSS is its own."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ceiling_process, args=(files, cfg, child))
    proc.start()
    result = parent.recv()
    proc.join()
    return result


def _ceiling_process(files: list[str], cfg: dict[str, Any], conn: Any) -> None:
    from globalloader.sources import to_numpy

    rng = np.random.default_rng(0)
    n, trainers, batch = cfg["rows"], cfg["trainers"], cfg["batch_size"]
    epochs, orders = [], []
    start = time.perf_counter()
    for epoch in range(-1, cfg["epochs"]):  # epoch -1: untimed warm-up (see the module doc)
        if epoch == 0:
            epochs, orders, start = [], [], time.perf_counter()
        t0 = time.perf_counter()
        tables = [pq.read_table(f) for f in files]
        key = np.concatenate([to_numpy(t.column("key")) for t in tables])
        payload = np.concatenate([to_numpy(t.column("payload")) for t in tables])
        del tables
        perm = rng.permutation(n)
        key, payload = np.take(key, perm), np.take(payload, perm, axis=0)
        first = time.perf_counter() - t0
        delivered = [[] for _ in range(trainers)]  # batches dealt round robin to trainers
        for b, i in enumerate(range(0, n, batch)):
            delivered[b % trainers].append({"key": key[i : i + batch], "payload": payload[i : i + batch]})
        keys = [np.concatenate([d["key"] for d in rank]) for rank in delivered]
        sizes = [[len(d["key"]) for d in rank] for rank in delivered]
        epochs.append({"first_batch_s": first, "epoch_s": time.perf_counter() - t0})
        orders.append((keys, sizes))
        del key, payload, perm, delivered
    elapsed = time.perf_counter() - start
    result = summarize(epochs, orders, elapsed, cfg)
    result["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    conn.send(result)


# --- Ray methods ----------------------------------------------------------------------------


def run_on_ray(name: str, files: list[str], cfg: dict[str, Any], nodes: int = 1) -> dict[str, Any]:
    """One run on the Ray this process is connected to; with `nodes` > 1 rank r's trainer is
    pinned to cluster node 1 + r % (nodes - 1) (the head, node 0, keeps the driver)."""
    import ray

    trainer_cls = _GlobalLoaderTrainer if name == "globalloader_ray" else _RayDataTrainer
    trainers = [
        ray.remote(trainer_cls)
        .options(num_cpus=0, resources={f"node-{1 + r % (nodes - 1)}": 0.01} if nodes > 1 else {})
        .remote()
        for r in range(cfg["trainers"])
    ]
    ray.get([t.ready.remote() for t in trainers])
    sampler = _MemorySampler()
    start = time.perf_counter()
    if name == "globalloader_ray":
        runs = ray.get([t.run.remote(files, rank, cfg) for rank, t in enumerate(trainers)])
    else:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        splits = ray.data.read_parquet(files).random_shuffle().streaming_split(cfg["trainers"], equal=True)
        runs = ray.get([t.run.remote(split, cfg) for t, split in zip(trainers, splits, strict=True)])
    elapsed = time.perf_counter() - start
    peak = sampler.stop()
    ray.get([t.close.remote() for t in trainers[::-1]])
    for t in trainers:
        ray.kill(t)
    epochs = [
        {
            "first_batch_s": max(r["epochs"][e]["first_batch_s"] for r in runs),
            "epoch_s": max(r["epochs"][e]["epoch_s"] for r in runs),
            "batches_per_trainer": [len(r["sizes"][e]) for r in runs],
            "pulled_outputs": sum(r["epochs"][e].get("pulled_outputs", 0) for r in runs),
            "pulled_bytes": sum(r["epochs"][e].get("pulled_bytes", 0) for r in runs),
        }
        for e in range(cfg["epochs"])
    ]
    orders = [([r["keys"][e] for r in runs], [r["sizes"][e] for r in runs]) for e in range(cfg["epochs"])]
    result = summarize(epochs, orders, elapsed, cfg)
    result.update(peak)
    result["spilled_mib"] = _spilled_mib()
    return result


def _warm_workers(ray: Any, cpus: int) -> None:
    """Start the worker processes both Ray methods will use (not part of either's time)."""

    @ray.remote(num_cpus=1)
    def warm() -> int:
        import pyarrow  # noqa: F401

        time.sleep(0.5)
        return os.getpid()

    ray.get([warm.remote() for _ in range(cpus)])


class _GlobalLoaderTrainer:
    """One rank of `ShufflingDataset`, collecting keys and batch sizes per epoch."""

    def ready(self) -> bool:
        return True

    def run(self, files: list[str], rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
        from globalloader.ray import ShufflingDataset

        self.ds = ShufflingDataset(files, cfg["epochs"], cfg["trainers"], cfg["batch_size"], rank)
        out: dict[str, Any] = {"epochs": [], "keys": [], "sizes": []}
        for epoch in range(cfg["epochs"]):
            self.ds.set_epoch(epoch)
            _consume(self.ds, out, lambda b: b["key"])
            stats = self.ds.epoch_stats[epoch]
            out["epochs"][-1].update(pulled_outputs=stats["pulled_outputs"], pulled_bytes=stats["pulled_bytes"])
        return out

    def close(self) -> None:
        self.ds.close()


class _RayDataTrainer:
    """One `streaming_split` shard of the shuffled Ray Dataset."""

    def ready(self) -> bool:
        return True

    def run(self, split: Any, cfg: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"epochs": [], "keys": [], "sizes": []}
        for _ in range(cfg["epochs"]):
            batches = split.iter_batches(batch_size=cfg["batch_size"], batch_format="pyarrow")
            _consume(batches, out, lambda b: b.column("key").to_numpy())
        return out

    def close(self) -> None:
        pass


def _consume(batches: Any, out: dict[str, Any], keys_of: Any) -> None:
    """Iterate one epoch (starting the clock before `iter`), keeping each batch's keys."""
    t0 = time.perf_counter()
    first = None
    keys = []
    for batch in batches:
        if first is None:
            first = time.perf_counter() - t0
        keys.append(np.array(keys_of(batch)))
    out["epochs"].append({"first_batch_s": first, "epoch_s": time.perf_counter() - t0})
    out["keys"].append(np.concatenate(keys))
    out["sizes"].append([len(k) for k in keys])


class _MemorySampler:
    """Peak proportional set size of this process and its descendants (Ray's raylets and workers).

    PSS splits each shared page among the processes that map it, so the object store's touched
    pages count once, however many workers map them.
    """

    def __init__(self, every_s: float = 0.5) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._every = every_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _tree_pss_bytes(os.getpid()))
            self._stop.wait(self._every)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"peak_memory_bytes": self.peak}


def _tree_pss_bytes(root: int) -> int:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            lines = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) * 1024 for line in lines if line.startswith("Pss:"))
    return total


def _spilled_mib() -> int | None:
    """MiB the object store has spilled to disk so far (this Ray session), or None without grpcio
    (Ray's memory summary asks the raylets over gRPC: the `bench` extra brings it)."""
    import ray

    try:
        from ray._private.internal_api import memory_summary  # private, but the only stats API

        # This session's address: with none, Ray refuses when other Ray instances run on the machine.
        summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    except ImportError:
        return None
    found = re.search(r"Spilled (\d+) MiB", summary)
    return int(found.group(1)) if found else 0


# --- cluster parts: the JPEG pipeline and the trainer-side cost -------------------------------


def cluster_parts(args: argparse.Namespace, parts: list[str]) -> dict[str, Any]:
    """The jpeg and trainer-cost parts on one local cluster of `--cluster-nodes` nodes, trainer r
    on node r; every method on the same nodes, CPUs and warm worker pool."""
    import ray

    shards = ensure_jpeg_shards(args.cache, args.images) if "jpeg" in parts else []
    cost_files = ensure_data(args.cache, args.cost_rows, COST_FILES) if "trainer-cost" in parts else []
    common = {
        "trainers": args.cluster_nodes,
        "nodes": args.cluster_nodes,
        "node_cpus": args.node_cpus,
        "store_gb_per_node": args.cluster_store_gb,
        "repeats": args.repeats,
        "quick": args.quick,
    }
    out: dict[str, Any] = {}
    cluster = start_cluster(args.cluster_nodes, args.node_cpus, args.cluster_store_gb)
    try:
        if "jpeg" in parts:
            cfg = {
                **common,
                "images": args.images,
                "shards": len(shards),
                "image_size": IMAGE_SIZE,
                "transforms": [repr(DECODE), repr(CROP)],
                "epochs": args.jpeg_epochs,
                "batch_size": JPEG_BATCH,
                "step_s": args.step_ms / 1000,
                "globalloader_ray": "TorchShufflingDataset(gl.Dataset(gl.TarShards(shards)).map(Decode).map(crop), "
                "num_trainers=4, batch_size=64, feature_columns='image'): the maps in Ray's map tasks, the crop "
                "drawn from each sample's own generator, a new one every epoch",
                "ray_data": "read_webdataset(shards, decoder=None) -> map_batches(the same Decode and crop, "
                "batch_size=64) -> random_shuffle() -> streaming_split(trainers, equal=True) -> "
                "iter_torch_batches(batch_size=64)",
                "batches_in_trainer": "torch uint8 tensors (64, 224, 224, 3) of the image column alone: Ray "
                "Data's iter_torch_batches, gl's TorchShufflingDataset(feature_columns='image')",
            }
            runs = run_rounds(
                {
                    name: lambda name=name: run_timed(name, "jpeg", shards, cfg)
                    for name in ("globalloader_ray", "ray_data")
                },
                args.repeats,
                f"jpeg, {args.cluster_nodes} nodes",
            )
            out["jpeg"] = report_timed("jpeg", cfg, runs, CLUSTER_TARGETS)
        if "trainer-cost" in parts:
            cfg = {
                **common,
                "rows": args.cost_rows,
                "files": COST_FILES,
                "payload_bytes": PAYLOAD,
                "epochs": 2,
                "batch_size": 4096,
                "step_s": args.cost_step_ms / 1000,
                "notes": "the parquet token data with a step long enough that the trainers, not the shuffle, "
                "set the pace (fetch_wall_share small): the loader's own cost in the trainer process shows",
            }
            runs = run_rounds(
                {"globalloader_ray": lambda: run_timed("globalloader_ray", "tokens", cost_files, cfg)},
                args.repeats,
                f"trainer cost, {args.cluster_nodes} nodes",
            )
            out["trainer_cost"] = report_timed(
                "trainer-cost", cfg, runs, {"trainer_cpu_share": CLUSTER_TARGETS["trainer_cpu_share"]}
            )
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def ensure_jpeg_shards(cache: pathlib.Path, images: int) -> list[str]:
    """Synthetic photos (globalloader.synthetic) written once as tar shards of IMAGES_PER_SHARD."""
    folder = make_jpeg_folder(cache / f"jpeg-{images}", n=images, size=IMAGE_SIZE)
    pattern = cache / f"jpeg-{images}-shards" / "shard-%06d.tar"
    return gl.write_shards(gl.Dataset(gl.ImageFolder(folder)), pattern, maxcount=IMAGES_PER_SHARD, progress=False)


def run_timed(name: str, pipeline: str, data: list[str], cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of `pipeline` ("jpeg", or "tokens": the parquet data, gl only) by method `name`,
    from creating the data set to every trainer's last batch, each trainer timing its fetches
    and its step."""
    import ray

    trainers = [
        ray.remote(_TimedTrainer).options(num_cpus=0, resources={f"node-{r % cfg['nodes']}": 0.01}).remote()
        for r in range(cfg["trainers"])
    ]
    ray.get([t.ready.remote() for t in trainers])
    start = time.perf_counter()
    if name == "globalloader_ray":
        shuffle = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        per_trainer = ray.get([t.run_gl.remote(pipeline, data, rank, shuffle, cfg) for rank, t in enumerate(trainers)])
    else:
        splits = _ray_data_jpeg(data).streaming_split(cfg["trainers"], equal=True)
        per_trainer = ray.get([t.run_ray_data.remote(s, cfg) for t, s in zip(trainers, splits, strict=True)])
    elapsed = time.perf_counter() - start
    ray.get([t.close.remote() for t in trainers[::-1]])
    for t in trainers:
        ray.kill(t)
    return timed_summary(per_trainer, elapsed)


def _ray_data_jpeg(shards: list[str]) -> Any:
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    raw = ray.data.read_webdataset(shards, decoder=None)  # bytes, decoded by the same code as gl's
    return raw.map_batches(_decode_and_crop, batch_size=JPEG_BATCH, batch_format="numpy").random_shuffle()


def _decode_and_crop(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data's map_batches body: gl's chain's Decode and crop on each record of the batch
    (Ray Data has no per-sample seeds: one fresh generator per batch)."""
    rng = np.random.default_rng()
    return {"image": np.stack([CROP(DECODE({"image": data}), rng=rng)["image"] for data in batch["image"]])}


class _TimedTrainer:
    """One trainer: fetches each batch (into what its step takes) and runs a fixed step on it."""

    def ready(self) -> bool:
        import torch  # noqa: F401  # imported before the clock starts, by both methods' trainers

        return True

    def run_gl(self, pipeline: str, data: list[str], rank: int, shuffle: str, cfg: dict[str, Any]) -> list[Any]:
        from globalloader.ray import ShufflingDataset
        from globalloader.ray.torch import TorchShufflingDataset

        shape = (cfg["epochs"], cfg["trainers"], cfg["batch_size"], rank)
        if pipeline == "jpeg":  # tensors of the image column, as iter_torch_batches gives Ray Data's trainers
            chain = gl.Dataset(gl.TarShards(data)).map(DECODE).map(CROP)
            self.ds = TorchShufflingDataset(chain, *shape, feature_columns="image", name=shuffle, timeout=600.0)
        else:
            self.ds = ShufflingDataset(data, *shape, name=shuffle, timeout=600.0)
        return [_consume_timed(self.ds, _same, cfg["step_s"]) for _ in range(cfg["epochs"])]

    def run_ray_data(self, split: Any, cfg: dict[str, Any]) -> list[Any]:
        batches = split.iter_torch_batches(batch_size=cfg["batch_size"])
        return [_consume_timed(batches, _ray_data_images, cfg["step_s"]) for _ in range(cfg["epochs"])]

    def close(self) -> None:
        if hasattr(self, "ds"):
            self.ds.close()


def _ray_data_images(batch: dict[str, Any]) -> Any:
    return batch["image"]


def _same(batch: Any) -> Any:
    return batch


def _rows(value: Any) -> int:
    """Rows of a batch: a tensor, or a dict of columns."""
    return len(next(iter(value.values()))) if isinstance(value, dict) else len(value)


def _consume_timed(batches: Any, take: Callable[[Any], Any], step_s: float) -> dict[str, Any]:
    """One epoch: each fetch (`iter`, `next`, then `take` making what the step consumes) timed in
    wall and in this thread's CPU, then a fixed step: a sleep, standing for an accelerator's
    step that leaves the CPU to the pipeline. `process_cpu_s` is every thread of this process
    (the loader's fetch thread, Ray's own threads) over the whole loop."""
    start, cpu_start = time.perf_counter(), time.process_time()
    fetch_wall = fetch_cpu = 0.0
    first = None
    rows = batches_seen = 0
    iterator = None
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if iterator is None:
                iterator = iter(batches)
            value = take(next(iterator))
        except StopIteration:
            break
        finally:
            fetch_wall += time.perf_counter() - t0
            fetch_cpu += time.thread_time() - c0
        if first is None:
            first = time.perf_counter() - start
        rows += _rows(value)
        batches_seen += 1
        if step_s:
            time.sleep(step_s)
    return {
        "rows": rows,
        "batches": batches_seen,
        "first_batch_s": first,
        "loop_s": time.perf_counter() - start,
        "fetch_wall_s": fetch_wall,
        "fetch_cpu_s": fetch_cpu,
        "process_cpu_s": time.process_time() - cpu_start,
    }


def timed_summary(per_trainer: list[list[dict[str, Any]]], elapsed: float) -> dict[str, Any]:
    """samples/s over all trainers, and the shares of the trainers' loop time (all epochs)."""
    epochs = [e for trainer in per_trainer for e in trainer]

    def total(key: str) -> float:
        return float(sum(e[key] for e in epochs))

    loop = total("loop_s")
    return {
        "samples_per_s": total("rows") / elapsed,
        "elapsed_s": elapsed,
        "rows_delivered": int(total("rows")),
        "batches": int(total("batches")),
        "trainer_cpu_share": total("process_cpu_s") / loop,
        "max_trainer_cpu_share": max(
            sum(e["process_cpu_s"] for e in t) / sum(e["loop_s"] for e in t) for t in per_trainer
        ),
        "fetch_cpu_share": total("fetch_cpu_s") / loop,
        "fetch_wall_share": total("fetch_wall_s") / loop,
        "fetch_cpu_ms_per_batch": 1000 * total("fetch_cpu_s") / max(total("batches"), 1),
        "process_cpu_ms_per_batch": 1000 * total("process_cpu_s") / max(total("batches"), 1),
        "first_batch_s": [max(t[e]["first_batch_s"] or 0.0 for t in per_trainer) for e in range(len(per_trainer[0]))],
        "trainers": per_trainer,
    }


def report_timed(
    part: str, cfg: dict[str, Any], runs: dict[str, list[dict[str, Any]]], targets: dict[str, float]
) -> dict[str, Any]:
    """Print and return a cluster part: per method the median over rounds [min, max] of samples/s
    and of the trainer shares; gl / Ray Data taken within each round."""
    figures = (
        "samples_per_s",
        "trainer_cpu_share",
        "fetch_cpu_share",
        "fetch_wall_share",
        "fetch_cpu_ms_per_batch",
        "process_cpu_ms_per_batch",
    )
    results = {
        name: {**{f: _spread([r[f] for r in method_runs]) for f in figures}, "runs": method_runs}
        for name, method_runs in runs.items()
    }
    ours = runs["globalloader_ray"]
    ratios = {"trainer_cpu_share": results["globalloader_ray"]["trainer_cpu_share"]}
    if "ray_data" in runs:
        ratios["vs_ray_data"] = _spread(
            [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(ours, runs["ray_data"], strict=True)]
        )
    met = {
        k: ratios[k]["median"] <= v if k == "trainer_cpu_share" else ratios[k]["median"] >= v
        for k, v in targets.items()
    }
    expected = cfg.get("images", cfg.get("rows")) * cfg["epochs"]
    print(
        f"\n{part}: {expected // cfg['epochs']:,} samples x {cfg['epochs']} epochs, {cfg['trainers']} trainers on "
        f"{cfg['nodes']} nodes x {cfg['node_cpus']} CPU, batch {cfg['batch_size']}, step {cfg['step_s'] * 1000:g} ms "
        f"(a sleep); median of {cfg['repeats']} rounds [min, max]; shares of the trainers' loop time"
    )
    print(
        f"{'method':18s} {'samples/s':>26s} {'process CPU':>20s} {'CPU in fetch':>20s} {'wall in fetch':>20s} "
        f"{'CPU ms/batch':>13s} {'delivered':>10s}"
    )
    for name, r in results.items():
        shares = " ".join(
            f"{r[f]['median']:6.3f} [{r[f]['min']:.3f},{r[f]['max']:.3f}]"
            for f in ("trainer_cpu_share", "fetch_cpu_share", "fetch_wall_share")
        )
        rate = r["samples_per_s"]
        delivered = min(run["rows_delivered"] for run in r["runs"])
        spread = f"{rate['median']:,.0f} [{rate['min']:,.0f}, {rate['max']:,.0f}]"
        per_batch = f"{r['process_cpu_ms_per_batch']['median']:.2f}"
        print(f"{name:18s} {spread:>26s} {shares} {per_batch:>13s} {delivered:>10,}")
    for k, v in ratios.items():
        target = ""
        if k in targets:
            sign = "<=" if k == "trainer_cpu_share" else ">="
            target = f"target {sign} {targets[k]:<6}  {'met' if met[k] else 'NOT met'}"
        print(f"  {k:26s} {v['median']:8.3f} [{v['min']:.3f}, {v['max']:.3f}]  {target}")
    return {
        "config": cfg,
        "machine": _machine(),
        "rows_expected": expected,
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "targets_met": met,
    }


# --- metrics --------------------------------------------------------------------------------


def summarize(
    epochs: list[dict[str, Any]], orders: list[tuple[list[np.ndarray], list[Any]]], elapsed: float, cfg: dict[str, Any]
) -> dict[str, Any]:
    """rows/s and shuffle quality from each epoch's delivered keys (rank 0's stream first)."""
    n = cfg["rows"]
    delivered = sum(len(k) for keys, _ in orders for k in keys)
    file_starts = np.linspace(0, n, cfg["files"] + 1).astype(np.int64)
    positions, quality = [], []
    for keys, sizes in orders:
        order = np.concatenate(keys)
        position = np.full(n, -1, np.int64)
        position[order] = np.arange(len(order))
        positions.append(position)
        per_rank = [abs(_pearson(np.argsort(np.argsort(k)), np.arange(len(k)))) for k in keys]
        files_per_batch = []
        for k, s in zip(keys, sizes, strict=True):
            file_ids = np.searchsorted(file_starts, k, side="right") - 1
            cuts = np.cumsum([0, *s])
            files_per_batch += [
                len(np.unique(file_ids[a:b])) for a, b in itertools.pairwise(cuts) if b - a == cfg["batch_size"]
            ]
        quality.append(
            {
                "rows": len(order),
                "distinct_rows": len(np.unique(order)),
                "spearman_input_vs_output": _pearson(order, np.arange(len(order))),
                "max_abs_spearman_within_trainer": max(per_rank),
                "files_per_full_batch_mean": float(np.mean(files_per_batch)),
                "files_per_full_batch_min": int(np.min(files_per_batch)),
            }
        )
    for e in range(1, len(positions)):
        both = (positions[e - 1] >= 0) & (positions[e] >= 0)
        quality[e]["corr_with_previous_epoch"] = _pearson(positions[e - 1][both], positions[e][both])
    for epoch, q in zip(epochs, quality, strict=True):
        epoch.update(q)
    return {"rows_per_s": delivered / elapsed, "elapsed_s": elapsed, "rows_delivered": delivered, "epochs": epochs}


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation; on ranks (as here) it is Spearman's."""
    a = a.astype(np.float64) - a.mean()
    b = b.astype(np.float64) - b.mean()
    return float((a @ b) / np.sqrt((a @ a) * (b @ b)))


# --- report ---------------------------------------------------------------------------------


def report(cfg: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print and return the parquet part: medians over rounds with their range; ratios are taken
    within each round first."""
    ours, ceiling = runs["globalloader_ray"], runs["numpy_ceiling"]
    per_round: dict[str, list[float]] = {
        "vs_numpy_ceiling": [a["rows_per_s"] / b["rows_per_s"] for a, b in zip(ours, ceiling, strict=True)],
        "later_first_batch_s": [max([e["first_batch_s"] for e in r["epochs"][1:]] or [0.0]) for r in ours],
        "abs_spearman": [
            max(max(abs(e["spearman_input_vs_output"]), e["max_abs_spearman_within_trainer"]) for e in r["epochs"])
            for r in ours
        ],
        "files_per_batch": [min(e["files_per_full_batch_mean"] for e in r["epochs"]) for r in ours],
    }
    if "ray_data" in runs:
        per_round["vs_ray_data"] = [
            a["rows_per_s"] / b["rows_per_s"] for a, b in zip(ours, runs["ray_data"], strict=True)
        ]
    cluster = next((name for name in runs if name.endswith("_nodes")), None)
    if cluster:
        per_round["cluster_vs_numpy_ceiling"] = [
            a["rows_per_s"] / b["rows_per_s"]
            for a, b in zip(runs[cluster], runs["numpy_ceiling_cluster_phase"], strict=True)
        ]
    ratios = {name: _spread(values) for name, values in per_round.items()}
    met = {
        k: (v["median"] <= TARGETS[k] if k in LOWER_IS_BETTER else v["median"] >= TARGETS[k])
        for k, v in ratios.items()
        if k in TARGETS
    }
    results = {
        name: {"rows_per_s": _spread([r["rows_per_s"] for r in method_runs]), "runs": method_runs}
        for name, method_runs in runs.items()
    }
    summary = {
        "config": cfg,
        "machine": _machine(),
        "results": results,
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": met,
    }

    print(
        f"\n{cfg['rows']:,} rows x {cfg['epochs']} epochs, {cfg['files']} files, {cfg['trainers']} trainers, "
        f"batch {cfg['batch_size']}, {cfg['cpus']} CPUs; median of {cfg['repeats']} rounds [min, max]"
    )
    print(f"{'method':30s} {'rows/s':>28s} {'first batches (s), median run':>30s} {'peak mem GiB':>13s}")
    for name, method_runs in runs.items():
        rate = results[name]["rows_per_s"]
        middle = sorted(method_runs, key=lambda r: r["rows_per_s"])[len(method_runs) // 2]
        firsts = " ".join(f"{e['first_batch_s']:.2f}" for e in middle["epochs"])
        print(
            f"{name:30s} {rate['median']:10,.0f} [{rate['min']:,.0f}, {rate['max']:,.0f}] {firsts:>30s} "
            f"{max(r['peak_memory_bytes'] for r in method_runs) / 2**30:13.2f}"
        )
    for k, v in ratios.items():
        target = ""
        if k in TARGETS:
            sign = "<=" if k in LOWER_IS_BETTER else ">="
            target = f"target {sign} {TARGETS[k]:<6}  {'met' if met[k] else 'NOT met'}"
        print(f"  {k:26s} {v['median']:8.3f} [{v['min']:.3f}, {v['max']:.3f}]  {target}")
    return summary


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_average_at_end": os.getloadavg(),
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


if __name__ == "__main__":
    sys.exit(main())
