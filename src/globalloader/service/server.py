"""The global loader server: one per socket (per machine and user), many training jobs as clients.

Jobs register their chain's shared prefix (source + `map(..., shared=True)` maps, cloudpickled)
and, for each pass over their data, their index set. Jobs whose prefix fingerprints match form a
group with one joint sampler: each request is answered with the sampler's next index for that
job; the sample is read and decoded once by the server's worker processes into the buffer pool,
and every job that takes it gets a ticket (offset and layout in the shared arena) and a
reference it releases after use.

The main loop is single-threaded (a selector over the listening socket, client sockets and
worker pipes), so the sampler and the pool need no locks. It survives its clients: a malformed
or oversized message, a connection that never says hello, a client that stops reading, a full
file table: each ends one connection with a log line. A failure while serving a job is sent to
that job as a named error. A job is removed when its connection closes, or when it is silent
and its process is gone: a live job that is merely busy (a long step holding the GIL, a SIGSTOP)
keeps its place.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import math
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from globalloader.errors import GlobalLoaderError, ProtocolError, ServerStartError
from globalloader.runtime.process import alive
from globalloader.sampling.joint import JointSampler
from globalloader.service import launcher, protocol
from globalloader.service.decoder import DecoderPool
from globalloader.service.pool import BufferPool
from globalloader.storage.cache import ObjectCache, default_root
from globalloader.transport import arena


@dataclass
class Connection:
    """One client socket: a job after its hello, else a one-shot request (status, stop)."""

    sock: socket.socket
    pid: int  # the peer's, from the kernel
    opened: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    framer: protocol.Framer = field(default_factory=protocol.Framer)
    queued: list[tuple] = field(default_factory=list)  # messages of this round of events, not yet framed
    outbox: bytearray = field(default_factory=bytearray)
    job: Job | None = None
    closing: bool = False  # close once the outbox is sent
    writing: bool = False  # the selector also waits for the socket to take more
    on_event: Any = None  # the selector's callback


@dataclass
class Job:
    id: int
    conn: Connection
    name: str
    group: Group
    timeout: float
    seed: int = 0
    run: int = -1  # the current pass; messages of earlier passes are stale
    open: bool = False  # the current pass still holds or awaits samples (not ended)
    size: int = 0  # samples in this pass's set
    set_digest: bytes = b""  # of this epoch's set: an unchanged set just starts a new epoch
    epoch: int = 0
    wanted: int = 0  # tickets the client asked for and has not been sent
    drawn: int = 0  # this pass
    asking_since: float = 0.0  # when its turn to draw began (see Server._draw)
    delivered: int = 0  # this pass
    consumed: int = 0  # this epoch, as the client last reported it
    earlier: int = 0  # consumed in the passes before this one (so the rate runs on across epochs)
    loop: tuple[float, float] = (0.0, 0.0)  # the training loop's seconds (waiting, working), as last reported
    rate: list[tuple[float, int, float, float]] = field(default_factory=list)  # (time, consumed, *loop) samples

    def samples_per_s(self) -> float:
        if len(self.rate) < 2:
            return 0.0
        (t0, n0, _, _), (t1, n1, _, _) = self.rate[0], self.rate[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def wait_share(self) -> float:
        """Of the loop's time over the last few seconds, the share it waited for data."""
        if len(self.rate) < 2:
            return 0.0
        (_, _, w0, b0), (_, _, w1, b1) = self.rate[0], self.rate[-1]
        total = (w1 - w0) + (b1 - b0)
        return (w1 - w0) / total if total > 0 else 0.0


@dataclass
class Group:
    """Jobs sharing one prefix: one sampler, one key space in the pool."""

    fingerprint: str
    prefix: bytes
    sampler: JointSampler
    jobs: dict[int, Job] = field(default_factory=dict)
    waiters: dict[int, list[tuple[Job, int, int]]] = field(default_factory=lambda: defaultdict(list))
    asking: dict[int, Job] = field(default_factory=dict)  # jobs with requests not drawn yet

    def timeout(self) -> float:
        return min((job.timeout for job in self.jobs.values()), default=300.0)


