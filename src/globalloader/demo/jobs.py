"""The multi-job workload: K training jobs on one machine, each its own process, one dataset.

Shared by the second act of `globalloader demo` and `benchmarks/multi_job.py`, so the figures a
user sees and the ones the benchmark records come from the same code.

The split is the Jean Zay one: the deterministic prefix `Decode(resize=256)` is the shared map
(`map(..., shared=True)`); each job's own part is `RandomCropFlipNormalize(size=224)` (a random
map with per-sample seeds) then `.batch(32)`, and a stand-in step that reads every batch, plus
an optional sleep per batch (a slower job). Every job runs in a fresh spawned process; the jobs
start together (a barrier, after their imports) and wall time runs from that start until the
last job ends.

Three modes run the same functions:
- "shared": one server started for the run (a given arena size, K*W decode workers, a socket in
  a temporary folder; stopped afterwards); jobs use `Loader(..., share=True, workers=0)`.
- "independent": each job its own in-process `Loader(..., workers=W)`, no sharing.
- "torch": each job its own `torch.utils.data.DataLoader(num_workers=W)`, same functions and
  the same per-sample seeds (as `workload.run_torch`).

Worker budget: the same number of processes doing sample work in every mode. Independent and
torch jobs have W workers each (K*W in all); in shared mode the server gets the K*W decode
workers and the jobs run their crop, collate and step in their main thread (workers=0): the
decode is the expensive part and is what the server shares, while a job's own part costs
about a fifth of a decode and needs no process hop.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from tqdm.auto import tqdm

from globalloader._seeding import generator
from globalloader.dataset.chain import Dataset
from globalloader.demo.workload import train_step
from globalloader.errors import ArgumentError, ServerGoneError, WorkerError, check_int
from globalloader.execution.loader import Loader
from globalloader.sources import ImageFolder
from globalloader.vision import Decode, RandomCropFlipNormalize

__all__ = ["MODES", "SAMPLE_BYTES", "JobSpec", "job_chain", "job_sample", "overlapping_sets", "run_jobs"]

MODES = ("shared", "independent", "torch")
# One demo image (500x375) after Decode(resize=256): what a sample takes in the arena.
SAMPLE_BYTES = 256 * 341 * 3
_SHARED, _OWN = Decode(resize=256), RandomCropFlipNormalize(size=224)
_OWN_POSITION = 1  # the random map's position in the chain: part of its per-sample seed
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class JobSpec:
    """One training job: its name, its index set, its extra seconds per batch, its epochs.

    A `background` job models one that keeps training: it runs up to `epochs` epochs but stops
    after the batch during which every other (foreground) job has finished.
    """

    name: str
    indices: tuple[int, ...]
    sleep: float = 0.0
    epochs: int = 1
    background: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(int(i) for i in self.indices))
        if not self.indices:
            raise ArgumentError(f"JobSpec {self.name!r}: indices must not be empty")
        if self.sleep < 0 or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ArgumentError(
                f"JobSpec {self.name!r}: need sleep >= 0 and epochs >= 1, "
                f"got sleep={self.sleep!r}, epochs={self.epochs!r}"
            )


def job_chain(root: Path | str, indices: Sequence[int], batch_size: int = 32, seed: int = 0) -> Dataset:
    """The job's chain: its set, shuffled; shared decode to 256; its own crop 224 + flip + normalize."""
    return (
        Dataset(ImageFolder(root))
        .select(list(indices))
        .seed(seed)
        .shuffle(seed)
        .map(_SHARED, shared=True, name="decode")
        .map(_OWN, name="crop+flip+normalize")
        .batch(batch_size)
    )


def overlapping_sets(n: int, k: int) -> list[list[int]]:
    """`k` sets covering range(n), each half common to all and half its own (50% overlap pairwise)."""
    if k < 2 or n < 2 * k:
        raise ArgumentError(f"overlapping_sets: need k >= 2 and n >= 2k, got n={n}, k={k}")
    half = n // (k + 1)
    core = list(range(half))
    return [core + list(range(half * (j + 1), half * (j + 2) if j < k - 1 else n)) for j in range(k)]


