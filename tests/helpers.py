"""Shared test helpers: the save/restore/compare check run against every operator and the Loader."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from globalloader.service.launcher import is_running


def same(a: Any, b: Any) -> bool:
    """Deep equality for batches: dicts, sequences, NumPy arrays and tensors (dtype and shape too)."""
    if type(a).__module__ == "torch" and type(b).__module__ == "torch":
        a, b = a.numpy(), b.numpy()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
            and a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_resume(make: Callable[[], Any], at: int) -> list[Any]:
    """Take `at` items, save state, and check a fresh object loaded with it yields exactly the
    rest of an uninterrupted run. `make()` returns a DatasetIterator or a Loader. Returns the
    uninterrupted run."""
    first = make()
    full = list(iter(first))
    obj = make()
    it = iter(obj)
    head = [next(it) for _ in range(at)]
    state = obj.state_dict()
    assert same(head, full[:at]), "the interrupted run differs from the uninterrupted one"
    fresh = make()
    fresh.load_state_dict(state)
    rest = list(iter(fresh))
    assert same(rest, full[at:]), f"resume after {at} of {len(full)} items does not continue exactly"
    for o in (first, obj, fresh):
        if hasattr(o, "close"):
            o.close()
    return full


# -- the global loader service --------------------------------------------------------

JOB = Path(__file__).parent / "service" / "job.py"


def pool_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("gl-pool-")}


class Server:
    def __init__(self, socket: Path, memory: str = "32M", workers: int = 2) -> None:
        self.socket = socket
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "globalloader.cli", "serve", "--socket", str(socket),
             "--memory", memory, "--workers", str(workers)],
            stdout=open(socket.with_suffix(".log"), "w"), stderr=subprocess.STDOUT, text=True,
        )
        deadline = time.monotonic() + 20
        while not is_running(socket):
            assert self.proc.poll() is None, f"server exited: {socket.with_suffix('.log').read_text()}"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            subprocess.run([sys.executable, "-m", "globalloader.cli", "stop", "--socket", str(self.socket)], check=True)
            self.proc.wait(timeout=20)

    def job(self, out: Path, *args: str) -> subprocess.Popen:
        """Start tests/service/job.py against this server."""
        return subprocess.Popen([sys.executable, str(JOB), str(self.socket), str(out), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
