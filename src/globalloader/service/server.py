"""The global loader server: one per machine, many training jobs as clients.

Jobs register their chain's shared prefix (source + `map(..., shared=True)` maps, cloudpickled)
and their index set. Jobs whose prefix fingerprints match form a group with one joint sampler:
each request is answered with the sampler's next index for that job; the sample is read and
decoded once by the server's worker processes into the buffer pool, and every job that takes it
gets a ticket (offset and layout in the shared arena) and a reference it releases after use.

The main loop is single-threaded (a selector over the listening socket, client sockets and
worker pipes), so the sampler and the pool need no locks. A client whose socket closes, or that
sends nothing for `SILENCE_S` seconds, is removed and its references released.
"""

from __future__ import annotations

import errno
import hashlib
import os
import selectors
import signal
import socket
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from globalloader.errors import GlobalLoaderError, ServerGone
from globalloader.sampling.joint import JointSampler
from globalloader.service import arena, protocol
from globalloader.service.decoder import DecoderPool
from globalloader.service.pool import BufferPool


@dataclass
class Job:
    id: int
    sock: socket.socket
    name: str
    pid: int
    group: "Group"
    size: int = 0  # samples in this epoch's set
    seed: int = 0
    set_digest: bytes = b""  # of this epoch's set: an unchanged set just starts a new epoch
    epoch: int = 0
    wanted: int = 0  # tickets the client asked for and has not been sent
    drawn: int = 0  # this epoch
    delivered: int = 0  # this epoch
    last_seen: float = field(default_factory=time.monotonic)
    framer: protocol.Framer = field(default_factory=protocol.Framer)
    rate: list[tuple[float, int]] = field(default_factory=list)  # (time, delivered) samples

    def samples_per_s(self) -> float:
        if len(self.rate) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self.rate[0], self.rate[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass
class Group:
    """Jobs sharing one prefix: one sampler, one key space in the pool."""

    fingerprint: str
    prefix: bytes
    sampler: JointSampler
    jobs: dict[int, Job] = field(default_factory=dict)
    waiters: dict[int, list[tuple[Job, int]]] = field(default_factory=lambda: defaultdict(list))
    requests: int = 0
    decodes: int = 0


class Server:
    def __init__(self, socket_path: Path, memory: int, workers: int) -> None:
        self.socket_path = Path(socket_path)
        self.arena = arena.create(memory)
        self.pool = BufferPool(memory, on_evict=self._evicted, wanted=self._wanted)
        self.groups: dict[str, Group] = {}
        self.jobs: dict[int, Job] = {}
        self._next_job = 1
        self._selector = selectors.DefaultSelector()
        self.decoders = DecoderPool(workers, self)
        self._listener = self._listen()
        self._running = True
        self.started = time.time()

    # -- sockets -----------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        path = self.socket_path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists():
            path.unlink()  # checked stale by the launcher before we got here
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, self._accept)
        return sock

    def _accept(self, _: Any) -> None:
        conn, _addr = self._listener.accept()
        conn.setblocking(True)
        job = Job(0, conn, "?", 0, None)  # type: ignore[arg-type]  # becomes a job on "hello"
        self._selector.register(conn, selectors.EVENT_READ, lambda _: self._readable(job))

    def _readable(self, job: Job) -> None:
        try:
            data = job.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._drop(job, "closed its connection")
            return
        job.last_seen = time.monotonic()
        for msg in job.framer.feed(data):
            handler = getattr(self, f"_on_{msg[0]}", None)
            if handler is None:
                self._send(job, "error", -1, -1, f"unknown message {msg[0]!r}")
                continue
            handler(job, *msg[1:])
            if job.sock.fileno() < 0:
                return  # dropped or answered-and-closed while handling

    def _send(self, job: Job, *msg: Any) -> None:
        try:
            protocol.send(job.sock, *msg)
        except OSError:
            self._drop(job, "stopped reading")

    # -- messages ----------------------------------------------------------------------------
    def _on_hello(self, job: Job, info: dict[str, Any]) -> None:
        group = self.groups.get(info["prefix_fp"])
        if group is None:
            group = Group(info["prefix_fp"], info["prefix"], JointSampler())  # fresh stream: see JointSampler
            self.groups[group.fingerprint] = group
        job.id, self._next_job = self._next_job, self._next_job + 1
        job.name, job.pid, job.group = str(info.get("name") or f"job-{job.id}"), int(info["pid"]), group
        job.seed = int(info.get("seed", 0))
        self.jobs[job.id] = job
        group.jobs[job.id] = job
        self._start_epoch(job, int(info["epoch"]), info["indices"])
        self._send(job, "welcome", job.id, self.arena.name, self.pool.capacity)

    def _on_epoch(self, job: Job, epoch: int, indices: np.ndarray) -> None:
        self._start_epoch(job, epoch, indices)

    def _start_epoch(self, job: Job, epoch: int, indices: np.ndarray) -> None:
        sampler = job.group.sampler
        digest = hashlib.sha1(np.ascontiguousarray(indices, dtype=np.int64).tobytes()).digest()
        if job.id in sampler.stats() and digest == job.set_digest:
            sampler.new_epoch(job.id, epoch)  # same set: other jobs' regions stay as they are
        else:
            if job.id in sampler.stats():
                sampler.remove_job(job.id)
            sampler.add_job(job.id, indices, seed=job.seed, epoch=epoch)
        job.set_digest = digest
        job.epoch, job.size, job.wanted = epoch, len(indices), 0
        job.drawn = job.delivered = 0
        job.rate = [(time.monotonic(), 0)]

    def _on_want(self, job: Job, n: int) -> None:
        job.wanted += n
        self._pump(job)

    def _on_release(self, job: Job, indices: list[int]) -> None:
        fp = job.group.fingerprint
        for index in indices:
            self.pool.release((fp, index), job.id)
        self.decoders.retry_reservations(self.pool)

    def _on_heartbeat(self, job: Job) -> None:
        self._send(job, "heartbeat")

    def _on_bye(self, job: Job) -> None:
        self._drop(job, None)

    def _on_status(self, job: Job) -> None:
        self._send(job, "status", self.status())
        self._forget_connection(job)

    def _on_stop(self, job: Job) -> None:
        self._send(job, "stopping")
        self._running = False

    # -- scheduling --------------------------------------------------------------------------
    def _pump(self, job: Job) -> None:
        """Draw as many indices as the job asked for and deliver or load each. (A client never
        asks for more than its set: it knows when its epoch ends.)"""
        group, sampler = job.group, job.group.sampler
        while job.wanted > 0:
            try:
                index = sampler.next(job.id)
            except StopIteration:
                job.wanted = 0
                break
            seq = job.drawn
            job.drawn += 1
            job.wanted -= 1
            group.requests += 1
            key = (group.fingerprint, index)
            entry = self.pool.get(key)
            if entry is not None and entry.ready:
                self._deliver(job, seq, index)
            else:
                group.waiters[index].append((job, seq))
                if entry is None and len(group.waiters[index]) == 1:
                    self.decoders.load(group.fingerprint, group.prefix, index)

    def _deliver(self, job: Job, seq: int, index: int) -> None:
        entry = self.pool.acquire((job.group.fingerprint, index), job.id)
        job.delivered += 1
        self._send(job, "ticket", seq, index, entry.offset, entry.layout)

    # -- decoder events (called by DecoderPool) ----------------------------------------------
    def loaded(self, fp: str, index: int, layout: Any) -> None:
        group = self.groups.get(fp)
        self.pool.commit((fp, index), layout)
        if group is None:
            return
        group.decodes += 1
        group.sampler.loaded(index)
        for job, seq in group.waiters.pop(index, []):
            if job.id in self.jobs:
                self._deliver(job, seq, index)

    def failed(self, fp: str, index: int, message: str) -> None:
        group = self.groups.get(fp)
        if group is None:
            return
        group.sampler.evicted(index)  # never stored: nobody may follow it
        for job, seq in group.waiters.pop(index, []):
            if job.id in self.jobs:
                job.delivered += 1
                self._send(job, "error", seq, index, message)

    def _evicted(self, key: tuple[str, int]) -> None:
        group = self.groups.get(key[0])
        if group is not None:
            group.sampler.evicted(key[1])

    def _wanted(self, key: tuple[str, int]) -> bool:
        """Whether a job may still take this sample this epoch: the pool evicts others first."""
        group = self.groups.get(key[0])
        return group is not None and group.sampler.wanted(key[1])

    # -- liveness ----------------------------------------------------------------------------
    def _forget_connection(self, job: Job) -> None:
        try:
            self._selector.unregister(job.sock)
        except (KeyError, ValueError):
            pass
        job.sock.close()

    def _drop(self, job: Job, why: str | None) -> None:
        """Remove a job (left, crashed or silent): release its references; others go on."""
        self._forget_connection(job)
        if self.jobs.pop(job.id, None) is None:
            return
        group = job.group
        group.jobs.pop(job.id, None)
        group.sampler.remove_job(job.id)
        for index in list(group.waiters):
            remaining = [(j, s) for j, s in group.waiters[index] if j.id != job.id]
            if remaining:
                group.waiters[index] = remaining
            else:
                del group.waiters[index]  # the load goes on; its sample lands in the LRU tier
        self.pool.release_holder(job.id)
        self.decoders.retry_reservations(self.pool)
        if why:
            print(f"globalloader server: job {job.name!r} (pid {job.pid}) {why}; removed", file=sys.stderr)

    def _check_silence(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if now - job.last_seen > protocol.SILENCE_S:
                self._drop(job, f"sent nothing for {protocol.SILENCE_S:.0f} s")
            else:
                job.rate = (job.rate + [(now, job.delivered)])[-10:]

    # -- status and main loop ----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        jobs = []
        for job in self.jobs.values():
            s = job.group.sampler.stats().get(job.id, {})
            requests = s.get("requests", 0)
            jobs.append({
                "name": job.name, "pid": job.pid, "size": job.size, "epoch": job.epoch,
                "delivered": job.delivered, "samples_per_s": round(job.samples_per_s(), 1),
                "followed_share": round(s.get("followed", 0) / requests, 3) if requests else 0.0,
            })
        requests = sum(g.requests for g in self.groups.values())
        decodes = sum(g.decodes for g in self.groups.values())
        return {
            "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1), "jobs": jobs,
            "pool": self.pool.stats(), "requests": requests, "decodes": decodes,
            "decodes_saved": requests - decodes, "workers": self.decoders.size,
        }

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_running", False))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_running", False))
        last_check = time.monotonic()
        try:
            while self._running:
                for key, _ in self._selector.select(timeout=0.5):
                    try:
                        key.data(key.fileobj)
                    except GlobalLoaderError as exc:
                        print(f"globalloader server: {exc}", file=sys.stderr)
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    self._check_silence()
                    self.decoders.check()
        finally:
            self.close()

    def close(self) -> None:
        for job in list(self.jobs.values()):
            self._forget_connection(job)
        self.decoders.close()
        try:
            self._listener.close()
            self.socket_path.unlink()
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        self.arena.close()


def main(argv: list[str] | None = None) -> int:
    """Run a server in this process (what `globalloader serve` and auto-start call)."""
    import argparse

    from globalloader.service.launcher import parse_size, take_over

    parser = argparse.ArgumentParser(prog="globalloader serve")
    parser.add_argument("--memory", default="2G", help="buffer pool size, e.g. 512M, 4G")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    parser.add_argument("--socket", default=None)
    args = parser.parse_args(argv)
    path = Path(args.socket) if args.socket else protocol.default_socket()
    memory = parse_size(args.memory)
    take_over(path)
    try:
        server = Server(path, memory, args.workers)
    except OSError as exc:
        raise ServerGone(f"cannot start a server at {path} with a {args.memory} pool") from exc
    print(f"globalloader server: pid {os.getpid()}, socket {path}, pool {args.memory}, {args.workers} workers",
          file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GlobalLoaderError as exc:  # started detached by a Loader: one line in the log
        cause = f" (cause: {exc.__cause__})" if exc.__cause__ else ""
        sys.exit(f"globalloader server: {exc}{cause}")