def run_jobs(
    root: Path | str,
    specs: Sequence[JobSpec],
    mode: str,
    workers: int = 2,
    batch_size: int = 32,
    memory: str | int = "1G",
    seed: int = 0,
    progress: bool = True,
    stall_s: float = 120.0,
) -> dict[str, Any]:
    """Run `specs` as concurrent job processes in `mode`; return per-job and overall figures.

    `workers` is per job (shared mode: the server gets len(specs) * workers decode workers and
    the jobs none); `memory` is the shared-mode arena. Per job: samples, seconds, samples/s,
    whether every epoch saw its set exactly once, and its decodes (independent, torch) or its
    followed share (shared; of its last epoch). Overall: wall time until all jobs end, aggregate
    samples/s, decodes and decodes / |union of the sets|. Raises WorkerError if a job fails, or
    if no job delivers a batch for `stall_s` seconds (with the server's status in shared mode).
    """
    if mode not in MODES:
        raise ArgumentError(f"run_jobs: mode must be one of {MODES}, got {mode!r}")
    if not specs or len({s.name for s in specs}) != len(specs):
        raise ArgumentError(f"run_jobs: specs must be non-empty with distinct names, got {[s.name for s in specs]}")
    workers = check_int(workers, "run_jobs: workers")
    server_workers = max(1, len(specs) * workers)
    folder = Path(tempfile.mkdtemp(prefix="gl-jobs-"))
    server = _Server(folder, memory, server_workers) if mode == "shared" else None
    try:
        run = _Run(mode, str(root), workers, batch_size, seed, str(server.socket) if server else None)
        results = _run_processes(run, specs, progress, stall_s, server.describe if server else (lambda: ""))
        status = server.status() if server else None
    finally:
        if server:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return _summary(run, specs, server_workers, results, status)


@dataclass(frozen=True)
class _Run:
    """What every job process of one run is given besides its spec."""

    mode: str
    root: str
    workers: int
    batch_size: int
    seed: int
    socket: str | None  # the server's, in shared mode


# -- the parent: processes, progress, summary ------------------------------------------------
def _run_processes(
    run: _Run, specs: Sequence[JobSpec], progress: bool, stall_s: float, describe: Callable[[], str]
) -> dict[str, dict[str, Any]]:
    mode = run.mode
    ctx = mp.get_context("spawn")
    barrier, out, stop = ctx.Barrier(len(specs)), ctx.Queue(), ctx.Event()
    procs = {
        s.name: ctx.Process(target=_job_main, name=f"job-{s.name}", args=(run, s, barrier, out, stop)) for s in specs
    }
    foreground = {s.name for s in specs if not s.background}
    for proc in procs.values():
        proc.start()
    total = sum(len(s.indices) * s.epochs for s in specs)
    bar = tqdm(total=total, desc=f"{len(specs)} job(s), {mode}", unit="img", disable=not progress, leave=False)
    results: dict[str, dict[str, Any]] = {}
    last = time.monotonic() + _START_TIMEOUT_S  # imports and set-up first
    try:
        while len(results) < len(specs):
            try:
                msg = out.get(timeout=1.0)
            except queue.Empty:
                _check_alive(procs, results)
                if time.monotonic() - last > stall_s:
                    raise WorkerError(
                        f"{mode} run: no job got a batch for {stall_s:.0f} s; unfinished: "
                        f"{sorted(set(procs) - set(results))}{describe()}"
                    ) from None
                continue
            last = max(last, time.monotonic())
            if msg[0] == "progress":
                bar.update(msg[1])
            elif msg[0] == "done":
                results[msg[1]] = msg[2]
                if foreground and foreground <= set(results):
                    stop.set()  # background jobs end after their current batch
            else:
                raise WorkerError(f"job {msg[1]!r} ({mode} mode) failed:\n{msg[2]}")
        for proc in procs.values():
            proc.join(timeout=30)
    finally:
        bar.close()
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
    return results


def _check_alive(procs: dict[str, Any], results: dict[str, Any]) -> None:
    for name, proc in procs.items():
        if name not in results and not proc.is_alive():
            raise WorkerError(f"job {name!r} exited with code {proc.exitcode} before reporting")


