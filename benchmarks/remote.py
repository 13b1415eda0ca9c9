"""Remote data: globalloader vs Mosaic Streaming and LitData on a local S3 server.

The same JPEG samples + labels (synthetic pictures, 160x160, about 15 KB each; `--samples`
3000 in 15 shards of about 3 MB: the ~64 MB shards of a real set scaled down to this machine)
in each system's own format on one moto S3 server (server mode, loopback), behind a proxy
that adds `--latency` per request and counts the bytes it serves (`globalloader.demo.s3`):

- globalloader: tar shards, `gl.Dataset(gl.TarShards("s3://...")).shuffle(seed=0, window=2)
  .map(decode).batch(32)` in `gl.Loader(workers=2)`; and the same chain over the same shards on
  local disk (the baseline the goals name);
- Mosaic Streaming: MDS shards, `StreamingDataset(remote=, local=, shuffle=True)`;
- LitData: `litdata.optimize` chunks, `StreamingDataset(input_dir=Dir(cache, url), shuffle=True)`;

the peers in a torch DataLoader(num_workers=2, batch_size=32), decoding in their workers. Each run
is a fresh process with an empty cache folder: the cold epoch (samples/s from the construction
of the dataset, time to first batch, bytes downloaded / the format's size), then a warm second
epoch in the same process. Then 2 jobs at once on one machine (one cache folder): both cold
epochs' bytes / the dataset, and the slower job's time; globalloader also with `share=True` (the
decode as its shared map; K = 1, 2, 4 shared vs independent: remote_share.py).
Median of `--rounds` (3) with min and max; JSON in benchmarks/results/remote.json.

Where globalloader's cold epoch goes, per round (`phases`): the seconds to construct the source
(for S3: importing the client, making it, listing the shards), to index it (`len()`: the
sidecars), the setup (`setup_s`: from constructing the source to the first batch asked for), the
CPU seconds of the job's processes (the loader's and all its workers') over the cold epoch with
its setup (`cold_cpu_s`) and without (`cold_epoch_cpu_s`), and those of the S3 server's process
(this one: moto and the proxy, which share the machine's cores with the job; the local-disk
baseline does not pay them) over the same spans (`server_cpu_s`: the epoch alone;
`server_setup_cpu_s`: the setup), each read from /proc by the job at the same instants. For every
system, the client's CPU seconds per GiB downloaded in the cold epoch (`client_cpu_s_per_gib` with
the setup, imports included; `client_epoch_cpu_s_per_gib` without; `client_download_cpu_s_per_gib`:
the cold epoch's CPU less the warm epoch's, `warm_cpu_s`: what downloading costs beyond decoding),
and for gl the ceiling issue
39 sets (`cold_ceiling`): cold wall <= 1.1 x (warm wall + server CPU s / cores), both for the
epoch alone (`epoch`: the cold epoch from its first batch asked for) and with the setup
(`with_setup`: from constructing the source), the warm epoch alone in both. The floor of
globalloader's cold epoch is measured too, in a fresh process per round with no decoding: the
steps that come one after the other before any remote shard can be decoded (import the S3 client
s3fs, make its client, list the shards, read the sidecars all at once, download the first shard
alone), then the other shards 8 at once. The best cold epoch this chain can have is the local
one with those steps in place of local disk's own construction and indexing, every other
download hidden behind decoding (`best_cold_vs_local_disk` in the ratios).

The peers run under their own interpreter when `--peers-python` (default
$GLOBALLOADER_PEERS_PYTHON, built by .ci/peers-env) names one, their formats written by it too;
else in this one, where they must be installed.

Peers are installed without their dependencies (`pip install --no-deps mosaicml-streaming
litdata`, then their own needs by hand), so that they cannot pull another torch. Mosaic imports
torchvision at import time, which does not load beside the CPU torch wheel: an empty stand-in
module is put in its place (only `streaming.vision`, unused here, needs it). LitData's obstore
client refuses http:// endpoints unless `allow_http` is in its client options: it is set here.

    python benchmarks/remote.py [--samples 3000] [--rounds 3] [--latency 0 0.02] [--only gl,mosaic,litdata]
        [--peers-python PYTHON]

`--mode folder` measures a folder of one object per image instead (see remote_folder.py).

Larger than the disk: `--cache-limit-fraction 0.25` adds the row `gl limit`, globalloader's same
chain with `cache_limit` a quarter of the dataset and a window of `--limit-window` (1) shards,
over `--limit-epochs` (3) epochs in one process (each worker keeps two windows open, so with 2
workers a window of 1 leaves 7.5 - 4 shards of the quarter for the read-ahead, as docs/remote.md
sizes it; the unlimited rows read windows of 2): per epoch the bytes downloaded / the dataset
(goal <= 1.05), samples/s and its ratio to the unlimited cold epoch of the same run
(`vs_unlimited_cold`, goal >= 0.9 from the second epoch on), and the cache folder's peak size on
disk / the limit (sampled every 2 ms, downloads under way included; goal <= 1):

    python benchmarks/remote.py --only gl --latency 0.02 --no-concurrent --cache-limit-fraction 0.25
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

import globalloader
from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

RESULTS = Path(__file__).parent / "results" / "remote.json"
SYSTEMS = ("gl", "gl-local", "mosaic", "litdata")
PEERS = ("mosaic", "litdata")  # run by `--peers-python` when given (their pins conflict with ours)
SOURCES = Path(globalloader.__file__).parents[1]  # for the peers' interpreter
BATCH, WORKERS, SIDE = 32, 2, 160
KEY, SECRET = "testing", "testing"
# What `_job` measures per round: setup and epoch, the job's CPU and the S3 server's (see `_job`).
PHASES = (
    "source_s",
    "index_s",
    "setup_s",
    "cold_cpu_s",
    "cold_epoch_cpu_s",
    "warm_cpu_s",
    "server_setup_cpu_s",
    "server_cpu_s",
)
FLOOR_STEPS = ("import_s", "client_s", "list_s", "sidecars_s", "first_shard_s")  # in order, before a first decode


# -- data ----------------------------------------------------------------------------------------
def _jpeg(i: int, size: tuple[int, int] = (SIDE, SIDE)) -> bytes:
    """Picture `i`, `size` (width, height) pixels: waves and noise, ~15 KB at 160x160, ~85 KB at 500x375."""
    from PIL import Image

    width, height = size
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:height, 0:width]
    base = (np.sin(x / (7 + i % 5)) + np.cos(y / (5 + i % 3))) * 60 + 128
    third = base.T if width == height else base[::-1, ::-1]
    pixels = np.stack([base, base[::-1], third], axis=-1) + rng.normal(0, 12, (height, width, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    """The map every system runs in its workers: JPEG -> uint8 array, label -> int."""
    from PIL import Image

    image = np.asarray(Image.open(io.BytesIO(sample["jpg"])).convert("RGB"))
    cls = sample["cls"]
    return {"image": image, "cls": int(cls.decode() if isinstance(cls, bytes) else cls)}


def _write_formats(
    root: Path, samples: int, shard_samples: int, endpoint: str, bucket: str, peers_python: str | None
) -> dict[str, Any]:
    """Every format written locally (the peers' by their own writers, under `peers_python` when
    given), then uploaded; returns each format's URL and size."""
    from globalloader.sources import TarWriter

    images = [_jpeg(i) for i in tqdm(range(samples), desc="pictures", leave=False)]
    local_tars = root / "tar"
    with TarWriter(str(local_tars / "shard-%04d.tar"), maxcount=shard_samples) as writer:
        for i, data in enumerate(images):
            writer.write({"__key__": f"s{i:06d}", "jpg": data, "cls": i % 100})
    shard_bytes = sum(p.stat().st_size for p in local_tars.glob("*.tar")) // max(1, len(writer.paths))
    formats: dict[str, Any] = {"gl-local": {"url": str(local_tars / "shard-*.tar"), "dir": local_tars}}
    formats["gl"] = {"url": f"s3://{bucket}/tar/shard-*.tar", "dir": local_tars, "prefix": "tar"}
    if peers_python:
        (root / "pictures.pkl").write_bytes(pickle.dumps(images))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(SOURCES), str(Path(__file__).parent))))
        job = json.dumps({"root": str(root), "shard_bytes": shard_bytes})
        done = subprocess.run(
            [peers_python, __file__, "--write-peers", job], capture_output=True, text=True, env=env, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            sys.exit(f"the peers' writers failed under {peers_python}: {done.stderr.strip()[-2000:]}")
        written = json.loads(lines[-1])
    else:
        written = _write_peer_formats(root, images, shard_bytes)
    for name, prefix in written.items():
        formats[name] = {"url": f"s3://{bucket}/{prefix}", "dir": root / prefix, "prefix": prefix}
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=endpoint, client_kwargs={"region_name": "us-east-1"})
    for name, spec in formats.items():
        if "prefix" in spec:
            fs.put(f"{spec['dir']}/", f"{bucket}/{spec['prefix']}/", recursive=True)
        spec["bytes"] = sum(p.stat().st_size for p in Path(spec["dir"]).rglob("*") if p.is_file())
        spec["dir"] = str(spec["dir"])
        tqdm.write(f"{name}: {spec['bytes'] / 1e6:.1f} MB")
    return formats


