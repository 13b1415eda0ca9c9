"""Sharing over the network: K jobs through one server (`share=True`) vs K independent jobs.

remote.py's pictures (`--samples` 3000 JPEGs of `--size` 160x160, ~15 KB; `--size 500x375` makes
ImageNet-like ones of ~85 KB, whose decode is a realistic share of the work; `--shard-samples` 200
per tar shard) on one moto S3 server (server mode, loopback) behind the proxy that adds `--latency`
(20 ms) per request and counts the bytes it serves (`globalloader.demo.s3`). K = `--jobs`
(1 2 4) jobs, each a fresh process, all started together on one machine cache folder (empty
at the start of each run), one cold epoch each of
`gl.Dataset(gl.TarShards("s3://...")).shuffle(seed=k).map(decode).batch(32)`:

- independent: each job a `gl.Loader(workers=2)` (`share=False`); the machine cache downloads
  each shard once for all of them, every job decodes every sample;
- shared: the same chain with `map(decode, shared=True)` in `gl.Loader(share=True)` with no
  workers of its own (batching is all that is left to it), through one server started for the
  run with `--server-workers` decode workers (default: one per core, as a server a Loader
  starts): each sample is downloaded and decoded once, for every job. Starting the server is
  not timed (a machine's server outlives its jobs); its start time is printed apart.

Per run: the wall time from launching the jobs to the last one's end (`wall_s`), the slowest
job's epoch from constructing its source (`slowest_job_s`), the bytes served to all jobs over
the shards' size (`bytes_x`; 1.0: the dataset downloaded once), every job's samples (each must
be its whole set, once), the CPU seconds of the S3 server and the proxy (this process) and, in
shared mode, of the globalloader server and its decode workers, with its decodes. Median of
`--rounds` (3) with [min, max]; the ratios shared / independent of the medians, per K (goals:
K=2 <= 0.6, K=4 <= 0.35), and `floor_wall`: the shared run's CPU seconds (jobs, gl server and its
workers) over the cores, over the independent wall: the least ratio this machine allows whatever
the scheduling. JSON in benchmarks/results/remote_share.json (`picture_size`: the `--size` used).

    python benchmarks/remote_share.py [--samples 3000] [--size 160x160] [--jobs 1 2 4] [--rounds 3]
        [--latency 0.02] [--server-workers N] [--modes independent,shared]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from remote import _jpeg, decode  # the same pictures and decode as remote.py's
from tqdm.auto import tqdm

from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

RESULTS = Path(__file__).parent / "results" / "remote_share.json"
BATCH, WORKERS = 32, 2
MODES = ("independent", "shared")


def _write_shards(bucket: str, endpoint: str, samples: int, per_shard: int, size: tuple[int, int]) -> int:
    """The tar shards (with index sidecars) written straight to the bucket; returns their bytes."""
    from globalloader import storage
    from globalloader.sources import TarWriter

    url = f"s3://{bucket}/tar/shard-%04d.tar"
    with TarWriter(url, maxcount=per_shard, storage_options=options(endpoint), index=True) as writer:
        for i in tqdm(range(samples), desc="shards", leave=False):
            writer.write({"__key__": f"s{i:06d}", "jpg": _jpeg(i, size), "cls": i % 100})
    fs, _ = storage.Store(options(endpoint)).filesystem(url)
    return sum(int(fs.size(path)) for path in writer.paths)


# -- one job (a child process) -------------------------------------------------------------------
def _job(spec: dict[str, Any]) -> dict[str, Any]:
    import globalloader as gl

    start = time.perf_counter()
    src = gl.TarShards(spec["url"], storage_options=options(spec["proxy"]))
    shared = spec["mode"] == "shared"
    chain = gl.Dataset(src).shuffle(seed=spec["seed"]).map(decode, shared=shared).batch(BATCH)
    if shared:
        loader = gl.Loader(chain, workers=0, share=True, server=spec["socket"], name=f"job-{spec['seed']}")
    else:
        loader = gl.Loader(chain, workers=WORKERS)
    seen: list[int] = []
    first = None
    for batch in loader:
        first = first if first is not None else time.perf_counter() - start
        seen.extend(int(c) for c in batch["cls"])
    seconds = time.perf_counter() - start
    loader.close()
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime
    return {"seconds": seconds, "first_batch_s": first, "samples": len(seen), "labels": sum(seen), "cpu_s": cpu}


# -- the session ---------------------------------------------------------------------------------
def _cpu_of(pid: int) -> tuple[float, float]:
    """CPU seconds of a live process, and of its live children (the server's decode workers)."""
    tick, own, children = os.sysconf("SC_CLK_TCK"), 0.0, 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick
            if p == pid:
                own = seconds
            else:
                children += seconds
            for task in Path(f"/proc/{p}/task").glob("*/children"):
                pids += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return own, children


def _answers(socket: Path) -> bool:
    """Whether the server answers a status request (ready: bound, its decode workers started)."""
    from globalloader.errors import GlobalLoaderError
    from globalloader.service import launcher

    try:
        launcher.status(socket)
    except (GlobalLoaderError, OSError):
        return False
    return True


def _run(mode: str, jobs: int, url: str, proxy: FaultProxy, server_workers: int | None) -> dict[str, Any]:
    """K jobs at once on one fresh machine cache; in shared mode, through a server of their own."""
    from globalloader.service import launcher

    scratch = Path(tempfile.mkdtemp(prefix="gl-remote-share-"))
    socket = scratch / "server.sock"
    env = dict(os.environ, GLOBALLOADER_CACHE_DIR=str(scratch / "cache"), GLOBALLOADER_SOCKET=str(socket))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    server = None
    out: dict[str, Any] = {}
    try:
        if mode == "shared":
            t0 = time.perf_counter()
            log = open(scratch / "server.log", "wb")  # noqa: SIM115 - closed with the server below
            command = launcher.server_command(socket, "1G", server_workers)
            server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            while not _answers(socket):
                if server.poll() is not None or time.perf_counter() - t0 > 60:
                    raise RuntimeError(f"the server did not start: {(scratch / 'server.log').read_text()[-500:]}")
                time.sleep(0.05)
            out["server_start_s"] = time.perf_counter() - t0
            server_cpu = _cpu_of(server.pid)
        before_bytes, before_gets, before_cpu = proxy.total_bytes(), proxy.count("GET"), os.times()
        t0 = time.perf_counter()
        procs = []
        for k in range(jobs):
            spec = {"mode": mode, "url": url, "proxy": proxy.url, "socket": str(socket), "seed": k}
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--job", json.dumps(spec)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=1800)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{mode} x{jobs}: a job failed ({proc.returncode}): {stderr.strip()[-800:]}")
            results.append(json.loads(lines[-1]))
        out["wall_s"] = time.perf_counter() - t0
        after_cpu = os.times()
        out["s3_cpu_s"] = after_cpu.user + after_cpu.system - before_cpu.user - before_cpu.system
        out["bytes"] = proxy.total_bytes() - before_bytes
        out["gets"] = proxy.count("GET") - before_gets
        out["jobs"] = results
        if server is not None:
            own, workers = _cpu_of(server.pid)
            out["server_main_cpu_s"] = own - server_cpu[0]  # the scheduler and connections: per ticket
            out["server_cpu_s"] = own + workers - sum(server_cpu)
            status = launcher.status(socket)
            out["decodes"], out["requests"] = status["decodes"], status["requests"]
            out["server_load_s"] = status["decode_s"]  # the decode workers' seconds in loads (read, maps, write)
    finally:
        if server is not None:
            try:
                launcher.stop(socket)
                server.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a server that does not stop is terminated
                server.terminate()
                server.wait(timeout=10)
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _size(text: str) -> tuple[int, int]:
    """`--size` WIDTHxHEIGHT."""
    try:
        width, height = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size must be WIDTHxHEIGHT (e.g. 500x375), got {text!r}") from None
    return width, height


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _digest(runs: list[dict[str, Any]], size: int, samples: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "wall_s": _summary([r["wall_s"] for r in runs]),
        "slowest_job_s": _summary([max(j["seconds"] for j in r["jobs"]) for r in runs]),
        "first_batch_s": _summary([max(j["first_batch_s"] for j in r["jobs"]) for r in runs]),
        "bytes_x": _summary([r["bytes"] / size for r in runs]),
        "gets": _summary([r["gets"] for r in runs]),
        "s3_cpu_s": _summary([r["s3_cpu_s"] for r in runs]),
        "jobs_cpu_s": _summary([sum(j["cpu_s"] for j in r["jobs"]) for r in runs]),
        "cpu_s": _summary([sum(j["cpu_s"] for j in r["jobs"]) + r.get("server_cpu_s", 0.0) for r in runs]),
        "exact_epochs": all(
            j["samples"] == samples and j["labels"] == sum(i % 100 for i in range(samples))
            for r in runs
            for j in r["jobs"]
        ),
    }
    for key in ("server_cpu_s", "server_main_cpu_s", "server_load_s", "server_start_s", "decodes"):
        if all(key in r for r in runs):
            out[key] = _summary([r[key] for r in runs])
    return out


