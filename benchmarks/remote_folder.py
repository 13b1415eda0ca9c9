"""Remote data, image-folder mode (`remote.py --mode folder`): one JPEG per object.

`--samples` (1,000) synthetic JPEGs (remote.py's pictures, ~15 KB) as `folder/c<k>/<i>.jpg` on one
moto S3 server behind the latency proxy (`--latency`, default 20 and 50 ms per request), and the
same folder on local disk. Every system runs a random resized crop (112 px) per sample, batches
of 32, `--workers` (2) workers, in a fresh process with an empty cache folder:

- gl: `gl.Dataset(gl.ImageFolder("s3://...")).shuffle(seed=0).map(crop).batch(32)` in
  `gl.Loader`: cold epoch (samples/s from the start of the job: the imports it makes then, the
  listing and the loader count; globalloader itself is imported before, by this module, in every
  system's process), warm epoch (the next, same process), time to first batch, bytes downloaded /
  folder size, the peak of GETs in flight (at the proxy, and the pool's own counter), and its
  startup (`startup_s`: the job's start to the loader made, before the first GET) with the
  cold epoch's rate after it, against moto alone; the CPU per sample of the loader's process and
  of its workers over the cold epoch after its startup (`_tree_cpu`; the torch peers too);
- gl-local: the same chain over the local folder, the first ceiling;
- server: the rate moto serves those objects with 64 GETs in flight and no decode (aiobotocore
  through s3fs's async calls), the second ceiling; the goal is measured against the lower;
- gl-fetch: the pool alone (`Files.prefetch` of every object, no decode): the client's CPU
  seconds per object (its process's CPU time over the objects, from the end of its listing);
- torch-s3fs-2 / -16: a torch DataLoader (2 and 16 workers) whose dataset reads each object with
  s3fs `cat_file`;
- s3torch-2 / -16: Amazon's s3torchconnector `S3MapDataset` in a torch DataLoader;
- ray: Ray Data's `read_images` (pyarrow's S3 filesystem at the proxy; Ray decodes) and the same
  crop in `map`, on a local Ray instance of `--workers` CPUs, timed once it runs (`ray_init_s`
  apart).

Each latency has the same rows; gl's cold epoch is compared with the ceiling (goal: 0.8 of it at
20 ms, 0.7 at 50 ms) and with each peer (goal: 1.4x s3torchconnector with 16 workers). A peer that
does not import or fails is run no further and its row says why (`failed` in the JSON), never
dropped. The torch peers' startup is timed the same way (imports, listing, DataLoader made), and
gl is also compared with them timed from after `import torch` (`torch_import_s`: a training job
imports torch whatever its loader, and gl's job never does). globalloader's bytecode is written
first (`_write_bytecode`), as an install has it. Median of `--rounds` (3) with min and max; JSON
in benchmarks/results/remote_folder.json; at the end, the table of docs/remote.md (a row per
figure, a column per latency).

    python benchmarks/remote.py --mode folder [--samples 1000] [--rounds 3] [--latency 0.02 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from remote import _cpu_seconds, _jpeg  # beside this file
from tqdm.auto import tqdm

from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

RESULTS = Path(__file__).parent / "results" / "remote_folder.json"
SYSTEMS = ("gl", "gl-local", "server", "gl-fetch", "torch-s3fs-2", "torch-s3fs-16", "s3torch-2", "s3torch-16", "ray")
BATCH = 32
CROP = 112
SERVER_IN_FLIGHT = 64
GOAL_VS_CEILING = {0.02: 0.8, 0.05: 0.7}  # the goal for gl's cold epoch, by latency (s)
GOALS = {"gl_vs_s3torch-16": 1.4, "first_batch_s": 1.0}
PEERS = {
    "s3torch-2": "s3torchconnector, 2 workers",
    "s3torch-16": "s3torchconnector, 16 workers",
    "torch-s3fs-2": "DataLoader + s3fs, 2 workers",
    "torch-s3fs-16": "DataLoader + s3fs, 16 workers",
    "ray": "Ray Data read_images",
}
CLASSES = 10


def crop(sample: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Decode a JPEG and take a random resized crop (the per-sample work every system does)."""
    from PIL import Image

    from globalloader import vision

    data = sample.get("image", sample.get("bytes"))
    key = str(sample.get("__key__", ""))
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return {"image": np.asarray(vision.random_resized_crop(image, CROP, rng)), "label": int(sample.get("label", 0))}