def _write_peer_formats(root: Path, images: list[bytes], shard_bytes: int) -> dict[str, str]:
    """Mosaic's MDS shards and LitData's chunks of `images`, each by its own writer, under `root`;
    returns {system: folder name} of those written (a peer that does not import is left out)."""
    written = {}
    try:
        _stand_in_torchvision()
        from streaming import MDSWriter

        with MDSWriter(out=str(root / "mds"), columns={"jpg": "bytes", "cls": "int"}, size_limit=shard_bytes) as out:
            for i, data in enumerate(images):
                out.write({"jpg": data, "cls": i % 100})
        written["mosaic"] = "mds"
    except ImportError as exc:
        tqdm.write(f"Mosaic Streaming left out: {exc}")
    try:
        import litdata

        litdata.optimize(
            fn=_lit_sample,
            inputs=[(i, data) for i, data in enumerate(images)],
            output_dir=str(root / "lit"),
            chunk_bytes=shard_bytes,
            num_workers=1,
            mode="overwrite",
        )
        written["litdata"] = "lit"
    except ImportError as exc:
        tqdm.write(f"LitData left out: {exc}")
    return written


def _lit_sample(item: tuple[int, bytes]) -> dict[str, Any]:
    i, data = item
    return {"jpg": data, "cls": i % 100}


