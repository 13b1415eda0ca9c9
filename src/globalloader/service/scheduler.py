"""The server's scheduler: jobs, their groups, and which sample each job gets next.

Jobs register their chain's shared prefix (source + `map(..., shared=True)` maps, cloudpickled)
and, for each pass over their data, their index set. Jobs whose prefix fingerprints match form a
group with one joint sampler: each request is answered with the sampler's next index for that
job; the sample is read and decoded once by the decode workers into the sample store (in the arena), and every
job that takes it gets a ticket (offset and layout in the shared arena) and a reference it
releases after use.

It runs in the server's main thread only (so the sampler and the sample store need no locks), answers
through the connection I/O (`Connections.send`), and is the decoders' `Events`. A job is removed
when its connection ends; what it held is released and the other jobs go on.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from globalloader.errors import ProtocolError
from globalloader.sampling.joint import JointSampler
from globalloader.service.connections import Connection, Connections, log
from globalloader.service.decoder import Decoders, Events
from globalloader.service.sample_store import SampleStore
from globalloader.transport.arena import ArenaId


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
    asking_since: float = 0.0  # when its turn to draw began (see Scheduler.draw)
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
    """Jobs sharing one prefix: one sampler, one key space in the sample store."""

    fingerprint: str
    prefix: bytes
    sampler: JointSampler
    jobs: dict[int, Job] = field(default_factory=dict)
    waiters: dict[int, list[tuple[Job, int, int]]] = field(default_factory=lambda: defaultdict(list))
    asking: dict[int, Job] = field(default_factory=dict)  # jobs with requests not drawn yet

    def timeout(self) -> float:
        return min((job.timeout for job in self.jobs.values()), default=300.0)


class Scheduler:
    """The jobs and groups of a server, their requests and the loads that answer them."""

    def __init__(
        self, io: Connections, arena_id: ArenaId, capacity: int, start_decoders: Callable[[Events], Decoders]
    ) -> None:
        """`arena_id`: what clients map (transport.arena); `capacity`: its bytes; `start_decoders`
        makes the decode workers that report to this scheduler."""
        self.io, self.arena_id = io, arena_id
        self.store: SampleStore = SampleStore(capacity, on_evict=self._evicted, wanted=self._wanted)
        self.groups: dict[str, Group] = {}
        self.jobs: dict[int, Job] = {}
        self._next_job = 1
        self.requests = self.decodes = 0  # since the start, over every group
        self.idle_since = time.monotonic()
        self.finished: list[dict[str, Any]] = []  # recently ended jobs, for `status`
        self.decoders = start_decoders(self)

    def handle(self, conn: Connection, msg: tuple) -> None:
        """Run a job's message (`hello` first; the connection I/O checked the order, so every
        other message's `conn.job` is set)."""
        handler = getattr(self, f"_on_{msg[0]}", None)
        if handler is None:
            raise ProtocolError(f"{msg[0]!r} is not a request")
        handler(conn, *msg[1:])

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
        name = str(info.get("name") or f"job-{self._next_job}")
        job = Job(self._next_job, conn, name, group, timeout if timeout > 0 else 300.0, int(info.get("seed", 0)))
        self._next_job += 1
        conn.job = job
        self.jobs[job.id] = job
        group.jobs[job.id] = job
        self.finished = [f for f in self.finished if f["pid"] != conn.pid]
        self.io.send(conn, "welcome", job.id, tuple(self.arena_id), self.store.capacity)

    def _on_run(self, conn: Connection, run: int, epoch: int, indices: Any) -> None:
        """A new pass: whatever the job held or awaited from earlier passes is let go."""
        job: Job = conn.job
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
        self.store.refile()  # this job now wants its whole set again
        self.decoders.prefetch(job.group.fingerprint, indices)
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
        if self.store.release_holder(job.id):
            self.decoders.retry_reservations()

    def _on_want(self, conn: Connection, run: int, count: int) -> None:
        job: Job = conn.job
        count = int(count)
        if run == job.run and job.open and count > 0:
            job.wanted += count
            if job.id not in job.group.asking:  # drawn when this round of events is over (`draw`)
                job.asking_since = time.monotonic()
                job.group.asking[job.id] = job

    def _on_release(self, conn: Connection, run: int, indices: Any) -> None:
        job: Job = conn.job
        if run != job.run or not job.open:
            return  # that pass's references went when it ended
        fp = job.group.fingerprint
        for index in indices:
            self.store.release((fp, int(index)), job.id)
        self.decoders.retry_reservations()

    def _on_end(self, conn: Connection, run: int) -> None:
        job: Job = conn.job
        if run == job.run:
            self._forget_pass(job)
            job.open = False  # what is still on its way to the job belongs to no live pass

    def _on_heartbeat(self, conn: Connection, progress: Any) -> None:
        job: Job | None = conn.job
        if job is not None and isinstance(progress, tuple) and len(progress) in (2, 4) and progress[0] == job.run:
            job.consumed = int(progress[1])
            if len(progress) == 4:
                job.loop = (float(progress[2]), float(progress[3]))
        self.io.send(conn, "heartbeat", None)

    def _on_bye(self, conn: Connection) -> None:
        self.io.close(conn, None)

    # -- scheduling --------------------------------------------------------------------------
    def _pump(self, job: Job) -> None:
        """Draw as many indices as the job asked for (never more than its set: a client knows
        when its epoch ends) and deliver or load each, while the decoders have room
        (`Decoders.room`; see `draw`); the rest of the request waits among its group's `asking`."""
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
            entry = self.store.get(key)
            if entry is not None and entry.ready:
                self._deliver(job, seq, index)
            else:
                group.waiters[index].append((job, job.run, seq))
                if entry is None:  # not even reserved: start a load unless one is on its way
                    self.decoders.load(group.fingerprint, index, group.timeout())

    def draw(self) -> None:
        """After each round of events: the jobs with requests not yet drawn draw in turn (who
        waited longest first), while the decoders have room.

        So jobs draw from one short stream of loads: they start together and stay close, and hold
        no more of the arena than the decoders can use. Drawing all that a job asks for at once
        would queue loads far ahead and spread the jobs apart, until what one job loaded is
        evicted before another follows it. When a draw is made depends only on what was drawn
        before, never on what the next draw would be, so the sampler's guarantees are those of
        a job asking at that time."""
        asking = [job for group in self.groups.values() for job in group.asking.values()]
        for job in sorted(asking, key=lambda job: job.asking_since):
            if job.id in self.jobs:  # not dropped by a failure of the jobs before it
                with self.io.serving(job.conn, "want"):
                    self._pump(job)

    def settled(self, conn: Connection) -> bool:
        """Whether no ticket is on its way to this client now (every sample its job drew has
        been answered): what is queued for it need not wait for more."""
        job: Job | None = conn.job
        return job is None or not job.open or job.delivered >= job.drawn

    def _deliver(self, job: Job, seq: int, index: int) -> None:
        entry = self.store.acquire((job.group.fingerprint, index), job.id)
        job.delivered += 1
        self.io.send(job.conn, "ticket", job.run, seq, index, entry.offset, entry.layout)

    # -- decoder events ----------------------------------------------------------------------
    def prefix_of(self, fp: str) -> bytes | None:
        group = self.groups.get(fp)
        return None if group is None else group.prefix

    def loaded(self, fp: str, index: int, layout: Any) -> None:
        self.store.commit((fp, index), layout)
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
                self.io.send(job.conn, "failed", run, seq, index, error, message)

    def _evicted(self, key: tuple[str, int]) -> None:
        group = self.groups.get(key[0])
        if group is not None:
            group.sampler.evicted(key[1])

    def _wanted(self, key: tuple[str, int]) -> bool:
        """Whether a job may still take this sample this epoch: the sample store evicts others first."""
        group = self.groups.get(key[0])
        return group is not None and group.sampler.wanted(key[1])

    # -- liveness ----------------------------------------------------------------------------
    def drop(self, job: Job, why: str | None) -> None:
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
        self.store.refile()  # what only this job wanted is wanted no more
        self.finished = [*self.finished, {**self.job_status(job), "state": "left"}][-20:]
        if not self.jobs:
            self.idle_since = time.monotonic()
        if why:
            log(f"job {job.name!r} (pid {job.conn.pid}) {why}; removed")

    def sample_rates(self) -> None:
        """Note each job's progress now: its rate and wait share run over the last samples."""
        now = time.monotonic()
        for job in self.jobs.values():
            job.rate = [*job.rate, (now, job.earlier + job.consumed, *job.loop)][-10:]

    def job_status(self, job: Job) -> dict[str, Any]:
        """What `status` shows of one job."""
        s = job.group.sampler.stats().get(job.id, {})
        requests = s.get("requests", 0)
        return {
            "id": job.id,  # the server's number for it: two jobs may share a name and a pid (train, val)
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