def _summary(
    run: _Run,
    specs: Sequence[JobSpec],
    server_workers: int,
    results: dict[str, dict[str, Any]],
    status: dict[str, Any] | None,
) -> dict[str, Any]:
    keys = _keys(run.root)
    jobs, starts, ends = [], [], []
    for spec in specs:
        r = dict(results[spec.name])
        starts.append(r.pop("start"))
        ends.append(r.pop("end"))
        r["exact_once"] = _exact_once(r.pop("keys"), [keys[i] for i in spec.indices], spec.background)
        r["epochs_done"] = r["samples"] / len(spec.indices)
        jobs.append(
            {
                "name": spec.name,
                "set_size": len(spec.indices),
                "epochs": spec.epochs,
                "background": spec.background,
                "sleep_per_batch_s": spec.sleep,
                **r,
            }
        )
    wall = max(ends) - min(starts)
    union = len(set().union(*(s.indices for s in specs)))
    samples = sum(r["samples"] for r in jobs)
    decodes = status["decodes"] if status else sum(r["decodes"] for r in jobs)
    summary: dict[str, Any] = {
        "mode": run.mode,
        "jobs": jobs,
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / wall,
        "decodes": decodes,
        "union": union,
        "decodes_per_union": decodes / union,
    }
    if status is None:
        summary["workers"] = {"per_job": run.workers, "total": run.workers * len(specs)}
    else:
        summary["workers"] = {"per_job": 0, "server": server_workers, "total": server_workers}
        summary["pool_bytes"] = status["pool"]["capacity"]
        summary["server"] = {k: status[k] for k in ("pid", "requests", "decodes", "decodes_saved", "pool")}
    return summary


def _exact_once(epochs: list[list[str]], expected: list[str], background: bool) -> bool:
    """Every epoch saw the set exactly once; a stopped background job's last epoch, a part of it once."""
    want = sorted(expected)
    for e, seen in enumerate(epochs):
        if background and e == len(epochs) - 1 and len(seen) < len(want):
            if len(set(seen)) != len(seen) or not set(seen) <= set(want):
                return False
        elif sorted(seen) != want:
            return False
    return True


@lru_cache(maxsize=4)
def _keys(root: str) -> tuple[str, ...]:
    """Every record's key, in index order: what each job's epoch is checked against."""
    source = ImageFolder(root)
    return tuple(source[i]["__key__"] for i in range(len(source)))