def _stand_in_torchvision() -> None:
    """Mosaic imports torchvision when imported; PyPI's torchvision does not load beside the CPU
    torch wheel. An empty module takes its place (Mosaic's vision datasets are not used here)."""
    try:
        import torchvision  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - any failure to import it means: stand in an empty module
        pass
    import transformers.feature_extraction_utils  # noqa: F401  (first: it probes for the real torchvision)

    for name in ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name)
        sys.modules[name] = module
    sys.modules["torchvision.datasets"].VisionDataset = object  # type: ignore[attr-defined]
    sys.modules["torchvision.datasets"].CIFAR10 = object  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms.functional"].to_tensor = None  # type: ignore[attr-defined]


# -- one job (a child process) -------------------------------------------------------------------
def _stats(proxy: str) -> int:
    with urllib.request.urlopen(f"{proxy}/__stats__", timeout=30) as response:
        return int(json.loads(response.read())["bytes"])


def _floor(spec: dict[str, Any]) -> dict[str, Any]:
    """The serial steps before a remote shard can be decoded, each timed alone in a fresh process
    with the S3 client (s3fs) and no decoding: import it, make its client, list the shards, read
    their sidecars (all at once), download the first shard alone; then the other shards 8 at once."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    import s3fs
    from fsspec.asyn import sync

    imported = time.perf_counter()
    fs = s3fs.S3FileSystem(**options(spec["proxy"]))
    sync(fs.loop, fs.set_session)
    client = time.perf_counter()
    folder = spec["url"].rsplit("/", 1)[0]
    names = fs.find(folder)
    shards, sidecars = [n for n in names if n.endswith(".tar")], [n for n in names if n.endswith(".idx")]
    listed = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        got = sum(pool.map(lambda name: len(fs.cat_file(name)), sidecars))
    indexed = time.perf_counter()
    got += len(fs.cat_file(shards[0]))
    first = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        got += sum(pool.map(lambda name: len(fs.cat_file(name)), shards[1:]))
    done = time.perf_counter()
    return {
        "import_s": imported - t0,
        "client_s": client - imported,
        "list_s": listed - client,
        "sidecars_s": indexed - listed,
        "first_shard_s": first - indexed,
        "download_s": done - first,
        "bytes": got,
    }


def _cpu_seconds() -> float | None:
    """CPU seconds of this process and its live descendants (the loader's workers, also those a
    fork server started), or None where /proc does not list children."""
    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    try:
        pending = [os.getpid()]
        while pending:
            for children in Path(f"/proc/{pending.pop()}/task").glob("*/children"):
                for pid in map(int, children.read_text().split()):
                    with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # ended meanwhile
                        total += _process_cpu(pid, waited=True)
                        pending.append(pid)
    except OSError:
        return None
    return total


def _process_cpu(pid: int, waited: bool = False) -> float:
    """CPU seconds (user + system, all threads) of the live process `pid`, from /proc; `waited`:
    with those of its children that ended and were waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(f) for f in fields[11 : 15 if waited else 13])  # utime, stime (, cutime, cstime)
    return ticks / os.sysconf("SC_CLK_TCK")


