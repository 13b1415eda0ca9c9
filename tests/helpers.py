"""Shared test helpers: the save/restore/compare check run against every operator and the Loader, and
servers started and always stopped through the command line of this interpreter."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import math
import multiprocessing
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from globalloader.service.launcher import is_running


def same(a: Any, b: Any) -> bool:
    """Deep equality for batches: dicts, sequences, NumPy arrays and tensors (dtype and shape too);
    NaN equals NaN (a null read from a float column)."""
    if type(a).__module__ == "torch" and type(b).__module__ == "torch":
        a, b = a.numpy(), b.numpy()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b  # NaN: the same missing value
    return a == b


def check_resume(make: Callable[[], Any], at: int) -> list[Any]:
    """Take `at` items, save state, and check a fresh object loaded with it yields exactly the
    rest of an uninterrupted run; and that the resumed run, saved again two items later, resumes
    exactly too. `make()` returns a DatasetIterator or a Loader. Returns the uninterrupted run."""
    first = make()
    full = list(iter(first))
    obj = make()
    it = iter(obj)
    head = [next(it) for _ in range(at)]
    state = obj.state_dict()
    assert same(head, full[:at]), "the interrupted run differs from the uninterrupted one"
    fresh = make()
    fresh.load_state_dict(state)
    it = iter(fresh)
    more = min(2, len(full) - at)
    rest = [next(it) for _ in range(more)]
    again_state = fresh.state_dict()
    rest += list(it)
    assert same(rest, full[at:]), f"resume after {at} of {len(full)} items does not continue exactly"
    again = make()
    again.load_state_dict(again_state)
    assert same(list(iter(again)), full[at + more :]), f"a run resumed at {at} does not resume again exactly"
    for o in (first, obj, fresh, again):
        if hasattr(o, "close"):
            o.close()
    return full


# -- the global loader service --------------------------------------------------------

JOB = Path(__file__).parent / "service" / "job.py"
CLI = [sys.executable, "-m", "globalloader"]  # the command through this interpreter: no PATH needed


def pool_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("gl-pool-")}


def shm_held(name: str) -> tuple[int, int]:
    """(descriptors, mappings) this process has of the /dev/shm file `name`, unlinked or not."""
    target = f"/dev/shm/{name}"

    def same(path: str) -> bool:
        return path.removesuffix(" (deleted)") == target

    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed meanwhile
            fds += same(os.readlink(f"/proc/self/fd/{fd}"))
    lines = Path("/proc/self/maps").read_text().splitlines()
    return fds, sum(1 for line in lines if len(line.split(maxsplit=5)) == 6 and same(line.split(maxsplit=5)[5]))


def server_pid(path: Path) -> int | None:
    """The pid of the process listening at socket `path` (from the kernel, so it answers even for
    a server too stuck to reply), or None if nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    with sock:
        try:
            sock.connect(str(path))
        except OSError:
            return None
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def _gone(pid: int) -> bool:
    """True once `pid` has exited (reaping it if it is our child, as an auto-started server is)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return _stat_fields(pid)[:1] in ([], ["Z"], ["X"])


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [state, ppid, ...] ([] once the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _descendants(pid: int) -> set[int]:
    """Every process under `pid` now: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat_fields(int(entry))
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        new = [child for child in children.get(todo.pop(), []) if child not in found]
        found.update(new)
        todo.extend(new)
    return found


def stop_ray(then: Callable[[], None] | None = None, timeout: float = 10.0) -> None:
    """ray.shutdown() (and `then`, a local Cluster's shutdown), leaving no process of the local
    Ray behind: an actor's worker can outlive its raylet (a BatchQueue was found running 20
    minutes after its tests), so the Ray processes under this one, taken before the shutdown,
    that still run `timeout` seconds after it are killed."""
    import ray

    def command(pid: int) -> bytes:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        return b""

    started = {pid: _stat_fields(pid)[19:20] for pid in _descendants(os.getpid()) if b"ray" in command(pid)}
    ray.shutdown()
    if then is not None:
        then()
    deadline = time.monotonic() + timeout
    while True:  # the same process (its start time), not a new one that took its pid
        left = [pid for pid, start in started.items() if not _gone(pid) and _stat_fields(pid)[19:20] == start]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop_server(path: Path, pid: int | None = None, timeout: float = 20.0) -> int | None:
    """Stop the server at `path` whatever state it is in, leaving no process, socket or pool;
    return its pid (None if nothing listened there).

    `globalloader stop` first; a server still there after `timeout` (stuck, or deaf) is killed,
    and then its socket file and its pool in /dev/shm are removed, as a crashed one's would be.
    For test finalizers: it never raises because the server is already gone.
    """
    deadline = time.monotonic() + timeout
    while pid is None and path.exists() and time.monotonic() < deadline:  # a busy server may be slow to accept
        pid = server_pid(path)
        if pid is None:
            time.sleep(0.1)
    if pid is None:
        path.unlink(missing_ok=True)  # no one listens: what a dead server left
        return None
    if not _gone(pid):
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*CLI, "stop", "--socket", str(path)], capture_output=True, timeout=timeout)
    deadline = time.monotonic() + timeout
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(pid):
        os.kill(pid, signal.SIGKILL)
        while not _gone(pid):
            time.sleep(0.05)
    for leftover in (path, Path("/dev/shm") / f"gl-pool-{pid}"):
        leftover.unlink(missing_ok=True)
    return pid