class _Server:
    """A server process of our own for one run, at a socket in `folder`."""

    def __init__(self, folder: Path, memory: str | int, workers: int) -> None:
        from globalloader.service import launcher

        self.socket, self._log = folder / "server.sock", folder / "server.log"
        cmd = launcher.server_command(self.socket, memory, workers)
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while not launcher.is_running(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerGoneError(f"the globalloader server for this run did not start: {self._tail()}")
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        from globalloader.service import launcher

        return launcher.status(self.socket)

    def describe(self) -> str:
        """The server's view, for an error message: its jobs and its arena."""
        try:
            status = self.status()
        except (ServerGoneError, OSError) as exc:
            return f"; the server does not answer ({exc})"
        jobs = ", ".join(f"{j['name']}: {j['delivered']}/{j['size']} delivered" for j in status["jobs"])
        return f"; server: {jobs}; pool {status['pool']}"

    def stop(self) -> None:
        from globalloader.service import launcher

        if self.proc.poll() is None:
            try:
                launcher.stop(self.socket)
                self.proc.wait(timeout=30)
            except (ServerGoneError, OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                self.proc.wait(timeout=10)

    def _tail(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-2000:] or "(no output)"
        except OSError:
            return "(no log)"


# -- a job process ---------------------------------------------------------------------------
def _job_main(run: _Run, spec: JobSpec, barrier: Any, out: Any, stop: Any) -> None:
    """One job: set up (imports, chain), wait for the others, run its epochs, report."""
    try:
        job = _torch_job if run.mode == "torch" else _loader_job
        out.put(("done", spec.name, job(run, _Job(spec, out, stop if spec.background else None), barrier)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises WorkerError
        barrier.abort()
        out.put(("error", spec.name, traceback.format_exc()))
        sys.exit(1)


@dataclass
class _Job:
    """What a job process needs besides the loader: its spec, the parent's queue, its stop signal."""

    spec: JobSpec
    out: Any
    stop: Any  # an Event for a background job, else None

    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def epoch(self, batches: Iterable[Any]) -> list[str]:
        """The training loop of one epoch: a step that reads the batch, then the job's own delay."""
        keys: list[str] = []
        for batch in batches:
            train_step(batch["image"])
            keys.extend(batch["__key__"])
            self.out.put(("progress", len(batch["__key__"])))
            if self.spec.sleep:
                time.sleep(self.spec.sleep)
            if self.stopped():
                break
        return keys


def _loader_job(run: _Run, job: _Job, barrier: Any) -> dict[str, Any]:
    spec, share, socket = job.spec, run.mode == "shared", run.socket
    chain = job_chain(run.root, spec.indices, run.batch_size, run.seed)
    w = 0 if share else run.workers
    barrier.wait(timeout=_START_TIMEOUT_S)
    start = time.monotonic()
    with Loader(chain, workers=w, prefetch=max(2, 2 * w), share=share, server=socket, name=spec.name) as loader:
        epochs = []
        for epoch in range(spec.epochs):
            if job.stopped():
                break
            loader.set_epoch(epoch)
            epochs.append(job.epoch(loader))
        result = _job_result(epochs, start, time.monotonic())
        if share:  # read before closing: the server forgets a job when it leaves
            from globalloader.service import launcher

            assert socket is not None, "a shared run always has its server's socket"
            mine = [j for j in launcher.status(Path(socket))["jobs"] if j["pid"] == os.getpid()]
            result["followed_share"] = mine[0]["followed_share"] if mine else None
        else:
            result["decodes"] = loader.stats()["stages"].get("decode", {}).get("items", 0)
    return result


def job_sample(source: ImageFolder, index: int, seed: int = 0, epoch: int = 0) -> dict[str, Any]:
    """Sample `index` as `job_chain` makes it (same functions, same per-sample seed), for loaders
    that run the functions themselves."""
    return _OWN(_SHARED(source[index]), rng=generator(seed, epoch, index, _OWN_POSITION))


class _TorchSubset:
    """The same source and functions as `job_chain`, over the job's set, as a torch map-style Dataset."""

    def __init__(self, root: str, indices: Sequence[int], seed: int) -> None:
        self.source, self.indices, self.seed, self.epoch = ImageFolder(root), list(indices), seed, 0

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> dict[str, Any]:
        return job_sample(self.source, self.indices[k], self.seed, self.epoch)


def _torch_job(run: _Run, job: _Job, barrier: Any) -> dict[str, Any]:
    import torch

    seed, workers = run.seed, run.workers
    data = _TorchSubset(run.root, job.spec.indices, seed)
    barrier.wait(timeout=_START_TIMEOUT_S)
    start = time.monotonic()
    epochs = []
    for epoch in range(job.spec.epochs):
        if job.stopped():
            break
        data.epoch = epoch  # workers start per epoch (not persistent), so they see it
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        # fork, as a training script started from a shell gets on Linux: this process was
        # spawned, and spawned workers would re-import torch every epoch.
        context = "fork" if workers else None
        loader = torch.utils.data.DataLoader(
            cast("torch.utils.data.Dataset[dict[str, Any]]", data),  # duck-typed: torch is imported lazily
            batch_size=run.batch_size,
            shuffle=True,
            num_workers=workers,
            generator=generator,
            multiprocessing_context=context,
        )
        epochs.append(job.epoch(loader))
    result = _job_result(epochs, start, time.monotonic())
    result["decodes"] = result["samples"]  # each delivered sample was decoded in a worker (prefetch aside)
    return result


def _job_result(epochs: list[list[str]], start: float, end: float) -> dict[str, Any]:
    samples = sum(len(keys) for keys in epochs)
    seconds = end - start
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "start": start,
        "end": end,
        "keys": epochs,
    }