class _CachePeak:
    """The most bytes the cache folder held on disk (entries and downloads under way, each file
    once, as `ObjectCache.on_disk` counts them), sampled on a thread every 2 ms; `take()` returns
    it since the last take."""

    def __init__(self, folder: Path) -> None:
        from globalloader.storage.cache import ObjectCache

        self.cache, self.most = ObjectCache(folder), 0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.most = max(self.most, self.cache.on_disk())
            time.sleep(0.002)

    def take(self) -> int:
        most, self.most = self.most, 0
        return most


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    """One job: `seconds` of the cold epoch count from constructing the source (imports of the
    loader, listing, index, first batch: the setup), `epoch_s` from the first request of a batch;
    the job's CPU (`cold_cpu_s` with the setup, `cold_epoch_cpu_s` without) and the S3 server's
    (the session's process, which runs moto and the proxy: `server_cpu_s` over the cold epoch
    alone, `server_setup_cpu_s` over the setup), read from /proc at the same instants."""
    system, proxy, epochs = spec["system"], spec["proxy"], spec["epochs"]
    if system == "floor":
        return _floor(spec)
    server = spec.get("server_pid")
    start, start_cpu = time.perf_counter(), _cpu_seconds()
    start_server = _process_cpu(server) if server else None
    begin_bytes = _stats(proxy)
    make = {"gl": _gl_loader, "gl-local": _gl_loader, "mosaic": _mosaic_loader, "litdata": _lit_loader}[system]
    phases: dict[str, Any] = {}
    loader = make({**spec, "phases": phases, "start": start})
    peak = _CachePeak(Path(os.environ["GLOBALLOADER_CACHE_DIR"]) / "objects") if spec.get("cache_limit") else None
    result: dict[str, Any] = {"epochs": [], "phases": phases}
    for epoch in range(epochs):
        t0, first, samples = time.perf_counter(), None, 0
        t0_cpu, t0_server = _cpu_seconds(), _process_cpu(server) if server else None
        for batch in loader:
            if first is None:
                first = time.perf_counter() - (start if epoch == 0 else t0)
            samples += len(batch["cls"])
        now = time.perf_counter()
        if epoch == 0:
            end_cpu, end_server = _cpu_seconds(), _process_cpu(server) if server else None
            if None not in (start_cpu, t0_cpu, end_cpu):
                phases.update(cold_cpu_s=end_cpu - start_cpu, cold_epoch_cpu_s=end_cpu - t0_cpu)  # type: ignore[operator]
            if None not in (start_server, t0_server, end_server):
                phases.update(server_setup_cpu_s=t0_server - start_server, server_cpu_s=end_server - t0_server)  # type: ignore[operator]
            phases["setup_s"] = t0 - start
        elif epoch == 1 and None not in (t0_cpu, end_cpu := _cpu_seconds()):
            phases["warm_cpu_s"] = end_cpu - t0_cpu  # type: ignore[operator]
        now_bytes = _stats(proxy)
        result["epochs"].append(
            {
                "samples": samples,
                "seconds": now - (start if epoch == 0 else t0),
                "epoch_s": now - t0,
                "first_batch": first,
                "bytes": now_bytes - begin_bytes,
            }
        )
        if peak is not None:
            result["epochs"][-1]["cache_peak"] = peak.take()
        begin_bytes = now_bytes
    if hasattr(loader, "close"):
        loader.close()
    return result


def _gl_loader(spec: dict[str, Any]) -> Any:
    import globalloader as gl

    opts = options(spec["proxy"]) if spec["system"] == "gl" else None
    src = gl.TarShards(spec["url"], storage_options=opts, cache_limit=spec.get("cache_limit"))
    constructed = time.perf_counter()
    len(src)  # what the Loader's first iteration would do first: measured apart
    spec["phases"].update(source_s=constructed - spec["start"], index_s=time.perf_counter() - constructed)
    # Shared, the decode is the shared prefix: decoded once for both jobs (see remote_share.py).
    shared = bool(spec.get("share"))
    chain = gl.Dataset(src).shuffle(seed=0, window=spec.get("window", 2)).map(decode, shared=shared).batch(BATCH)
    share = {"share": True, "server": spec["socket"]} if shared else {}
    return gl.Loader(chain, workers=WORKERS, **share)


def _torch_loader(dataset: Any) -> Any:
    import torch

    return torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True, multiprocessing_context="fork"
    )


def _mosaic_loader(spec: dict[str, Any]) -> Any:
    _stand_in_torchvision()
    from streaming import StreamingDataset

    class Decoded(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, index: int) -> Any:
            return decode(super().__getitem__(index))

    os.environ.update(S3_ENDPOINT_URL=spec["proxy"], AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)
    dataset = Decoded(remote=spec["url"], local=spec["cache"], shuffle=True, shuffle_seed=0, batch_size=BATCH)
    return _torch_loader(dataset)


def _lit_loader(spec: dict[str, Any]) -> Any:
    import litdata
    import litdata.streaming.downloader as downloader
    from litdata.streaming.resolver import Dir

    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # an http:// endpoint (see the module doc)
    storage = {
        "endpoint_url": spec["proxy"],
        "aws_access_key_id": KEY,
        "aws_secret_access_key": SECRET,
        "region_name": "us-east-1",
    }
    dataset = litdata.StreamingDataset(
        input_dir=Dir(path=spec["cache"], url=spec["url"]), shuffle=True, seed=0, storage_options=storage
    )
    dataset.transform = decode
    return _torch_loader(dataset)