class Server:
    def __init__(self, socket_path: Path, memory: int, workers: int, idle_exit: float = 0.0) -> None:
        """Bind `socket_path` (whose lock the caller holds), then make the pool and workers."""
        self.socket_path = Path(socket_path)
        self.idle_exit = idle_exit
        self._selector = selectors.DefaultSelector()
        self._listener = self._listen()
        try:
            self.arena = arena.create(memory)
        except BaseException:
            self._close_listener()
            raise
        self.pool = BufferPool(memory, on_evict=self._evicted, wanted=self._wanted)
        self.groups: dict[str, Group] = {}
        self.jobs: dict[int, Job] = {}
        self.connections: dict[socket.socket, Connection] = {}
        self._unposted: dict[socket.socket, Connection] = {}  # connections with queued messages
        self._next_job = 1
        self.requests = self.decodes = 0  # since the start, over every group
        self._running = True
        self._accept_paused_until = 0.0
        self._idle_since = time.monotonic()
        self.started = time.time()
        self.finished: list[dict[str, Any]] = []  # recently ended jobs, for `status`
        self.decoders = DecoderPool(workers, self.arena.name, self, self._register_pipe, self._unregister)

    # -- sockets -----------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        path = self.socket_path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise ServerStartError(f"cannot bind {path}: {exc.strerror or exc}") from exc
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, self._accept)
        return sock

    def _register_pipe(self, conn: Any, callback: Callable[[], None]) -> None:
        self._selector.register(conn, selectors.EVENT_READ, lambda _: callback())

    def _unregister(self, fileobj: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fileobj)

    def _accept(self, _: Any) -> None:
        try:
            sock, _addr = self._listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._log(f"cannot accept a connection ({exc.strerror}); pausing accepts for 1 s")
                self._unregister(self._listener)
                self._accept_paused_until = time.monotonic() + 1.0
            return
        try:
            pid = protocol.check_peer(sock, "client")
        except (ProtocolError, OSError) as exc:
            self._log(f"refused a connection: {exc}")
            sock.close()
            return
        sock.setblocking(False)
        conn = Connection(sock, pid)
        conn.on_event = lambda mask: self._ready(conn, mask)
        self.connections[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn.on_event)

    def _readable(self, conn: Connection) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn, "closed its connection" if conn.job else None)
            return
        conn.last_seen = time.monotonic()
        try:
            messages = conn.framer.feed(data)
        except ProtocolError as exc:
            self._refuse(conn, exc)
            return
        for msg in messages:
            if conn.closing or conn.sock.fileno() < 0:
                return
            self._handle(conn, msg)

    def _handle(self, conn: Connection, msg: tuple) -> None:
        """Run one message's handler."""
        kind = msg[0]
        with self._serving(conn, kind):
            if conn.job is None and kind not in protocol.FIRST:
                raise ProtocolError(f"{kind!r} before 'hello'")
            if conn.job is not None and kind == "hello":
                raise ProtocolError("a second 'hello' on one connection")
            handler = getattr(self, f"_on_{kind}", None)
            if handler is None:
                raise ProtocolError(f"{kind!r} is not a request")
            handler(conn, *msg[1:])

    @contextlib.contextmanager
    def _serving(self, conn: Connection, kind: str) -> Iterator[None]:
        """Whatever serving a client's `kind` request raises goes back to that client only."""
        try:
            yield
        except ProtocolError as exc:
            self._refuse(conn, exc)
        except GlobalLoaderError as exc:  # the request cannot be served: say why, end the job
            self._fail(conn, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: the job hears of it, the server and other jobs go on
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self._log(
                f"error while serving {kind!r}: {type(exc).__name__}: {exc} "
                f"({Path(where.filename).name}:{where.lineno})"
            )
            self._send(conn, "error", "ServerError", f"the server failed on {kind!r}: {type(exc).__name__}: {exc}")
            self._end(conn, "ended after a server error")

    def _refuse(self, conn: Connection, exc: ProtocolError) -> None:
        self._log(f"connection from pid {conn.pid}: {exc}; closed")
        self._fail(conn, exc)

    def _fail(self, conn: Connection, exc: GlobalLoaderError) -> None:
        self._send(conn, "error", protocol.error_name(exc), str(exc))
        self._end(conn, f"failed: {exc}")

    def _send(self, conn: Connection, kind: str, *fields: Any) -> None:
        """Queue a message: what one round of events queued for a client goes out in one frame
        when the round is over (`_post`)."""
        if conn.sock.fileno() < 0:
            return
        conn.queued.append((kind, *fields))
        self._unposted[conn.sock] = conn

    def _post(self, conn: Connection) -> None:
        """Frame the queued messages and send what the socket takes; a client whose unread
        backlog passes SEND_LIMIT is dropped."""
        if not conn.queued or conn.sock.fileno() < 0:
            return
        waiting = bool(conn.outbox)  # then the socket is full: the selector flushes when it drains
        conn.outbox += protocol.frame_all(conn.queued)
        conn.queued = []
        if not waiting:
            self._flush(conn)
        if conn.sock.fileno() >= 0 and len(conn.outbox) > protocol.SEND_LIMIT:
            self._close(conn, f"stopped reading ({len(conn.outbox):,} bytes unsent)")

    def _post_all(self) -> None:
        while self._unposted:
            _, conn = self._unposted.popitem()
            self._post(conn)

    def _flush(self, conn: Connection) -> None:
        if conn.sock.fileno() < 0:
            return
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(conn, "stopped reading (connection broken)")
            return
        del conn.outbox[:sent]
        if not conn.outbox and conn.closing:
            self._close(conn, None)
        elif bool(conn.outbox) != conn.writing:  # ask to hear when it drains only while it is full
            conn.writing = bool(conn.outbox)
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.writing else 0)
            self._selector.modify(conn.sock, events, conn.on_event)

    def _ready(self, conn: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0 and not conn.closing:
            self._readable(conn)

    def _end(self, conn: Connection, why: str | None) -> None:
        """Close once what is queued for the client is sent (an error, a status)."""
        if conn.job is not None:
            self._drop(conn.job, why)
        conn.closing = True
        self._post(conn)
        if not conn.outbox:
            self._close(conn, None)

    def _close(self, conn: Connection, why: str | None) -> None:
        if conn.job is not None:
            self._drop(conn.job, why)
        self.connections.pop(conn.sock, None)
        self._unregister(conn.sock)
        conn.sock.close()

    # -- messages ----------------------------------------------------------------------------
    def _on_hello(self, conn: Connection, info: Any) -> None:
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("prefix_fp"), str)
            or not isinstance(info.get("prefix"), bytes)
        ):
            raise ProtocolError("'hello' needs a dict with prefix_fp (str) and prefix (bytes)")
        group = self.groups.get(info["prefix_fp"])
        if group is None:
            group = Group(info["prefix_fp"], info["prefix"], JointSampler())  # fresh stream: see JointSampler
            self.groups[group.fingerprint] = group
        timeout = float(info.get("timeout") or 300.0)
        job = Job(
            self._next_job,
            conn,
            str(info.get("name") or f"job-{self._next_job}"),
            group,
            timeout=timeout if timeout > 0 else 300.0,
            seed=int(info.get("seed", 0)),
        )
        self._next_job += 1
        conn.job = job
        self.jobs[job.id] = job
        group.jobs[job.id] = job
        self.finished = [f for f in self.finished if f["pid"] != conn.pid]
        self._send(conn, "welcome", job.id, self.arena.name, self.pool.capacity)

    def _on_run(self, conn: Connection, run: int, epoch: int, indices: Any) -> None:
        """A new pass: whatever the job held or awaited from earlier passes is let go."""
        job = conn.job
        assert job is not None
        indices = np.asarray(indices)
        if indices.ndim != 1 or indices.dtype.kind not in "iu":
            raise ProtocolError("'run' needs a 1-d integer array of indices")
        self._forget_pass(job)
        sampler = job.group.sampler
        digest = hashlib.sha1(np.ascontiguousarray(indices, dtype=np.int64).tobytes()).digest()
        if job.id in sampler.stats() and digest == job.set_digest:
            sampler.new_epoch(job.id, int(epoch))  # same set: other jobs' regions stay as they are
        else:
            if job.id in sampler.stats():
                sampler.remove_job(job.id)
            sampler.add_job(job.id, indices, seed=job.seed, epoch=int(epoch))
        self.pool.refile()  # this job now wants its whole set again
        job.set_digest, job.run, job.open = digest, int(run), True
        job.epoch, job.size, job.wanted = int(epoch), len(indices), 0
        job.earlier += job.consumed  # the client reported its last pass's final count just before
        job.drawn = job.delivered = job.consumed = 0

    def _forget_pass(self, job: Job) -> None:
        """Drop the job's references and pending tickets (its pass ended or was abandoned)."""
        group = job.group
        group.asking.pop(job.id, None)
        for index in list(group.waiters):
            remaining = [w for w in group.waiters[index] if w[0] is not job]
            if remaining:
                group.waiters[index] = remaining
            else:
                del group.waiters[index]  # the load goes on; its sample lands in the LRU tier
        if self.pool.release_holder(job.id):
            self.decoders.retry_reservations()

    def _on_want(self, conn: Connection, run: int, count: int) -> None:
        job = conn.job
        assert job is not None
        count = int(count)
        if run == job.run and job.open and count > 0:
            job.wanted += count
            if job.id not in job.group.asking:  # drawn when this round of events is over (`_draw`)
                job.asking_since = time.monotonic()
                job.group.asking[job.id] = job

    def _on_release(self, conn: Connection, run: int, indices: Any) -> None:
        job = conn.job
        assert job is not None
        if run != job.run or not job.open:
            return  # that pass's references went when it ended
        fp = job.group.fingerprint
        for index in indices:
            self.pool.release((fp, int(index)), job.id)
        self.decoders.retry_reservations()

    def _on_end(self, conn: Connection, run: int) -> None:
        job = conn.job
        assert job is not None
        if run == job.run:
            self._forget_pass(job)
            job.open = False  # what is still on its way to the job belongs to no live pass

    def _on_heartbeat(self, conn: Connection, progress: Any) -> None:
        job = conn.job
        if job is not None and isinstance(progress, tuple) and len(progress) in (2, 4) and progress[0] == job.run:
            job.consumed = int(progress[1])
            if len(progress) == 4:
                job.loop = (float(progress[2]), float(progress[3]))
        self._send(conn, "heartbeat", None)

    def _on_bye(self, conn: Connection) -> None:
        self._close(conn, None)

    def _on_status(self, conn: Connection) -> None:
        self._send(conn, "report", self.status())
        self._end(conn, None)

    def _on_stop(self, conn: Connection) -> None:
        self._send(conn, "stopping")
        self._running = False

    # -- scheduling --------------------------------------------------------------------------
    def _pump(self, job: Job) -> None:
        """Draw as many indices as the job asked for and deliver or load each. (A client never
        asks for more than its set: it knows when its epoch ends.)

        Draws are made only while the decoders have room for another load
        (`DecoderPool.room`); the rest of the request waits among its group's `asking` jobs.
        (See `_draw`.)"""
        group, sampler = job.group, job.group.sampler
        group.asking.pop(job.id, None)
        drawn = job.drawn
        while job.wanted > 0:
            if not self.decoders.room():
                if job.drawn > drawn:
                    job.asking_since = time.monotonic()  # it had its turn: to the back of the queue
                group.asking[job.id] = job
                break
            try:
                index = sampler.next(job.id)
            except StopIteration:
                job.wanted = 0
                break
            seq = job.drawn
            job.drawn += 1
            job.wanted -= 1
            self.requests += 1
            key = (group.fingerprint, index)
            entry = self.pool.get(key)
            if entry is not None and entry.ready:
                self._deliver(job, seq, index)
            else:
                group.waiters[index].append((job, job.run, seq))
                if entry is None:  # not even reserved: start a load unless one is on its way
                    self.decoders.load(group.fingerprint, index, group.timeout())

    def _draw(self) -> None:
        """After each round of events: the jobs with requests not yet drawn draw in turn (who
        waited longest first), while the decoders have room.

        So jobs draw from one short stream of loads: they start together and stay close, and hold
        no more of the pool than the decoders can use. Drawing all that a job asks for at once
        would queue loads far ahead and spread the jobs apart, until what one job loaded is
        evicted before another follows it. When a draw is made depends only on what was drawn
        before, never on what the next draw would be, so the sampler's guarantees are those of
        a job asking at that time."""
        asking = [job for group in self.groups.values() for job in group.asking.values()]
        for job in sorted(asking, key=lambda job: job.asking_since):
            if job.id in self.jobs:  # not dropped by a failure of the jobs before it
                with self._serving(job.conn, "want"):
                    self._pump(job)

    def _deliver(self, job: Job, seq: int, index: int) -> None:
        entry = self.pool.acquire((job.group.fingerprint, index), job.id)
        job.delivered += 1
        self._send(job.conn, "ticket", job.run, seq, index, entry.offset, entry.layout)

    # -- decoder events ----------------------------------------------------------------------
    def prefix_of(self, fp: str) -> bytes | None:
        group = self.groups.get(fp)
        return None if group is None else group.prefix

    def loaded(self, fp: str, index: int, layout: Any) -> None:
        self.pool.commit((fp, index), layout)
        self.decodes += 1
        group = self.groups.get(fp)
        if group is None:
            return
        group.sampler.loaded(index)
        for job, run, seq in group.waiters.pop(index, []):
            if job.id in self.jobs and run == job.run:
                self._deliver(job, seq, index)

    def failed(self, fp: str, index: int, error: str, message: str) -> None:
        group = self.groups.get(fp)
        if group is None:
            return
        group.sampler.evicted(index)  # never stored: nobody may follow it
        for job, run, seq in group.waiters.pop(index, []):
            if job.id in self.jobs and run == job.run:
                job.delivered += 1
                self._send(job.conn, "failed", run, seq, index, error, message)

    def _evicted(self, key: tuple[str, int]) -> None:
        group = self.groups.get(key[0])
        if group is not None:
            group.sampler.evicted(key[1])

    def _wanted(self, key: tuple[str, int]) -> bool:
        """Whether a job may still take this sample this epoch: the pool evicts others first."""
        group = self.groups.get(key[0])
        return group is not None and group.sampler.wanted(key[1])

    # -- liveness ----------------------------------------------------------------------------
    def _drop(self, job: Job, why: str | None) -> None:
        """Remove a job (left, crashed or failed): release its references; others go on."""
        if self.jobs.pop(job.id, None) is None:
            return
        job.conn.job = None
        group = job.group
        group.jobs.pop(job.id, None)
        self._forget_pass(job)
        if job.set_digest:  # it started a pass: the sampler knows it
            group.sampler.remove_job(job.id)
        if not group.jobs:
            del self.groups[group.fingerprint]  # its samples stay in the LRU tier until evicted
        self.pool.refile()  # what only this job wanted is wanted no more
        self.finished = [*self.finished, {**self._job_status(job), "state": "left"}][-20:]
        if not self.jobs:
            self._idle_since = time.monotonic()
        if why:
            self._log(f"job {job.name!r} (pid {job.conn.pid}) {why}; removed")

    def _check_connections(self) -> None:
        """Close hello-less connections past HELLO_S; drop silent jobs whose process is gone."""
        now = time.monotonic()
        for conn in list(self.connections.values()):
            job = conn.job
            if job is None:
                if not conn.closing and now - conn.opened > protocol.HELLO_S:
                    self._log(f"connection from pid {conn.pid} said nothing for {protocol.HELLO_S:.0f} s; closed")
                    self._close(conn, None)
            elif now - conn.last_seen > protocol.SILENT_DEAD_S and not alive(conn.pid):
                self._close(conn, f"is gone (silent {now - conn.last_seen:.0f} s, process ended)")
            else:
                job.rate = [*job.rate, (now, job.earlier + job.consumed, *job.loop)][-10:]

    # -- status and main loop ----------------------------------------------------------------
    def _job_status(self, job: Job) -> dict[str, Any]:
        s = job.group.sampler.stats().get(job.id, {})
        requests = s.get("requests", 0)
        return {
            "name": job.name,
            "pid": job.conn.pid,
            "size": job.size,
            "epoch": job.epoch,
            "consumed": job.consumed,
            "delivered": job.delivered,
            "samples_per_s": round(job.samples_per_s(), 1),
            "followed_share": round(s.get("followed", 0) / requests, 3) if requests else 0.0,
            "wait_share": round(job.wait_share(), 3),
            "loop_wait_s": round(job.loop[0], 3),
            "loop_busy_s": round(job.loop[1], 3),
            "state": "done" if job.size and job.consumed >= job.size else "loading",
        }

    def status(self) -> dict[str, Any]:
        requests, decodes = self.requests, self.decodes
        report: dict[str, Any] = {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "jobs": [self._job_status(job) for job in self.jobs.values()],
            "finished": self.finished,
            "pool": self.pool.stats(),
            "requests": requests,
            "decodes": decodes,
            "decodes_saved": requests - decodes,
            "workers": self.decoders.size,
            "worker_restarts": self.decoders.restarts,
            "decode_s": round(self.decoders.decode_s, 3),
        }
        cache = _object_cache_status()
        if cache is not None:
            report["cache"] = cache
        return report

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_running", False))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_running", False))
        last_check = time.monotonic()
        try:
            while self._running:
                for key, mask in self._selector.select(timeout=0.25):
                    try:
                        key.data(mask)
                    except Exception as exc:  # noqa: BLE001 - never let one event end the server
                        self._log(f"internal error: {type(exc).__name__}: {exc}")
                        traceback.print_exc(file=sys.stderr)
                now = time.monotonic()
                if now - last_check > 0.25:
                    last_check = now
                    if self._accept_paused_until and now > self._accept_paused_until:
                        self._accept_paused_until = 0.0
                        self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
                    self._check_connections()
                    self.decoders.check()
                    if self.idle_exit and not self.jobs and now - self._idle_since > self.idle_exit:
                        self._log(f"no jobs for {self.idle_exit:.0f} s; exiting")
                        self._running = False
                self._draw()
                self._post_all()
        finally:
            self.close()

    def _close_listener(self) -> None:
        self._unregister(self._listener)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # ours: we hold the socket's lock

    def close(self) -> None:
        self._close_listener()  # first: nobody new connects to a server going away
        for conn in list(self.connections.values()):
            self._post(conn)
            if conn.outbox:
                self._flush(conn)  # the "stopping" answer, if the socket takes it
            self._close(conn, None)
        self.decoders.close()
        self.arena.close()

    @staticmethod
    def _log(line: str) -> None:
        print(f"globalloader server: {line}", file=sys.stderr, flush=True)