class Server:
    """A server process for one test, stopped by `stop()`, or at the latest when the object is
    collected or the test session ends, so that a failing test leaves no server behind."""

    def __init__(self, socket: Path, memory: str = "32M", workers: int = 2) -> None:
        self.socket = socket
        with open(socket.with_suffix(".log"), "w") as log:
            self.proc = subprocess.Popen(
                [*CLI, "serve", "--socket", str(socket), "--memory", memory, "--workers", str(workers)],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, socket)
        deadline = time.monotonic() + 20
        while not is_running(socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not start: {socket.with_suffix('.log').read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._finalizer()

    def status_table(self) -> subprocess.CompletedProcess[str]:
        """`globalloader status --once` against this server, 200 columns wide: what a user sees."""
        return subprocess.run(
            [*CLI, "status", "--once", "--socket", str(self.socket)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )

    def job(self, out: Path, *args: str) -> subprocess.Popen:
        """Start tests/service/job.py against this server."""
        return subprocess.Popen(
            [sys.executable, str(JOB), str(self.socket), str(out), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


class Dashboard:
    """`globalloader status --web --port 0` for one test, as its own process; `url` has the token."""

    def __init__(self, socket: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "status", "--web", "--port", "0", "--socket", str(socket)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(log, "w"),  # noqa: SIM115 - the child owns it; closed with the process
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        match = re.search(r"(http://127\.0\.0\.1:(\d+))/\?token=([\w-]+)", line)
        if not match:
            self.stop()
            raise AssertionError(f"the dashboard printed no address: {line!r} {log.read_text()}")
        self.url, self.base, self.port, self.token = match.group(0), match.group(1), int(match.group(2)), match.group(3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _stop_process(proc: subprocess.Popen, path: Path) -> None:
    if proc.poll() is None:
        stop_server(path, proc.pid)
    proc.wait()


def strictly_equal(a: object, b: object) -> bool:
    """Equal values of the same Python types; arrays of the same dtype, shape and writability; NaN equals NaN."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and (a.dtype, a.shape, a.flags.writeable) == (b.dtype, b.shape, b.flags.writeable)
            and all(strictly_equal(x, y) for x, y in zip(list(a), list(b), strict=True))
        )
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(strictly_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(strictly_equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def patch_header(tar: bytes, header: int, at: int, field: bytes) -> bytes:
    """`tar` with `field` written at byte `at` of the header at offset `header`, and that header's
    checksum made right again, as a writer that wrote a wrong field would have made it."""
    blob = bytearray(tar)
    blob[header + at : header + at + len(field)] = field
    blob[header + 148 : header + 156] = b" " * 8
    blob[header + 148 : header + 156] = b"%06o\0 " % sum(blob[header : header + 512])
    return bytes(blob)


def damaged_tars() -> dict[str, tuple[bytes, str]]:
    """Tar shards damaged in each way a reader must refuse, each made from a real writer's output
    (webdataset's TarWriter, or tarfile's pax format with a size record), with the start of the
    SourceError every read path raises (a regular expression; `{url}` stands for the shard)."""
    import io
    import tarfile

    import webdataset as wds

    out = io.BytesIO()
    with wds.TarWriter(out) as writer:  # pax headers (fractional mtimes) before every member
        for i in range(6):
            writer.write({"__key__": f"s{i}", "bin": bytes(1500), "txt": f"t{i}"})
    shard = out.getvalue()
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        members = tar.getmembers()  # .offset: a member's first header (its pax header), .offset_data
    bin0, txt0, bin1, bin3 = members[0], members[1], members[2], members[6]
    end = members[-1].offset_data + 512  # the end-of-archive marker (every member here has < 512 bytes of .txt)

    def resized(header: int, size: int) -> bytes:
        return patch_header(shard, header, 124, b"%011o\0" % size)

    flipped = bytearray(shard)
    flipped[bin3.offset_data - 512 + 3] ^= 0x55
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(6):
            info = tarfile.TarInfo(f"s{i}.bin")
            info.size, info.pax_headers = 1500, {"size": "1500"}
            tar.addfile(info, io.BytesIO(bytes(range(250)) * 6))
    paxed = out.getvalue()
    pax_header = 512 + 512  # s0.bin's own header, after its pax header and the block of its records
    swallowed = (
        rf"corrupt tar {{url}}: the size in the header at offset {bin0.offset_data - 512} takes in "
        rf"the member whose header is at offset {txt0.offset_data - 512}"
    )
    return {
        "size smaller, over zero bytes": (
            resized(bin0.offset_data - 512, 100),
            rf"corrupt tar {{url}}: a zero block at offset {bin0.offset_data + 512} ends the archive",
        ),
        "size larger, over the next member": (
            resized(bin0.offset_data - 512, bin1.offset - bin0.offset_data - 100),  # its end: bin1's
            swallowed,
        ),
        "size larger, into the next data": (
            resized(bin0.offset_data - 512, bin1.offset_data + 512 - bin0.offset_data - 100),
            rf"corrupt tar {{url}}: a zero block at offset {bin1.offset_data + 512} ends the archive",
        ),
        "size past the end of any file": (
            patch_header(shard, bin0.offset_data - 512, 124, b"\x80" + (1 << 80).to_bytes(11, "big")),  # base-256
            rf"truncated tar {{url}}: member 's0.bin' at offset {bin0.offset_data - 512} needs {1 << 80} bytes",
        ),
        "cut at a header": (shard[: bin3.offset], rf"truncated tar {{url}}: the file ends at byte {bin3.offset},"),
        "cut in a member": (
            shard[: bin3.offset_data + 100],
            rf"truncated tar {{url}}: member 's3.bin' at offset {bin3.offset_data - 512} needs 1500 bytes",
        ),
        "cut in the end marker": (
            shard[: end + 512],
            rf"truncated tar {{url}}: the file ends at byte {end + 512}, inside the end-of-archive marker",
        ),
        "two archives joined": (shard + shard, rf"corrupt tar {{url}}: a zero block at offset {end} ends the archive"),
        "bad checksum in the middle": (
            bytes(flipped),
            rf"corrupt tar {{url}}: bad header checksum at offset {bin3.offset_data - 512}",
        ),
        "negative pax size": (
            paxed.replace(b"size=1500", b"size=-150", 1),
            rf"corrupt tar {{url}}: bad pax size '-150' for the member at offset {pax_header}",
        ),
        "non-numeric pax size": (
            paxed.replace(b"size=1500", b"size=15x0", 1),
            rf"corrupt tar {{url}}: bad pax size '15x0' for the member at offset {pax_header}",
        ),
    }


def every_arrow_type(n: int) -> Any:
    """Columns of every kind Parquet and its Arrow copy read their own way, with nulls where they
    change the rules."""
    import pyarrow as pa

    ids = list(range(n))
    return pa.table(
        {
            "id": ids,
            "i32": pa.array(ids, pa.int32()),
            "f32": pa.array([None if i % 5 == 0 else i / 3 for i in ids], pa.float32()),
            "f16": pa.array(np.arange(n, dtype=np.float16)),
            "int_with_null": pa.array([None if i == 77 else i for i in ids], pa.int16()),
            "flag": [i % 3 == 0 for i in ids],
            "flag_with_null": [None if i == 50 else i % 2 == 0 for i in ids],
            "text": [None if i % 9 == 0 else f"s{i}é" for i in ids],
            "large_text": pa.array([f"x{i}" for i in ids], pa.large_string()),
            "blob": [bytes([i % 256]) * (i % 4) for i in ids],
            "ints": [None if i % 11 == 0 else list(range(i % 5)) for i in ids],
            "floats": [[i / 2] for i in ids],
            "ints_with_null_item": [[1, None] if i == 30 else [i] for i in ids],
            "texts": [["a", str(i)] for i in ids],
            "flags": [[True, i % 2 == 0] for i in ids],
            "nested": [[[i], [1, 2]] for i in ids],
            "vector": pa.array([[float(i), 1.0] for i in ids], pa.list_(pa.float32(), 2)),
            "vector_with_null": pa.array([None if i == 3 else [i, 1] for i in ids], pa.list_(pa.int64(), 2)),
            "struct": [{"a": i, "b": None if i % 2 else "q"} for i in ids],
            "time": pa.array([datetime.datetime(2020, 1, 1) + datetime.timedelta(seconds=i) for i in ids]),
            "price": pa.array([decimal.Decimal(i) / 4 for i in ids], pa.decimal128(10, 2)),
            "category": pa.array([f"c{i % 3}" for i in ids]).dictionary_encode(),
            "mapping": pa.array([[("k", i)] for i in ids], pa.map_(pa.string(), pa.int64())),
        }
    )


@contextlib.contextmanager
def small_filesystem(folder: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` (mount's syntax: "2m") mounted on the new folder `folder`, private to
    this user (mode 0700, as a cache folder must be), unmounted after: a full disk or a read-only
    one for real (tests run as root, where a chmod 0555 folder does not stop writes). Skips the
    test where mounting is not permitted."""
    import pytest

    folder.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"a small filesystem cannot be mounted here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def at_once(method: str, target: Callable[..., None], *args: Any, processes: int = 2) -> list[Any]:
    """Run `target(*args, out, start)` in `processes` processes (`method`: fork or spawn) that wait
    at the barrier `start` together, and return what each put on the queue `out`; each must end well."""
    ctx = multiprocessing.get_context(method)
    out, start = ctx.Queue(), ctx.Barrier(processes)
    procs = [ctx.Process(target=target, args=(*args, out, start)) for _ in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results