# -- the session ---------------------------------------------------------------------------------
def _child(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    """A job in a fresh process: the peers under their own interpreter (`--peers-python`), which
    finds globalloader's demo server client and this file by PYTHONPATH alone."""
    python = spec.get("peers_python") if spec["system"] in PEERS else None
    if python:
        env = dict(env, PYTHONPATH=os.pathsep.join((str(SOURCES), str(Path(__file__).parent))))
    return subprocess.Popen(
        [python or sys.executable, __file__, "--job", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(proc: subprocess.Popen[str], what: str) -> dict[str, Any] | None:
    out, err = proc.communicate(timeout=1800)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tqdm.write(f"{what} failed ({proc.returncode}): {err.strip().splitlines()[-3:] if err.strip() else out[-300:]}")
        return None
    if "Traceback" in err:
        tqdm.write(f"{what}: a traceback on stderr although it succeeded: {err.strip().splitlines()[-1]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["stderr_traceback"] = "Traceback" in err
    return result


def _run_jobs(
    system: str,
    fmt: dict[str, Any],
    proxy: FaultProxy,
    jobs: int,
    share: bool = False,
    peers_python: str | None = None,
    limit: dict[str, int] | None = None,
) -> Any:
    """One job (its result) or several at once (their results and the bytes served to all);
    `limit`: the larger-than-disk row's cache_limit, epochs and window."""
    scratch = Path(tempfile.mkdtemp(prefix="gl-remote-bench-"))
    env = dict(
        os.environ, GLOBALLOADER_CACHE_DIR=str(scratch / "gl-cache"), GLOBALLOADER_SOCKET=str(scratch / "s.sock")
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    spec = {
        "system": system,
        "url": fmt["url"],
        "proxy": proxy.url,
        "cache": str(scratch / "peer-cache"),
        "epochs": 2 if jobs == 1 else 1,
        "share": share,
        "socket": str(scratch / "s.sock"),
        "server_pid": os.getpid(),  # moto and the proxy run in this process
        "peers_python": peers_python,
        **(limit or {}),
    }
    try:
        before = proxy.total_bytes()
        procs = [_child(spec, env) for _ in range(jobs)]
        results = [_finish(p, f"{system} x{jobs}{' share' if share else ''}") for p in procs]
        served = proxy.total_bytes() - before
    finally:
        if share:
            subprocess.run(
                [sys.executable, "-m", "globalloader", "stop", "--socket", spec["socket"]], capture_output=True
            )
        shutil.rmtree(scratch, ignore_errors=True)
    return results[0] if jobs == 1 else {"jobs": results, "bytes": served}


def _summary(values: list[float | None]) -> dict[str, float] | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "n": len(known)}


def main() -> None:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--mode", choices=("shards", "folder"), default="shards", help="folder: one object per image")
    known, rest = mode.parse_known_args()
    if known.mode == "folder":
        import remote_folder  # beside this file

        remote_folder.main(rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("shards", "folder"), default="shards", help="folder: see remote_folder.py")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--shard-samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, nargs="+", default=[0.0, 0.02], help="seconds added per request")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="systems to run, comma-separated")
    parser.add_argument("--no-concurrent", dest="concurrent", action="store_false", help="skip the 2-job runs")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("GLOBALLOADER_PEERS_PYTHON"),
        help="the peers' interpreter (built by .ci/peers-env); default $GLOBALLOADER_PEERS_PYTHON, else this one",
    )
    parser.add_argument(
        "--cache-limit-fraction", type=float, help="add the row `gl limit`: cache_limit this share of the dataset"
    )
    parser.add_argument("--limit-epochs", type=int, default=3, help="epochs of the `gl limit` row")
    parser.add_argument("--limit-window", type=int, default=1, help="shards per shuffle window of the `gl limit` row")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--write-peers", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        print(json.dumps(_job(json.loads(args.job))), flush=True)
        return
    if args.write_peers:
        job = json.loads(args.write_peers)
        images = pickle.loads((Path(job["root"]) / "pictures.pkl").read_bytes())
        print(json.dumps(_write_peer_formats(Path(job["root"]), images, job["shard_bytes"])), flush=True)
        return
    wanted = [s for s in args.only.split(",") if s]
    server = MotoServer()
    proxy = FaultProxy(server.port)
    root = Path(tempfile.mkdtemp(prefix="gl-remote-data-"))
    try:
        bucket = new_bucket(proxy.url)
        formats = _write_formats(root, args.samples, args.shard_samples, proxy.url, bucket, args.peers_python)
        systems = [s for s in wanted if s in formats]
        report: dict[str, Any] = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True},
            "samples": args.samples,
            "formats": {k: {"bytes": v["bytes"]} for k, v in formats.items()},
            "rounds": args.rounds,
            "latency": {},
        }
        for latency in args.latency:
            proxy.latency = latency
            runs: dict[str, list[Any]] = {}
            plan = [(system, 1, False) for system in systems] + ([("floor", 1, False)] if "gl" in systems else [])
            if args.concurrent:
                plan += [(system, 2, False) for system in systems if system != "gl-local"]
                plan += [("gl", 2, True)] if "gl" in systems else []
            limit = None
            if args.cache_limit_fraction and "gl" in systems:
                limit = {
                    "cache_limit": int(args.cache_limit_fraction * formats["gl"]["bytes"]),
                    "epochs": args.limit_epochs,
                    "window": args.limit_window,
                }
                plan.append(("gl limit", 1, False))
            bar = tqdm(total=args.rounds * len(plan), desc=f"latency {latency * 1e3:.0f} ms")
            for _ in range(args.rounds):
                for system, jobs, share in plan:
                    name = system + (f" x{jobs}" if jobs > 1 else "") + (" share" if share else "")
                    if system == "gl limit":
                        runs.setdefault(name, []).append(_run_jobs("gl", formats["gl"], proxy, 1, limit=limit))
                        bar.update()
                        continue
                    fmt = formats["gl" if system == "floor" else system]
                    runs.setdefault(name, []).append(_run_jobs(system, fmt, proxy, jobs, share, args.peers_python))
                    bar.update()
            bar.close()
            report["latency"][f"{latency * 1e3:.0f}ms"] = _digest(runs, formats, limit)
            _print(report["latency"][f"{latency * 1e3:.0f}ms"], latency)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        print(f"results: {args.output}")
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _digest_limit(rounds: list[Any], size: int, spec: dict[str, int], unlimited_cold: float | None) -> dict[str, Any]:
    """The larger-than-disk row, per epoch: bytes downloaded / the dataset, samples/s and their
    ratio to the unlimited cold epoch of the same run, the cache folder's peak / the limit."""
    ok, limit = [r for r in rounds if r is not None], spec["cache_limit"]
    epochs = []
    for n in range(min((len(r["epochs"]) for r in ok), default=0)):
        per = [r["epochs"][n] for r in ok]
        speed = _summary([e["samples"] / e["seconds"] for e in per])
        epochs.append(
            {
                "bytes_x": _summary([e["bytes"] / size for e in per]),
                "samples_per_s": speed,
                "vs_unlimited_cold": speed["median"] / unlimited_cold if speed and unlimited_cold else None,
                "cache_peak_x_limit": _summary([e["cache_peak"] / limit for e in per]),
            }
        )
    return {"cache_limit": limit, "window": spec["window"], "epochs": epochs, "failed_rounds": len(rounds) - len(ok)}