def _write(root: Path, samples: int, proxy: str, bucket: str) -> dict[str, Any]:
    from globalloader import storage

    local = root / "folder"
    total = 0
    for i in tqdm(range(samples), desc="pictures", leave=False):
        path = local / f"c{i % CLASSES}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _jpeg(i)
        path.write_bytes(data)
        total += len(data)
    fs = storage.Store(options(proxy)).filesystem(f"s3://{bucket}")[0]
    fs.put(f"{local}/", f"{bucket}/folder/", recursive=True)
    return {"url": f"s3://{bucket}/folder", "local": str(local), "bytes": total, "samples": samples}


# -- one job (a child process) -------------------------------------------------------------------
def _tree_cpu() -> tuple[float, float]:
    """CPU seconds so far of this process (the loader's: its pool, its main thread) and of its
    descendants (the loader's workers), as remote.py's `_cpu_seconds` counts the whole tree."""
    own = os.times()
    tree = _cpu_seconds()
    if tree is None:
        raise RuntimeError("this benchmark reads the workers' CPU from /proc, which lists no children here")
    return own.user + own.system, tree - own.user - own.system


def _stats(proxy: str) -> dict[str, int]:
    import urllib.request

    with urllib.request.urlopen(f"{proxy}/__stats__", timeout=30) as response:
        return dict(json.loads(response.read()))


def _epochs(loader: Any, start: float, epochs: int, proxy: str) -> list[dict[str, Any]]:
    out, begin = [], _stats(proxy)
    for epoch in range(epochs):
        t0, first, samples, cpu = time.perf_counter(), None, 0, _tree_cpu()
        for batch in loader:
            if first is None:
                first = time.perf_counter() - (start if epoch == 0 else t0)
            samples += len(batch["label"])
        used = [after - before for after, before in zip(_tree_cpu(), cpu, strict=True)]
        now = _stats(proxy)
        seconds = time.perf_counter() - (start if epoch == 0 else t0)
        out.append(
            {
                "samples": samples,
                "seconds": seconds,
                "first_batch": first,
                "bytes": now["bytes"] - begin["bytes"],
                "cpu_s": {"loader": used[0], "workers": used[1]},
            }
        )
        begin = now
    return out


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    system, proxy, workers = spec["system"], spec["proxy"], spec["workers"]
    start = time.perf_counter()
    if system in ("gl", "gl-local"):
        import globalloader as gl

        remote = system == "gl"
        src = gl.ImageFolder(
            spec["url"] if remote else spec["local"], storage_options=options(proxy) if remote else None
        )
        chain = gl.Dataset(src).shuffle(seed=0).map(crop).batch(BATCH)
        with gl.Loader(chain, workers=workers) as loader:
            ready = time.perf_counter() - start
            result: dict[str, Any] = {"epochs": _epochs(loader, start, 2, proxy), "startup_s": ready}
        result["pool"] = src.store.fetch_counters()
        return result
    if system == "gl-fetch":
        import globalloader as gl

        src = gl.Files(spec["url"], "*.jpg", storage_options=options(proxy))
        cpu0, t0 = sum(_tree_cpu()), time.perf_counter()
        src.prefetch(np.arange(len(src)))
        while (c := src.store.fetch_counters())["fetched"] + c["failed"] < len(src):
            time.sleep(0.005)
        return {"objects": len(src), "seconds": time.perf_counter() - t0, "cpu_s": sum(_tree_cpu()) - cpu0, "pool": c}
    if system == "server":
        return _server_rate(spec)
    if system.startswith(("torch-s3fs", "s3torch")):
        import torch

        torch_import = time.perf_counter() - start  # a training job pays it whatever its loader
        dataset = _S3fsImages(spec) if system.startswith("torch-s3fs") else _s3torch(spec)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=BATCH,
            shuffle=True,
            num_workers=int(system.rsplit("-", 1)[1]),
            persistent_workers=True,
            multiprocessing_context="fork",
        )
        ready = time.perf_counter() - start
        return {"epochs": _epochs(loader, start, 2, proxy), "startup_s": ready, "torch_import_s": torch_import}
    if system == "ray":
        return _ray(spec, start)
    raise SystemExit(f"unknown system {system}")


