"""Facts about processes that every worker pool needs: how did a child end, and the per-process
tuning a worker does first. (Whether a pid is alive: `globalloader._pids`.)"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys


def tune_allocator() -> None:
    """Keep freed image buffers in the heap instead of returning them to the OS after each sample.

    glibc serves blocks above its mmap threshold (128 KiB at first) with fresh mappings, so every
    decoded image costs page faults and zeroing: ~0.7 ms of a ~1.6 ms decode + to-array here.
    Raising the thresholds lets workers reuse the same pages sample after sample.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the default allocator is fine, only slower
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD


def single_threaded_torch() -> None:
    """In a forked worker: if the parent had imported torch, use one intra-op thread. The parent's
    OpenMP pool did not survive the fork, and a torch op sized for it can deadlock the child;
    one thread per worker is also what the workers' parallelism wants."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def exit_reason(code: int | None) -> str:
    """How a child process ended, from its exit code, in the words torch's DataLoader uses plus
    the signal's name: "is killed by signal: Killed (killed by SIGKILL)"."""
    if code is not None and code < 0:
        try:
            return f"is killed by signal: {signal.strsignal(-code)} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"is killed by signal {-code}"
    return f"exited unexpectedly with exit code {code}"