def _fmt(s: dict[str, float] | None, digits: int = 2, unit: str = "") -> str:
    if not s:
        return "-"
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--shard-samples", type=int, default=200)
    parser.add_argument("--size", type=_size, default=(160, 160), help="the pictures' WIDTHxHEIGHT")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4], help="K: jobs at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added per request")
    parser.add_argument(
        "--server-workers", type=int, default=None, help="the server's decode workers (default: one per core)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        print(json.dumps(_job(json.loads(args.job))), flush=True)
        return
    modes = [m for m in args.modes.split(",") if m]
    server, proxy = MotoServer(), None
    try:
        proxy = FaultProxy(server.port)
        bucket = new_bucket(proxy.url)
        size = _write_shards(bucket, proxy.url, args.samples, args.shard_samples, args.size)
        proxy.latency = args.latency
        url = f"s3://{bucket}/tar/shard-*.tar"
        runs: dict[str, list[dict[str, Any]]] = {}
        plan = [(mode, k) for k in args.jobs for mode in modes]
        with tqdm(total=args.rounds * len(plan), desc="runs") as bar:
            for _ in range(args.rounds):
                for mode, k in plan:
                    runs.setdefault(f"{mode} x{k}", []).append(_run(mode, k, url, proxy, args.server_workers))
                    bar.update()
        digest = {name: _digest(rs, size, args.samples) for name, rs in runs.items()}
        ratios: dict[str, dict[str, float]] = {}
        cores = os.cpu_count() or 1
        for k in args.jobs:
            shared, alone = digest.get(f"shared x{k}"), digest.get(f"independent x{k}")
            if shared and alone:
                ratios[f"K={k}"] = {
                    key: shared[key]["median"] / alone[key]["median"] for key in ("wall_s", "slowest_job_s", "cpu_s")
                }
                # The least wall the shared run could take on this machine: its CPU over the cores.
                ratios[f"K={k}"]["floor_wall"] = shared["cpu_s"]["median"] / cores / alone["wall_s"]["median"]
        report = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True},
            "samples": args.samples,
            "picture_size": list(args.size),
            "shard_bytes": size,
            "latency_s": args.latency,
            "rounds": args.rounds,
            "workers_per_job": WORKERS,
            "server_workers": args.server_workers or os.cpu_count(),
            "results": digest,
            "shared_vs_independent": ratios,
            "goals": {"K=2": 0.6, "K=4": 0.35},
            "raw": runs,
        }
        print(
            f"\n== {args.samples} samples of {args.size[0]}x{args.size[1]}, {size / 1e6:.1f} MB of shards, "
            f"{args.latency * 1e3:.0f} ms per request =="
        )
        for name, d in digest.items():
            extra = ""
            if "server_cpu_s" in d:
                extra = (
                    f", gl server {_fmt(d['server_cpu_s'], 1, ' s')} "
                    f"(its main loop {_fmt(d['server_main_cpu_s'], 2, ' s')}, "
                    f"in loads {_fmt(d['server_load_s'], 2, ' s')}; decodes {_fmt(d['decodes'], 0)})"
                )
            print(
                f"{name:15} wall {_fmt(d['wall_s'], 2, ' s')}, slowest job {_fmt(d['slowest_job_s'], 2, ' s')}, "
                f"bytes {_fmt(d['bytes_x'], 2, 'x')}, GETs {_fmt(d['gets'], 0)}, "
                f"CPU: jobs {_fmt(d['jobs_cpu_s'], 1, ' s')}{extra}, S3 server+proxy {_fmt(d['s3_cpu_s'], 1, ' s')}; "
                f"exact epochs {d['exact_epochs']}"
            )
        print(
            "shared / independent (medians):",
            json.dumps({k: {m: round(v, 3) for m, v in r.items()} for k, r in ratios.items()}),
        )
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        print(f"results: {args.output}")
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