def _server_rate(spec: dict[str, Any]) -> dict[str, Any]:
    """Objects/s the server answers with SERVER_IN_FLIGHT GETs in flight, no decode."""
    from globalloader import storage

    fs = storage.Store(options(spec["proxy"])).filesystem(spec["url"])[0]
    names = sorted(fs.find(spec["url"]))

    async def all_of() -> int:
        gate = asyncio.Semaphore(SERVER_IN_FLIGHT)

        async def one(name: str) -> int:
            async with gate:
                return len(await fs._cat_file(name))

        return sum(await asyncio.gather(*(one(n) for n in names)))

    from fsspec.asyn import sync

    t0 = time.perf_counter()
    got = sync(fs.loop, all_of)
    return {"objects": len(names), "seconds": time.perf_counter() - t0, "bytes": got}


class _S3fsImages:
    """A map-style dataset reading each object with s3fs (a client per worker process)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import s3fs

        self.opts = options(spec["proxy"])
        fs = s3fs.S3FileSystem(**self.opts)
        self.names = sorted(fs.find(spec["url"]))
        self._fs: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import s3fs

        if self._pid != os.getpid():
            self._fs, self._pid = s3fs.S3FileSystem(**self.opts, skip_instance_cache=True), os.getpid()
        name = self.names[index]
        return crop({"image": self._fs.cat_file(name), "__key__": name})


def _s3torch(spec: dict[str, Any]) -> Any:
    from s3torchconnector import S3ClientConfig, S3MapDataset  # type: ignore[import-not-found]

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    return S3MapDataset.from_prefix(
        spec["url"] + "/",
        region="us-east-1",
        endpoint=spec["proxy"],
        transform=lambda obj: crop({"image": obj.read(), "__key__": obj.key}),
        s3client_config=S3ClientConfig(force_path_style=True),
    )


def _ray(spec: dict[str, Any], start: float) -> dict[str, Any]:
    """Ray Data's `read_images` (decoded by Ray) with the same random resized crop per image.

    Timed from the running Ray instance (`ray_init_s` apart): a Ray user's cluster is up before
    the data is read, as torch's workers are started within the epoch."""
    import pyarrow.fs
    import ray
    from PIL import Image

    from globalloader import vision

    # address="local": a Ray instance of its own, never another one running on the machine.
    ray.init(address="local", num_cpus=spec["workers"], include_dashboard=False, log_to_driver=False)
    ray_init_s, start = time.perf_counter() - start, time.perf_counter()
    fs = pyarrow.fs.S3FileSystem(
        access_key="testing", secret_key="testing", endpoint_override=spec["proxy"], scheme="http", region="us-east-1"
    )

    def ray_crop(row: dict[str, Any]) -> dict[str, Any]:
        rng = np.random.default_rng([0, zlib.crc32(row["path"].encode())])
        return {"image": np.asarray(vision.random_resized_crop(Image.fromarray(row["image"]), CROP, rng))}

    out, begin = [], _stats(spec["proxy"])
    for epoch in range(2):
        t0 = time.perf_counter()
        ds = ray.data.read_images(spec["url"].removeprefix("s3://"), filesystem=fs, mode="RGB", include_paths=True)
        first, samples = None, 0
        for batch in ds.map(ray_crop).iter_batches(batch_size=BATCH):
            if first is None:
                first = time.perf_counter() - (start if epoch == 0 else t0)
            samples += len(batch["image"])
        now = _stats(spec["proxy"])
        seconds = time.perf_counter() - (start if epoch == 0 else t0)
        out.append(
            {"samples": samples, "seconds": seconds, "first_batch": first, "bytes": now["bytes"] - begin["bytes"]}
        )
        begin = now
    return {"epochs": out, "ray_init_s": ray_init_s}


