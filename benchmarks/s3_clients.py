"""The client's CPU per small GET, by S3 client library, on one local S3 server (moto).

`--objects` (1,000) objects of `--size` (15 KB, a JPEG of remote.py's) on a moto server behind
the benchmarks' proxy (kept-alive connections, as a real store; no added latency), each read
whole for one version (with If-Match on its ETag, or its bytes checked against the ETag's MD5) by
`--in-flight` (64) requests at once, in a fresh process per client and round:

- aiobotocore: s3fs's async client (`_fs._get_s3_s3fs`: the GET globalloader made before it
  moved to obstore, and still makes in a process forked after its parent's first obstore GET);
- obstore-if-match: the Rust object_store client (`get_async` with `if_match`, then the body)
  through `_fs._get_s3`, the GET globalloader makes of a large object or in a worker (its store
  made from the storage_options, its errors translated);
- obstore: the GET the pool makes of a small object whose ETag is an MD5
  (`_fs.get_s3_whole_unchecked`: one ranged call without a condition) and the MD5 check that pins
  its version;
- boto3: a thread pool of `--in-flight` threads over one client with as many pooled connections;
- gl-pool: globalloader's own pool of downloads ahead (`Files.prefetch` into the machine cache:
  the GET, its checks and the cache write), the figure issue 40 bounds at 0.5 ms per object;
  its clock starts after its listing and a first round of GETs (their client made), and the wait
  for the pool looks at its counters every POLL seconds;
- list-botocore, list-gl: one listing of the folder by s3fs's `find` (its LIST, botocore's XML
  parse: what `Store.find` falls back to where obstore cannot list a folder), after one that made
  the client; the CPU is divided by the objects listed. list-gl is
  the session globalloader gives s3fs (`_fs._timestamp` reads each object's LastModified);
  list-botocore is a session of the user's own (`storage_options={"session": ...}`), which keeps
  botocore's own parser (dateutil), as s3fs alone has it. `list_gl_vs_botocore`: their ratio;
- first-list-gl, first-list-obstore: wall seconds from a fresh process with no storage client
  imported to the folder's listing: globalloader's (`Store.find`: importing s3fs, botocore and
  aiohttp, making botocore's client, its LIST) against obstore's (importing it, making its
  S3Store, its LIST); the part of a job's startup a listing through obstore would save
  (`first_listing_s` in the JSON);
- cache-entry: the floor of one entry of a machine-wide cache, timed after the pool in the same
  process, in the folder it just filled, with no Python beyond the calls themselves: the check
  (the MD5 of the bytes), the stat that finds it missing, its download lock (a byte of a lock
  file, taken and released), the counters' record (flock, read, write, unlock) and the file
  (create exclusively, write, close, rename). With obstore's GET, the pool's floor
  (`gl_pool_vs_floor`): what remains above it is the pool's bookkeeping in Python.

The figure is the client process's CPU time (user + system, all its threads) over the reads,
divided by the objects, after a warm-up of `--in-flight` reads that opens the connections; the
server runs in this process, so its CPU is not counted. For obstore's rows and gl-pool, the rows
`<client> runtime` give the part of it spent by the threads of obstore's Rust runtime (tokio's:
the HTTP itself), the rest being Python's. Median of `--rounds` (3) with min and max; JSON in
benchmarks/results/s3_clients.json.

    python benchmarks/s3_clients.py [--objects 1000] [--size 15000] [--in-flight 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
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

from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

RESULTS = Path(__file__).parent / "results" / "s3_clients.json"
CLIENTS = (
    "aiobotocore",
    "obstore-if-match",
    "obstore",
    "boto3",
    "gl-pool",
    "list-botocore",
    "list-gl",
    "first-list-gl",
    "first-list-obstore",
)
KEY, SECRET, REGION = "testing", "testing", "us-east-1"
POLL = 0.02  # seconds between two looks at the pool's counters while it runs: the wait's own CPU is not the pool's


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process, and of the threads of obstore's runtime (tokio's, Rust) in it."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    runtime = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("tokio"):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                runtime += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return own.ru_utime + own.ru_stime, runtime


def _since(before: tuple[float, float]) -> tuple[float, float]:
    now = _cpu()
    return now[0] - before[0], now[1] - before[1]


async def _gather(read: Any, keys: list[tuple[str, str]], in_flight: int) -> int:
    """Read every (key, etag) with at most `in_flight` at once; the bytes read."""
    gate = asyncio.Semaphore(in_flight)

    async def one(key: str, etag: str) -> int:
        async with gate:
            return len(await read(key, etag))

    return sum(await asyncio.gather(*(one(k, e) for k, e in keys)))


def _aiobotocore(spec: dict[str, Any], keys: list[tuple[str, str]]) -> tuple[tuple[float, float], int]:
    from fsspec.asyn import sync

    from globalloader.storage._fs import _get_s3_s3fs, filesystem

    fs, _ = filesystem(f"s3://{spec['bucket']}", options(spec["endpoint"]))

    async def read(key: str, etag: str) -> bytes:
        answer = await _get_s3_s3fs(fs, f"{spec['bucket']}/{key}", None, etag)
        assert answer is not None
        return answer.data

    sync(fs.loop, _gather, read, keys[: spec["in_flight"]], spec["in_flight"])  # warm-up
    cpu = _cpu()
    got = sync(fs.loop, _gather, read, keys, spec["in_flight"])
    return _since(cpu), got


def _obstore(spec: dict[str, Any], keys: list[tuple[str, str]]) -> tuple[tuple[float, float], int]:
    import hashlib

    from fsspec.asyn import sync

    from globalloader.storage._fs import _get_s3, filesystem, get_s3_whole_unchecked
    from globalloader.storage.checksum import etag_md5

    fs, _ = filesystem(f"s3://{spec['bucket']}", options(spec["endpoint"]))

    async def conditional(key: str, etag: str) -> bytes:
        answer = await _get_s3(fs, f"{spec['bucket']}/{key}", None, etag)
        assert answer is not None
        return answer.data

    async def unchecked(key: str, etag: str) -> bytes:
        data = await get_s3_whole_unchecked(fs.storage_options, spec["bucket"], key, spec["size"])
        assert data is not None and hashlib.md5(data, usedforsecurity=False).hexdigest() == etag_md5(etag)
        return data

    read = conditional if spec["client"] == "obstore-if-match" else unchecked
    # On the storage clients' own event loop, as globalloader runs it (a loop closed by
    # asyncio.run under obstore's runtime made the process abort at exit in a third of rounds).
    sync(fs.loop, _gather, read, keys[: spec["in_flight"]], spec["in_flight"])  # warm-up
    cpu = _cpu()
    got = sync(fs.loop, _gather, read, keys, spec["in_flight"])
    return _since(cpu), got


def _boto3(spec: dict[str, Any], keys: list[tuple[str, str]]) -> tuple[tuple[float, float], int]:
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=spec["endpoint"],
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(max_pool_connections=spec["in_flight"], retries={"total_max_attempts": 1}),
    )

    def read(item: tuple[str, str]) -> int:
        resp = client.get_object(Bucket=spec["bucket"], Key=item[0], IfMatch=item[1])
        return len(resp["Body"].read())

    with ThreadPoolExecutor(spec["in_flight"]) as pool:
        sum(pool.map(read, keys[: spec["in_flight"]]))  # warm-up
        cpu = _cpu()
        got = sum(pool.map(read, keys))
        return _since(cpu), got


def _gl_pool(spec: dict[str, Any], keys: list[tuple[str, str]]) -> tuple[tuple[float, float], int]:
    import numpy as np

    import globalloader as gl

    src = gl.Files(f"s3://{spec['bucket']}/objects", "*.bin", storage_options=options(spec["endpoint"]))
    warm = np.arange(spec["in_flight"])
    src.prefetch(warm)
    while (c := src.store.fetch_counters())["fetched"] + c["failed"] < len(warm):
        time.sleep(0.002)
    cpu = _cpu()
    src.prefetch(np.arange(len(src)))
    while (c := src.store.fetch_counters())["fetched"] + c["failed"] < len(src):
        time.sleep(POLL)
    used = _since(cpu)
    if c["failed"]:
        raise RuntimeError(f"the pool failed {c['failed']} GETs: {src.store.fetch_counters()}")
    return used, (len(src) - len(warm)) * spec["size"]


def _listing(spec: dict[str, Any], keys: list[tuple[str, str]]) -> tuple[tuple[float, float], int]:
    from globalloader.storage import Store

    opts = options(spec["endpoint"])
    if spec["client"] == "list-botocore":  # a session of the user's own: botocore's parser kept
        import aiobotocore.session

        opts["session"] = aiobotocore.session.AioSession()
    fs, path = Store(opts, cache=False).filesystem(f"s3://{spec['bucket']}/objects")
    fs.find(path, detail=True)  # the client made, its connection open
    fs.invalidate_cache()
    cpu = _cpu()
    found = fs.find(path, detail=True)
    return _since(cpu), sum(info["size"] for info in found.values())


def _first_listing(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds (wall) from a process without a storage client to the
    folder's listing: globalloader's (`Store.find`: importing s3fs with botocore and aiohttp,
    making botocore's client, the LIST through it) or obstore's (importing it, its S3Store, the
    LIST through it)."""
    root = f"s3://{spec['bucket']}/objects"
    assert not {"s3fs", "botocore", "obstore"} & sys.modules.keys()  # the clock starts before any import
    start = time.perf_counter()
    if spec["client"] == "first-list-gl":
        from globalloader.storage import Store

        sizes = [stat.size for stat in Store(options(spec["endpoint"]), cache=False).find(root).values()]
    else:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            spec["bucket"],
            endpoint=spec["endpoint"],
            access_key_id=KEY,
            secret_access_key=SECRET,
            region=REGION,
            client_options={"allow_http": True},
        )
        sizes = [item["size"] for page in obstore.list(store, prefix="objects/") for item in page]
    return {"objects": len(sizes), "bytes": sum(sizes), "seconds": time.perf_counter() - start}