def _object_cache_status() -> dict[str, Any] | None:
    """The machine's object cache (bytes downloaded, hits, size...) when its folder exists: one
    read of its counters' record, never a walk of the folder."""
    root = default_root(create=False)
    if not root.is_dir():
        return None
    try:
        return dict(ObjectCache(root).status())
    except GlobalLoaderError as exc:  # a locked record or a bad GLOBALLOADER_CACHE_LIMIT
        return {"dir": str(root), "error": str(exc)}


def main(argv: list[str] | None = None) -> int:
    """Run a server in this process (what `globalloader serve` and auto-start call)."""
    parser = argparse.ArgumentParser(prog="globalloader serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--memory", default="2G", help="buffer pool size in /dev/shm, e.g. 512M, 4G")
    parser.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 2), help="decode workers")
    parser.add_argument(
        "--socket",
        default=None,
        help="socket path (default: $GLOBALLOADER_SOCKET, else server.sock in the user's runtime folder)",
    )
    parser.add_argument(
        "--idle-exit", type=float, default=0.0, help="exit after this many seconds with no jobs (0: never)"
    )
    args = parser.parse_args(argv)
    path = Path(args.socket) if args.socket else protocol.default_socket()
    memory = launcher.parse_size(args.memory)
    if args.workers < 1:
        raise ServerStartError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.idle_exit < math.inf:
        raise ServerStartError(f"--idle-exit must be a number of seconds >= 0 (0: never), got {args.idle_exit}")
    lock = launcher.own_socket(path)
    if lock is None:
        print(f"globalloader server: another server owns {path}; exiting", file=sys.stderr, flush=True)
        return launcher.LOST_RACE
    launcher.clear_leftovers(path)
    server = Server(path, memory, args.workers, args.idle_exit)
    print(
        f"globalloader server: pid {os.getpid()}, socket {path}, pool {args.memory}, {args.workers} workers",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GlobalLoaderError as exc:  # started detached by a Loader: one line in the log
        cause = f" (cause: {exc.__cause__})" if exc.__cause__ else ""
        sys.exit(f"globalloader server: {exc}{cause}")