# -- the session ---------------------------------------------------------------------------------
def _write_bytecode() -> None:
    """globalloader's bytecode written beside its source, as installing it writes it: in a source
    checkout where bytecode is not written (PYTHONDONTWRITEBYTECODE), every process would compile
    the modules it imports, those imported within a timed job too (the storage client's, the
    decode path's in each worker), which an installed library never does; the peers are installed."""
    import compileall

    import globalloader

    compileall.compile_dir(Path(globalloader.__file__).parent, quiet=1)


def _available(system: str) -> str | None:
    """Why a peer cannot run here, or None."""
    module = {"s3torch": "s3torchconnector", "ray": "ray.data"}.get(system.split("-")[0])
    if module is None:
        return None
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{module} does not import: {probe.stderr.strip().splitlines()[-1:]}"


def _run(system: str, data: dict[str, Any], proxy: FaultProxy, workers: int, left: list[Path]) -> dict[str, Any]:
    """One round of `system` in a fresh process: its figures, or {"error": why it failed}. Its
    scratch folder (gl's cache) joins `left`, removed at the end of the benchmark: on ext4 without
    a journal, creating a file skips one by one the inodes freed in the last minute (six while
    their inode table's block is not written back: the kernel's RECENTCY_MIN and RECENTCY_DIRTY),
    so a gl run after another run's 1,000 entries were removed paid up to a millisecond of kernel
    CPU per entry it wrote (the peers write none)."""
    scratch = Path(tempfile.mkdtemp(prefix="gl-folder-bench-"))
    left.append(scratch)
    env = dict(os.environ, GLOBALLOADER_CACHE_DIR=str(scratch / "gl-cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    spec = {"system": system, "proxy": proxy.url, "workers": workers, **data}
    try:
        proxy.most_in_flight = 0
        server_cpu = os.times()
        proc = subprocess.run(
            [sys.executable, __file__, "--job", json.dumps(spec)], capture_output=True, text=True, env=env, timeout=1800
        )
        after = os.times()
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            why = f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1]
            tqdm.write(f"{system} failed ({why})")
            return {"error": why}
        result: dict[str, Any] = json.loads(lines[-1])
        result["proxy_peak_in_flight"] = proxy.most_in_flight
        result["server_cpu_s"] = after.user + after.system - server_cpu.user - server_cpu.system
        return result
    except subprocess.TimeoutExpired:
        return {"error": "no result within 1800 s"}


def _summary(values: list[float | None]) -> dict[str, float] | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "n": len(known)}