def _cache_entry(folder: Path, size: int, count: int = 300) -> float:
    """CPU ms of the floor of one cache entry (see the module doc), the calling thread's alone:
    the process's would count its other threads (the storage client's runtime, the event loop)
    while they wind down after the pool's run."""
    import fcntl
    import hashlib
    import struct

    body = os.urandom(size)
    lock_fd = os.open(folder / "floor-locks", os.O_RDWR | os.O_CREAT, 0o600)
    record_fd = os.open(folder / "floor-record", os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(record_fd, bytes(60), 0)
    flock = struct.Struct("hhqqi4x")
    cpu = time.thread_time()
    for i in range(count):
        hashlib.md5(body, usedforsecurity=False).hexdigest()
        path, temporary = folder / f"floor-{i}", folder / f"floor-{i}.tmp"
        os.path.lexists(path)
        fcntl.fcntl(lock_fd, fcntl.F_OFD_SETLK, flock.pack(fcntl.F_WRLCK, os.SEEK_SET, i, 1, 0))
        fcntl.flock(record_fd, fcntl.LOCK_EX)
        record = os.pread(record_fd, 60, 0)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, body)
        os.close(fd)
        os.rename(temporary, path)
        os.pwrite(record_fd, record, 0)
        fcntl.flock(record_fd, fcntl.LOCK_UN)
        fcntl.fcntl(lock_fd, fcntl.F_OFD_SETLK, flock.pack(fcntl.F_UNLCK, os.SEEK_SET, i, 1, 0))
    used = time.thread_time() - cpu
    # Its files are left to the end of the benchmark (see remote_folder's `_run`: on ext4 without a
    # journal, inodes freed in the last 30 s slow the next round's file creation).
    for fd in (lock_fd, record_fd):
        os.close(fd)
    return 1e3 * used / count


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["client"].startswith("first-list"):
        return _first_listing(spec)
    keys = [(k, e) for k, e in spec["keys"]]
    run = {
        "aiobotocore": _aiobotocore,
        "obstore-if-match": _obstore,
        "obstore": _obstore,
        "boto3": _boto3,
        "gl-pool": _gl_pool,
        "list-botocore": _listing,
        "list-gl": _listing,
    }[spec["client"]]
    t0 = time.perf_counter()
    (cpu, runtime), got = run(spec, keys)
    objects = len(keys) - (spec["in_flight"] if spec["client"] == "gl-pool" else 0)
    if got != objects * spec["size"]:
        raise RuntimeError(f"{spec['client']} read {got} bytes, expected {objects * spec['size']}")
    result = {"objects": objects, "cpu_s": cpu, "runtime_cpu_s": runtime, "seconds": time.perf_counter() - t0}
    if spec["client"] == "gl-pool":  # in the folder the pool wrote its entries to, after it
        result["cache_entry_ms"] = _cache_entry(Path(os.environ["GLOBALLOADER_CACHE_DIR"]) / "objects", spec["size"])
    return result


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--size", type=int, default=15000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(CLIENTS))
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        print(json.dumps(_job(json.loads(args.job))), flush=True)
        return
    server = MotoServer()
    proxy = FaultProxy(server.port)
    scratch = Path(tempfile.mkdtemp(prefix="gl-s3-clients-"))
    try:
        bucket = new_bucket(proxy.url)
        from globalloader.storage import Store

        fs, _ = Store(options(proxy.url)).filesystem(f"s3://{bucket}")
        body = os.urandom(args.size)
        for i in range(args.objects):
            fs.pipe_file(f"{bucket}/objects/{i:07d}.bin", body)
        keys = [(f"objects/{i:07d}.bin", fs.info(f"{bucket}/objects/{i:07d}.bin")["ETag"]) for i in range(args.objects)]
        spec = {"bucket": bucket, "endpoint": proxy.url, "keys": keys, "size": args.size, "in_flight": args.in_flight}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        by_round: list[dict[str, float]] = []  # each round's figures, to pair the floor round by round
        failed: dict[str, list[str]] = {}
        first: list[dict[str, float]] = []  # seconds to the first listing, by client
        for r in range(args.rounds):
            by_round.append({})
            first.append({})
            for client in [c for c in args.only.split(",") if c]:
                env["GLOBALLOADER_CACHE_DIR"] = str(scratch / f"{client}-{r}")
                proc = subprocess.run(
                    [sys.executable, __file__, "--job", json.dumps({**spec, "client": client})],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=600,
                )
                lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
                if proc.returncode != 0 or not lines:
                    why = f"round {r}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}"
                    print(f"{client} failed, {why}")
                    failed.setdefault(client, []).append(why)
                    continue
                result = json.loads(lines[-1])
                if client.startswith("first-list"):
                    if result["bytes"] != args.objects * args.size:  # the whole folder, or no figure
                        raise RuntimeError(f"{client} listed {result['bytes']} bytes of {args.objects * args.size}")
                    first[r][client] = result["seconds"]
                    continue
                by_round[r][client] = 1e3 * result["cpu_s"] / result["objects"]
                if result["runtime_cpu_s"]:  # obstore's: its Rust runtime's share of that
                    by_round[r][f"{client} runtime"] = 1e3 * result["runtime_cpu_s"] / result["objects"]
                if "cache_entry_ms" in result:
                    by_round[r]["cache-entry"] = result["cache_entry_ms"]
        names = list(dict.fromkeys(name for figures in by_round for name in figures))
        report = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True},
            "objects": args.objects,
            "size": args.size,
            "in_flight": args.in_flight,
            "rounds": args.rounds,
            "client_cpu_ms_per_object": {n: _summary([f[n] for f in by_round if n in f]) for n in names},
            "by_round": by_round,
            "failed": failed,
        }
        listed = list(dict.fromkeys(name for figures in first for name in figures))
        if listed:
            report["first_listing_s"] = {n: _summary([f[n] for f in first if n in f]) for n in listed}
        # The pool's floor: obstore's GET and one cache entry's own work, in the rounds that have all three.
        ratios = [
            f["gl-pool"] / (f["obstore"] + f["cache-entry"])
            for f in by_round
            if {"gl-pool", "obstore", "cache-entry"} <= f.keys()
        ]
        if ratios:
            report["gl_pool_vs_floor"] = _summary(ratios)
        ratios = [f["list-gl"] / f["list-botocore"] for f in by_round if {"list-gl", "list-botocore"} <= f.keys()]
        if ratios:
            report["list_gl_vs_botocore"] = _summary(ratios)
        per = f"{args.size}-byte GET ({args.in_flight} in flight; list-*: per object listed)"
        print(f"client CPU per {per}, median [min, max]:")
        for client, s in report["client_cpu_ms_per_object"].items():
            print(f"  {client:16} {s['median']:.3f} ms [{s['min']:.3f}, {s['max']:.3f}]")
        if "gl_pool_vs_floor" in report:
            s = report["gl_pool_vs_floor"]
            print(f"gl-pool / (obstore + cache-entry), by round: {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]")
        if "list_gl_vs_botocore" in report:
            s = report["list_gl_vs_botocore"]
            print(f"list-gl / list-botocore, by round: {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]")
        for client, s in report.get("first_listing_s", {}).items():
            print(f"  {client:16} {s['median']:.3f} s [{s['min']:.3f}, {s['max']:.3f}] to the first listing")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        print(f"results: {args.output}")
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