def _digest(runs: dict[str, list[Any]], formats: dict[str, Any], limit: dict[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rounds in runs.items():
        if name == "gl limit":
            continue  # once the unlimited cold epoch is known, below
        system = name.split()[0]
        if system == "floor":
            ok = [r for r in rounds if r is not None]
            out[name] = {k: _summary([r[k] for r in ok]) for k in (*FLOOR_STEPS, "download_s")}
            out[name]["bytes_x"] = _summary([r["bytes"] / formats["gl"]["bytes"] for r in ok])
            continue
        size = formats[system]["bytes"]
        if " x2" not in name:
            ok = [r for r in rounds if r is not None]
            cold = [r["epochs"][0] for r in ok]
            warm = [r["epochs"][1] for r in ok]
            out[name] = {
                "cold_samples_per_s": _summary([e["samples"] / e["seconds"] for e in cold]),
                "warm_samples_per_s": _summary([e["samples"] / e["seconds"] for e in warm]),
                "first_batch_s": _summary([e["first_batch"] for e in cold]),
                # The epochs alone (from the first batch asked for): a first epoch also starts the workers.
                "first_vs_second_epoch": _summary(
                    [c["epoch_s"] / w["epoch_s"] for c, w in zip(cold, warm, strict=True)]
                ),
                "cold_bytes_x": _summary([e["bytes"] / size for e in cold]) if system != "gl-local" else None,
                "warm_bytes_x": _summary([e["bytes"] / size for e in warm]) if system != "gl-local" else None,
                "samples": sorted({e["samples"] for e in cold + warm}),
                "failed_rounds": len(rounds) - len(ok),
                "traceback_at_exit": any(r["stderr_traceback"] for r in ok),
            }
            out[name]["phases"] = {
                key: _summary([r["phases"].get(key) for r in ok])
                for key in PHASES
                if any(r["phases"].get(key) is not None for r in ok)
            }
            if system != "gl-local":
                out[name]["client_cpu_s_per_gib"] = _per_gib(ok, "cold_cpu_s")
                out[name]["client_epoch_cpu_s_per_gib"] = _per_gib(ok, "cold_epoch_cpu_s")
                # What the cold epoch costs the client beyond the warm one (the same decoding): the download's CPU.
                for r in ok:
                    if r["phases"].get("warm_cpu_s") is not None and r["phases"].get("cold_epoch_cpu_s") is not None:
                        r["phases"]["download_cpu_s"] = r["phases"]["cold_epoch_cpu_s"] - r["phases"]["warm_cpu_s"]
                out[name]["client_download_cpu_s_per_gib"] = _per_gib(ok, "download_cpu_s")
            if system == "gl":
                out[name]["cold_ceiling"] = _ceiling(ok)
        else:
            ok = [r for r in rounds if all(j is not None for j in r["jobs"])]
            out[name] = {  # bytes served to both jobs together, from the first start to the last end
                "bytes_x": _summary([r["bytes"] / size for r in ok]),
                "slowest_job_s": _summary([max(j["epochs"][0]["seconds"] for j in r["jobs"]) for r in ok]),
                "failed_rounds": len(rounds) - len(ok),
            }
    if "gl limit" in runs and limit is not None:
        cold = (out.get("gl") or {}).get("cold_samples_per_s")
        out["gl limit"] = _digest_limit(runs["gl limit"], formats["gl"]["bytes"], limit, cold and cold["median"])
    gl, local = out.get("gl"), out.get("gl-local")
    peers = [
        out[p]["cold_samples_per_s"]["median"]
        for p in ("mosaic", "litdata")
        if out.get(p, {}).get("cold_samples_per_s")
    ]
    if gl and gl["cold_samples_per_s"]:
        ratios: dict[str, Any] = {}
        if peers:
            ratios["cold_vs_faster_peer"] = gl["cold_samples_per_s"]["median"] / max(peers)
        if local and local["cold_samples_per_s"]:
            ratios["cold_vs_local_disk"] = gl["cold_samples_per_s"]["median"] / local["cold_samples_per_s"]["median"]
            ratios["warm_vs_local_disk"] = gl["warm_samples_per_s"]["median"] / local["warm_samples_per_s"]["median"]
        out["ratios"] = ratios
        floor = out.get("floor")
        if floor and local and local["cold_samples_per_s"] and all(floor[k] for k in FLOOR_STEPS):
            # The best cold epoch: local disk's, with the remote steps that come before any decoding
            # in place of local disk's own (constructing and indexing the source), every other
            # download hidden behind decoding and no CPU taken from it.
            local_s = _samples_of(local) / local["cold_samples_per_s"]["median"]
            chain = sum(floor[k]["median"] for k in FLOOR_STEPS)
            local_chain = sum(local["phases"][k]["median"] for k in ("source_s", "index_s") if local["phases"].get(k))
            floor["chain_s"] = chain
            floor["best_cold_epoch_s"] = local_s - local_chain + chain
            ratios["best_cold_vs_local_disk"] = local_s / floor["best_cold_epoch_s"]
    return out


def _per_gib(rounds: list[dict[str, Any]], cpu: str) -> dict[str, float] | None:
    """The job's CPU seconds `cpu` per GiB downloaded in its cold epoch (the client's cost of a
    byte, comparable between systems whatever their decoding: all decode the same samples)."""
    known = [r for r in rounds if r["phases"].get(cpu) is not None]
    return _summary([r["phases"][cpu] / (r["epochs"][0]["bytes"] / 2**30) for r in known])


def _ceiling(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 39's ceiling of the cold epoch, per round then the median: cold wall <= 1.1 x (warm
    wall + the S3 server's CPU seconds / cores), the server's CPU (moto and the proxy, which a
    real store does not put on these cores) measured over the same span as the cold wall."""
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {"goal": 1.1, "cores": cores}
    spans = {
        "epoch": ("epoch_s", ("server_cpu_s",), "the cold epoch from its first batch asked for, vs the warm one"),
        "with_setup": (
            "seconds",
            ("server_setup_cpu_s", "server_cpu_s"),
            "the cold epoch from constructing the source (imports, listing, index, first batch), vs the warm epoch",
        ),
    }
    for span, (cold_key, server_keys, what) in spans.items():
        rows = []
        for r in rounds:
            server = [r["phases"].get(k) for k in server_keys]
            if None in server:
                continue
            cold, warm = r["epochs"][0][cold_key], r["epochs"][1]["epoch_s"]
            ceiling = warm + sum(server) / cores
            rows.append((cold, warm, sum(server), ceiling, cold / ceiling))
        out[span] = {"what": what} | {
            key: _summary([row[n] for row in rows])
            for n, key in enumerate(("cold_s", "warm_s", "server_cpu_s", "ceiling_s", "cold_vs_ceiling"))
        }
    return out


def _samples_of(digest: dict[str, Any]) -> int:
    return int(max(digest["samples"]))


def _fmt(summary: dict[str, float] | None, unit: str = "", digits: int = 0) -> str:
    if not summary:
        return "-"
    return f"{summary['median']:.{digits}f}{unit} [{summary['min']:.{digits}f}, {summary['max']:.{digits}f}]"


def _print(digest: dict[str, Any], latency: float) -> None:
    print(f"\n== {latency * 1e3:.0f} ms per request (median [min, max]) ==")
    print(f"{'':14} {'cold s/s':>22} {'warm s/s':>22} {'first batch':>22} {'bytes cold':>20} {'bytes warm':>20}")
    for name, d in digest.items():
        if name in ("ratios", "floor", "gl limit") or " x2" in name:
            continue
        print(
            f"{name:14} {_fmt(d['cold_samples_per_s']):>22} {_fmt(d['warm_samples_per_s']):>22} "
            f"{_fmt(d['first_batch_s'], ' s', 2):>22} {_fmt(d['cold_bytes_x'], 'x', 2):>20} "
            f"{_fmt(d['warm_bytes_x'], 'x', 2):>20}"
        )
    for name, d in digest.items():
        p = d.get("phases")
        if p and name.startswith("gl"):
            print(
                f"{name}: source {_fmt(p.get('source_s'), ' s', 2)}, index {_fmt(p.get('index_s'), ' s', 2)}, "
                f"setup {_fmt(p.get('setup_s'), ' s', 2)}; CPU over the cold epoch: job "
                f"{_fmt(p.get('cold_cpu_s'), ' s', 2)} (epoch alone {_fmt(p.get('cold_epoch_cpu_s'), ' s', 2)}), "
                f"S3 server + proxy {_fmt(p.get('server_cpu_s'), ' s', 2)} "
                f"(setup {_fmt(p.get('server_setup_cpu_s'), ' s', 2)})"
            )
    for name, d in digest.items():
        if d.get("client_cpu_s_per_gib"):
            print(
                f"{name}: client CPU per GiB downloaded {_fmt(d['client_cpu_s_per_gib'], ' s', 1)} with setup, "
                f"{_fmt(d['client_epoch_cpu_s_per_gib'], ' s', 1)} epoch alone, "
                f"{_fmt(d['client_download_cpu_s_per_gib'], ' s', 1)} beyond the warm epoch's"
            )
    ceiling = digest.get("gl", {}).get("cold_ceiling")
    if ceiling:
        for span in ("epoch", "with_setup"):
            c = ceiling[span]
            print(
                f"gl cold ceiling ({span}): cold {_fmt(c['cold_s'], ' s', 2)} vs warm {_fmt(c['warm_s'], ' s', 2)} + "
                f"server CPU {_fmt(c['server_cpu_s'], ' s', 2)} / {ceiling['cores']} = "
                f"{_fmt(c['ceiling_s'], ' s', 2)}: "
                f"{_fmt(c['cold_vs_ceiling'], 'x', 2)} (goal <= {ceiling['goal']})"
            )
    for name, d in digest.items():
        if " x2" in name:
            print(f"{name:14} bytes {_fmt(d['bytes_x'], 'x', 2)}, slower job {_fmt(d['slowest_job_s'], ' s', 1)}")
    if "floor" in digest:
        floor = digest["floor"]
        print(
            "floor (fresh process, no decoding): "
            + ", ".join(f"{k[:-2].replace('_', ' ')} {_fmt(floor[k], ' s', 3)}" for k in FLOOR_STEPS)
            + f"; the other shards 8 at once {_fmt(floor['download_s'], ' s', 3)} ({_fmt(floor['bytes_x'], 'x', 2)})"
        )
        if "best_cold_epoch_s" in floor:
            print(
                f"best cold epoch: local disk's with these steps in place of its own source+index: "
                f"{floor['best_cold_epoch_s']:.3f} s (steps {floor['chain_s']:.3f} s)"
            )
    if "gl limit" in digest:
        row = digest["gl limit"]
        size = f"cache_limit {row['cache_limit'] / 1e6:.1f} MB, larger than the disk, window {row['window']}"
        print(f"gl limit ({size}), per epoch:")
        for n, e in enumerate(row["epochs"]):
            ratio = f"{e['vs_unlimited_cold']:.2f}" if e["vs_unlimited_cold"] else "-"
            print(
                f"  epoch {n}: bytes {_fmt(e['bytes_x'], 'x', 3)}, {_fmt(e['samples_per_s'])} samples/s "
                f"({ratio} of the unlimited cold epoch), "
                f"cache peak {_fmt(e['cache_peak_x_limit'], 'x', 3)} of the limit"
            )
    for name, d in digest.items():
        if d.get("first_vs_second_epoch"):
            ratio = _fmt(d["first_vs_second_epoch"], "x", 2)
            print(f"{name}: first epoch / second epoch, each from its first batch asked for: {ratio}")
    print("ratios:", json.dumps({k: round(v, 3) for k, v in digest.get("ratios", {}).items()}))


if __name__ == "__main__":
    main()