def _digest(runs: dict[str, list[Any]], data: dict[str, Any], latency: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system, rounds in runs.items():
        ok = [r for r in rounds if "error" not in r]
        errors = [r["error"] for r in rounds if "error" in r]
        if not ok:
            out[system] = {"failed": errors}  # recorded, not dropped: the table says why
            continue
        if system in ("server", "gl-fetch"):
            out[system] = {"objects_per_s": _summary([r["objects"] / r["seconds"] for r in ok])}
            if system == "gl-fetch":
                out[system]["client_cpu_ms_per_object"] = _summary([1e3 * r["cpu_s"] / r["objects"] for r in ok])
                out[system]["peak_in_flight"] = _summary([r["pool"]["peak_in_flight"] for r in ok])
        else:
            cold, warm = [r["epochs"][0] for r in ok], [r["epochs"][1] for r in ok]
            out[system] = {
                "cold_samples_per_s": _summary([e["samples"] / e["seconds"] for e in cold]),
                "warm_samples_per_s": _summary([e["samples"] / e["seconds"] for e in warm]),
                "first_batch_s": _summary([e["first_batch"] for e in cold]),
                "cold_bytes_x": _summary([e["bytes"] / data["bytes"] for e in cold]),
                "warm_bytes_x": _summary([e["bytes"] / data["bytes"] for e in warm]),
                "proxy_peak_in_flight": _summary([r["proxy_peak_in_flight"] for r in ok]),
                # The client's CPU per sample over the cold epoch after its startup, by process.
                "cold_cpu_ms_per_sample": {
                    part: _summary([1e3 * e["cpu_s"][part] / e["samples"] for e in cold if "cpu_s" in e])
                    for part in ("loader", "workers")
                },
                "exact": all(e["samples"] == data["samples"] for r in ok for e in r["epochs"]),
            }
            # The cold epoch timed from after its startup (not Ray's: it lists once it runs), and
            # a torch peer's from after `import torch`.
            for part, rate in (("startup_s", "after_startup"), ("torch_import_s", "cold_without_torch_import")):
                if all(part in r for r in ok):
                    out[system][part] = _summary([r[part] for r in ok])
                    out[system][f"{rate}_samples_per_s"] = _summary(
                        [e["samples"] / (e["seconds"] - r[part]) for r, e in zip(ok, cold, strict=True)]
                    )
            if system == "gl":
                out[system]["pool_peak_in_flight"] = _summary([r["pool"].get("peak_in_flight") for r in ok])
            if system == "ray":
                out[system]["ray_init_s"] = _summary([r["ray_init_s"] for r in ok])
        if errors:
            out[system]["failed"] = errors
    gl_cold = out.get("gl", {}).get("cold_samples_per_s")
    local, server = out.get("gl-local", {}).get("cold_samples_per_s"), out.get("server", {}).get("objects_per_s")
    ceilings = [c["median"] for c in (local, server) if c]
    out["goals"] = {"cold_vs_ceiling": GOAL_VS_CEILING.get(round(latency, 3)), **GOALS}
    if ceilings and gl_cold:
        out["ceiling_samples_per_s"] = min(ceilings)
        out["gl_cold_vs_ceiling"] = gl_cold["median"] / min(ceilings)
    after = out.get("gl", {}).get("after_startup_samples_per_s")
    if after and server:
        out["gl_after_startup_vs_server"] = after["median"] / server["median"]
    if gl_cold:
        out["gl_cold_vs_peer"] = {
            peer: gl_cold["median"] / row["cold_samples_per_s"]["median"]
            for peer in PEERS
            if (row := out.get(peer, {})).get("cold_samples_per_s")
        }
        # The same, the torch peers timed from after `import torch` (gl's job never imports it).
        out["gl_cold_vs_peer_without_torch_import"] = {
            peer: gl_cold["median"] / row["cold_without_torch_import_samples_per_s"]["median"]
            for peer in PEERS
            if (row := out.get(peer, {})).get("cold_without_torch_import_samples_per_s")
        }
    return out


def _cell(figure: dict[str, float] | None, digits: int = 0) -> str:
    """`median [min, max]`, or "-" when there is no figure."""
    if not figure:
        return "-"
    return f"{figure['median']:,.{digits}f} [{figure['min']:,.{digits}f}, {figure['max']:,.{digits}f}]"


def _ratio(value: float | None, goal: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" + (f" (goal >= {goal})" if goal else "")


def _table(report: dict[str, Any]) -> list[str]:
    """The docs' tables (median [min, max] of rounds): gl and its ceilings, a row per figure and
    a column per latency; then each system in a row per latency, with gl's ratio to it."""
    columns = list(report["latency"].items())
    lines = ["| | " + " | ".join(f"{name} a request" for name, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]

    def row(label: str, cell: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(d) for _, d in columns) + " |")

    def figure(system: str, key: str, digits: int = 0) -> Any:
        return lambda digest: _cell(digest.get(system, {}).get(key), digits)

    row("gl cold epoch, samples/s", figure("gl", "cold_samples_per_s"))
    row("gl warm epoch, samples/s", figure("gl", "warm_samples_per_s"))
    row("gl time to first batch, s", figure("gl", "first_batch_s", 2))
    row("gl bytes downloaded cold / warm (x the folder)", lambda d: _bytes(d.get("gl", {})))
    row("gl peak GETs in flight (at the proxy)", figure("gl", "proxy_peak_in_flight"))
    row("ceiling: local disk, same chain, samples/s", figure("gl-local", "cold_samples_per_s"))
    row(f"ceiling: moto, {SERVER_IN_FLIGHT} GETs in flight, objects/s", figure("server", "objects_per_s"))
    row("gl cold / ceiling", lambda d: _ratio(d.get("gl_cold_vs_ceiling"), d["goals"]["cold_vs_ceiling"]))
    row("gl startup (imports, listing, loader made), s", figure("gl", "startup_s", 2))
    row("gl cold after its startup, samples/s", figure("gl", "after_startup_samples_per_s"))
    row("gl cold after its startup / moto alone", lambda d: _ratio(d.get("gl_after_startup_vs_server")))
    row("client CPU per object (pool alone), ms", figure("gl-fetch", "client_cpu_ms_per_object", 2))
    for system in ("gl", "gl-local"):
        for part, who in (("loader", "its process"), ("workers", "its workers")):
            row(
                f"{system} cold after its startup, CPU per sample of {who}, ms",
                lambda d, system=system, part=part: _cell(
                    d.get(system, {}).get("cold_cpu_ms_per_sample", {}).get(part), 2
                ),
            )
    heads = ["system", "latency", "cold samples/s", "gl cold / it", "the same, its torch import apart", "startup, s"]
    lines += ["", "| " + " | ".join([*heads, "peak GETs in flight", "bytes cold / warm (x)"]) + " |", "|---" * 8 + "|"]
    for system, label in {"gl": f"globalloader, {report['workers']} workers", **PEERS}.items():
        for name, digest in columns:
            got = digest.get(system)
            if got is None:
                continue  # not asked for (--only)
            if "cold_samples_per_s" not in got:
                lines.append(f"| {label} | {name} | not run: {got['failed'][0]} | | | | | |")
                continue
            goal = GOALS["gl_vs_s3torch-16"] if system == "s3torch-16" else None
            ratio = "" if system == "gl" else _ratio(digest.get("gl_cold_vs_peer", {}).get(system), goal)
            apart = digest.get("gl_cold_vs_peer_without_torch_import", {}).get(system)
            cells = [
                _cell(got["cold_samples_per_s"]),
                ratio,
                _ratio(apart) if apart else "",
                _cell(got.get("startup_s"), 2),
            ]
            cells += [_cell(got["proxy_peak_in_flight"]), _bytes(got)]
            lines.append(f"| {label} | {name} | " + " | ".join(cells) + " |")
    return lines


def _bytes(row: dict[str, Any]) -> str:
    if "cold_bytes_x" not in row:
        return "-"
    return f"{row['cold_bytes_x']['median']:.2f} / {row['warm_bytes_x']['median']:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency", type=float, nargs="+", default=[0.02, 0.05], help="seconds added per request")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="systems to run, comma-separated")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(_job(json.loads(args.job))), flush=True)
        return
    _write_bytecode()
    wanted = [s for s in args.only.split(",") if s]
    skipped = {s: why for s in wanted if (why := _available(s)) is not None}
    for system, why in skipped.items():
        print(f"skipped {system}: {why}")
    server = MotoServer()
    proxy = FaultProxy(server.port)
    root = Path(tempfile.mkdtemp(prefix="gl-folder-data-"))
    left: list[Path] = []  # the runs' scratch folders (see `_run`)
    try:
        data = _write(root, args.samples, proxy.url, new_bucket(proxy.url))
        report: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "samples": args.samples,
            "folder_bytes": data["bytes"],
            "workers": args.workers,
            "rounds": args.rounds,
            "skipped": skipped,
            "latency": {},
        }
        systems = [s for s in wanted if s not in skipped]
        for latency in args.latency:
            proxy.latency = latency
            runs: dict[str, list[Any]] = {system: [{"error": why}] for system, why in skipped.items()}
            with tqdm(total=args.rounds * len(systems), desc=f"latency {latency * 1e3:.0f} ms") as bar:
                for _ in range(args.rounds):
                    for system in systems:
                        runs.setdefault(system, []).append(_run(system, data, proxy, args.workers, left))
                        bar.update()
            report["latency"][f"{latency * 1e3:.0f} ms"] = _digest(runs, data, latency)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        print("\n".join(["", f"image folder, {args.samples} objects, {args.workers} workers", *_table(report)]))
        print(f"results: {args.output}")
    finally:
        proxy.stop()
        server.stop()
        for folder in [root, *left]:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
