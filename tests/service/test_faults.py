"""Shared mode under attack: every way a job could get wrong data or hang, with real processes.

Each test reproduces a fault seen on the first landing (wrong data, a hang, a stray server, a
fault counted as a bad sample) and checks the job now gets a named error or an exact epoch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader import errors
from globalloader._pids import alive
from globalloader.service import protocol
from globalloader.service.launcher import connect, request, status
from helpers import Server, pool_segments

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]


def values(record):
    return {"x": np.full(256, record, np.int64), "index": record}


def huge_at_5(record):
    size = 1 << 20 if record == 5 else 16  # 8 MiB for sample 5: more than the pool
    return {"x": np.full(size, record, np.int64), "index": record}


def hangs_at_7(record):
    if record == 7:
        time.sleep(3600)
    return values(record)


_LOADED: list[int] = []  # in a decode worker: the samples it loaded


def hangs_at_its_second_load(path: str, record):
    """Hangs on the second sample a decode worker loads (the second of its first group), after
    adding that sample's index to the lines of `path`."""
    _LOADED.append(record)
    if len(_LOADED) == 2:
        with open(path, "a") as lines:
            lines.write(f"{record}\n")
        time.sleep(3600)
    return values(record)


def chain(fn, n: int = 40, batch: int | None = 4) -> gl.Dataset:
    ds = gl.Dataset(gl.from_sequence(list(range(n)))).shuffle(seed=0).map(fn, shared=True)
    return ds.batch(batch) if batch else ds


def indices(batches) -> list[int]:
    return [int(i) for b in batches for i in np.atleast_1d(b["index"])]


@pytest.fixture
def srv(tmp_path: Path):
    server = Server(tmp_path / "f.sock", memory="4M", workers=1)
    yield server
    server.stop()
    assert not server.socket.exists() and f"gl-pool-{server.proc.pid}" not in pool_segments()


def log_of(server: Server) -> str:
    return server.socket.with_suffix(".log").read_text()


# -- 2. memory a consumer holds is never reused ------------------------------------------------


def view_of_input(sample):
    return {"x": sample["x"][:8], "index": sample["index"]}  # a view into the server's arena


@pytest.mark.parametrize("mode", ["inline", "thread"])
@pytest.mark.parametrize("trial", range(3))
def test_samples_kept_by_the_consumer_are_never_overwritten(tmp_path, mode, trial):
    # 300 samples of 2 KiB through a 64 KiB pool: its space is reused ~10 times while every
    # yielded sample is still held; a view that outlived its reference would change under us.
    server = Server(tmp_path / "r.sock", memory="64K", workers=1)
    try:
        ds = chain(values, n=300, batch=None).map(view_of_input)
        workers = 0 if mode == "inline" else 2
        with gl.Loader(ds, workers=workers, mode="thread", share=True, server=str(server.socket)) as loader:
            held = list(loader)
        assert sorted(int(s["index"]) for s in held) == list(range(300))
        assert all((s["x"] == s["index"]).all() for s in held), "a held sample was overwritten"
        assert status(server.socket)["pool"]["evictions"] > 0
    finally:
        server.stop()


# -- 3. exactly one server per socket ----------------------------------------------------------


def _servers_for(path: Path) -> list[int]:
    """Server processes for `path` (not counting their forked decode workers)."""
    out = subprocess.run(
        ["pgrep", "-f", f"globalloader.service.server --socket {path}"], capture_output=True, text=True
    ).stdout
    pids = {int(p) for p in out.split()}
    return [pid for pid in pids if _parent(pid) not in pids]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return 0


RACE_TRIALS = int(os.environ.get("GL_RACE_TRIALS", "2"))


@pytest.mark.parametrize("trial", range(RACE_TRIALS))
def test_eight_jobs_started_together_share_one_server_and_leave_nothing(tmp_path, trial):
    sock = tmp_path / "race.sock"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    job = Path(__file__).with_name("job.py")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(job),
                str(sock),
                str(tmp_path / f"{k}.jsonl"),
                "--start",
                "20",
                "--stop",
                "80",
                "--batch",
                "6",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in range(8)
    ]
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, out
        for k in range(8):
            rows = (tmp_path / f"{k}.jsonl").read_text().splitlines()
            assert "error" not in rows[-1], rows[-1]
        assert len(_servers_for(sock)) == 1, "more than one server runs for one socket"
        report = status(sock)
        finished = {job["pid"] for job in report["finished"]}
        assert finished == {p.pid for p in procs}, "some jobs did not use the one server"
        assert report["decodes"] < report["requests"], "the jobs did not share"
        pid = report["pid"]
    finally:
        subprocess.run(
            [sys.executable, "-m", "globalloader", "stop", "--socket", str(sock)],
            env=env,
            capture_output=True,
            timeout=30,
        )
    deadline = time.monotonic() + 10
    while _servers_for(sock):
        assert time.monotonic() < deadline, "a server outlived `globalloader stop`"
        time.sleep(0.1)
    assert f"gl-pool-{pid}" not in pool_segments() and not sock.exists(), "the server left files behind"
    assert not [n for n in pool_segments() if not alive(int(n.rsplit("-", 1)[1]))], "a stray server's pool was left"


def test_a_second_server_on_a_live_socket_exits_and_touches_nothing(srv, tmp_path):
    before = pool_segments()
    out = subprocess.run(
        [sys.executable, "-m", "globalloader", "serve", "--socket", str(srv.socket), "--memory", "1M"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0 and "another server owns" in out.stderr
    assert srv.socket.exists() and status(srv.socket)["pid"] == srv.proc.pid
    assert pool_segments() == before and f"gl-pool-{srv.proc.pid}" in before


@pytest.mark.parametrize(
    ("memory", "says"), [("0", "below the 16K minimum"), ("lots", "cannot read"), ("100T", "/dev/shm")]
)
def test_a_bad_memory_size_is_one_line_and_leaves_nothing(tmp_path, memory, says):
    sock = tmp_path / "m.sock"
    before = pool_segments()
    out = subprocess.run(
        [sys.executable, "-m", "globalloader", "serve", "--socket", str(sock), "--memory", memory],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and says in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert pool_segments() == before and not sock.exists()


def test_a_server_that_cannot_bind_makes_no_pool(tmp_path):
    sock = tmp_path / ("x" * 120 + ".sock")  # longer than a Unix socket path may be
    before = pool_segments()
    out = subprocess.run(
        [sys.executable, "-m", "globalloader", "serve", "--socket", str(sock), "--memory", "1M"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "cannot bind" in out.stderr and pool_segments() == before


def test_an_auto_started_server_exits_when_idle(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("GLOBALLOADER_IDLE_EXIT", "1")
    sock = tmp_path / "idle.sock"
    with gl.Loader(chain(values), share=True, server=str(sock), server_memory="1M") as loader:
        assert sorted(indices(loader)) == list(range(40))
        pid = status(sock)["pid"]
    deadline = time.monotonic() + 10
    while not (not sock.exists() and f"gl-pool-{pid}" not in pool_segments()):
        assert time.monotonic() < deadline, "the idle server did not exit and clean up"
        time.sleep(0.1)


# -- 4. every failure reaches the job as a named error, never a hang ----------------------------


def test_a_sample_larger_than_the_pool_fails_every_job_that_needs_it(srv):
    for _ in range(2):  # the second job used to hang forever
        with (
            gl.Loader(chain(huge_at_5), share=True, server=str(srv.socket), timeout=30) as loader,
            pytest.raises(errors.SampleTooLargeError, match=r"sample 5.*--memory"),
        ):
            list(loader)
    with gl.Loader(chain(values), share=True, server=str(srv.socket)) as loader:  # the server is fine
        assert sorted(indices(loader)) == list(range(40))


def test_a_shared_map_that_hangs_times_out_and_the_server_goes_on(srv):
    started = time.monotonic()
    with (
        gl.Loader(chain(hangs_at_7), share=True, server=str(srv.socket), timeout=3) as loader,
        pytest.raises(errors.LoaderTimeoutError, match="sample 7"),
    ):
        list(loader)
    assert time.monotonic() - started < 20
    with gl.Loader(chain(values), share=True, server=str(srv.socket)) as loader:
        assert sorted(indices(loader)) == list(range(40))
    assert status(srv.socket)["worker_restarts"] >= 1


def lock_at_3(record):
    return {**values(record), "lock": threading.Lock() if record == 3 else 0}


def test_a_shared_map_returning_what_cannot_be_pickled_is_named_and_the_server_goes_on(srv):
    with (
        gl.Loader(chain(lock_at_3), share=True, server=str(srv.socket), timeout=30) as loader,
        pytest.raises(
            errors.TransformError,
            match=r"map 'lock_at_3' returned, for sample index 3, a value the server's decode worker cannot send: "
            r"TypeError: cannot pickle '_thread.lock'",
        ),
    ):
        list(loader)
    with (
        gl.Loader(chain(lock_at_3), share=True, server=str(srv.socket), on_error="skip") as loader,
        pytest.warns(UserWarning, match="skipped 1 bad sample"),
    ):
        assert sorted(indices(loader)) == [i for i in range(40) if i != 3]
    with gl.Loader(chain(values), share=True, server=str(srv.socket)) as loader:
        assert sorted(indices(loader)) == list(range(40))
    assert status(srv.socket)["worker_restarts"] == 0, "no decode worker died"


def test_a_hang_is_blamed_on_its_own_sample_not_on_the_one_before_it_in_its_group(srv, tmp_path):
    """A worker gets its loads two per message and answers them together, but a finished load's
    outcome waits at most HOLD_S for the rest of its group: the server hears of the sample loaded
    just before the hanging one, so the timeout names the hanging sample, not that one."""
    hung = tmp_path / "hung"
    fn = functools.partial(hangs_at_its_second_load, str(hung))
    with (
        gl.Loader(chain(fn, n=8, batch=None), share=True, server=str(srv.socket), timeout=3) as loader,
        pytest.raises(errors.LoaderTimeoutError) as caught,
    ):
        list(loader)
    first = hung.read_text().split()[0]  # a replacement worker hangs at its second load too
    assert f"sample {first}:" in str(caught.value)


def test_a_request_the_server_rejects_is_raised_in_the_job(srv):
    with pytest.raises(errors.ArgumentError, match="seed"):
        gl.Dataset(gl.from_sequence([1, 2])).shuffle(seed=-1)
    sock, _ = connect(srv.socket)
    with sock:
        sock.settimeout(10)
        protocol.send(sock, "hello", {"prefix_fp": "p", "prefix": b"", "seed": -1})
        assert protocol.recv(sock)[0] == "welcome"
        protocol.send(sock, "run", 0, 0, np.arange(5))
        reply = protocol.recv(sock)
    assert reply[0] == "error" and reply[1] == "ArgumentError" and "seed" in reply[2]


def test_status_and_stop_against_a_blocked_server_time_out(srv):
    srv.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(errors.ServerTimeoutError):
            request(srv.socket, "status", timeout=2)
        out = srv.status_table()
        assert out.returncode == 1 and "did not answer" in out.stderr
        assert time.monotonic() - started < 2 * protocol.REQUEST_S + 10
    finally:
        srv.proc.send_signal(signal.SIGCONT)


# -- 5. infrastructure faults are not sample faults ---------------------------------------------


def test_a_killed_decode_worker_is_replaced_and_nothing_is_skipped(srv, tmp_path):
    flag = tmp_path / "flag"  # the first decode of sample 9 kills its worker; the retry succeeds

    def dies_once(record, flag=str(flag)):
        if record == 9 and not os.path.exists(flag):
            Path(flag).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        return values(record)

    with gl.Loader(chain(dies_once), share=True, server=str(srv.socket), on_error="skip") as loader:
        seen = indices(loader)
        assert loader.stats()["skipped"] == 0
    assert flag.exists(), "the worker was never killed: the test did not test anything"
    assert sorted(seen) == list(range(40))
    assert status(srv.socket)["worker_restarts"] == 1


def test_a_sample_that_kills_every_worker_is_a_worker_error_not_a_skip(srv):
    def always_dies(record):
        if record == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return values(record)

    with (
        gl.Loader(chain(always_dies), share=True, server=str(srv.socket), on_error="skip") as loader,
        pytest.raises(errors.WorkerError, match=r"sample 3.*3 times"),
    ):
        list(loader)


def test_a_prefix_the_server_cannot_import_is_not_a_skipped_sample(srv, tmp_path):
    # A module that looks installed is pickled by reference; the server cannot import it.
    folder = tmp_path / "site-packages"
    folder.mkdir()
    (folder / "only_here_mod.py").write_text(
        "import numpy as np\ndef fn(r):\n    return {'x': np.zeros(2), 'index': r}\n"
    )
    sys.path.insert(0, str(folder))
    try:
        import only_here_mod

        ds = gl.Dataset(gl.from_sequence(list(range(10)))).map(only_here_mod.fn, shared=True).batch(2)
        with (
            gl.Loader(ds, share=True, server=str(srv.socket), on_error="skip") as loader,
            pytest.raises(errors.SharedPrefixError, match="cannot load this job's shared prefix"),
        ):
            list(loader)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("only_here_mod", None)


# -- 6. a Loader worker killed in shared mode -----------------------------------------------------


def slow_values(sample, rng):
    time.sleep(0.01)
    return {"x": sample["x"] + 0, "index": sample["index"]}


@pytest.mark.parametrize("trial", range(3))
def test_a_killed_loader_worker_is_a_named_error_then_an_exact_epoch(srv, trial):
    ds = gl.Dataset(gl.from_sequence(list(range(200)))).shuffle(seed=trial).map(values, shared=True)
    ds = ds.map(slow_values).batch(5)
    with gl.Loader(ds, workers=2, share=True, server=str(srv.socket)) as loader:
        it = iter(loader)
        seen = indices(next(it) for _ in range(6))
        os.kill(loader.worker_set._pool.procs[trial % 2].pid, signal.SIGKILL)

        def take_the_rest() -> None:  # the batches before the error count too
            for batch in it:
                seen.extend(indices([batch]))

        with pytest.raises(errors.WorkerError, match="killed by SIGKILL"):
            take_the_rest()
        seen += indices(loader)  # iterating again goes on from where it stopped
        assert Counter(seen) == Counter(range(200)), "samples were lost or repeated"
    deadline = time.monotonic() + 5
    while status(srv.socket)["pool"]["referenced"]:
        assert time.monotonic() < deadline, "the dead worker's references were never released"
        time.sleep(0.1)


# -- 7. a server that survives its clients -------------------------------------------------------


def _raw(srv: Server) -> socket.socket:
    sock, _ = connect(srv.socket)
    sock.settimeout(10)
    return sock


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (struct.pack("!I", 5) + b"hello", "not a valid pickle"),
        (protocol.HEADER.pack(len(p := pickle.dumps(("launch", 1)))) + p, "unknown message"),
        (protocol.HEADER.pack(len(p := pickle.dumps(("hello",)))) + p, "needs fields"),
        (protocol.HEADER.pack(len(p := pickle.dumps(("want", 0, 5)))) + p, "before 'hello'"),
        (struct.pack("!I", 0xFFFFFFFF) + b"x" * 100, "over the"),
    ],
)
def test_a_malformed_frame_ends_only_its_connection(srv, payload, says):
    with _raw(srv) as bad, gl.Loader(chain(values), share=True, server=str(srv.socket)) as loader:
        it = iter(loader)
        first = indices([next(it)])
        bad.sendall(payload)
        reply = protocol.recv(bad)
        assert reply[0] == "error" and reply[1] == "ProtocolError" and says in reply[2]
        assert bad.recv(1) == b"", "the bad connection was not closed"
        assert sorted(first + indices(it)) == list(range(40))  # the job next to it is unharmed
    assert says in log_of(srv)


@pytest.mark.slow
def test_a_silent_connection_is_closed_after_the_hello_deadline(srv):
    with _raw(srv) as silent:
        silent.settimeout(protocol.HELLO_S + 10)
        started = time.monotonic()
        assert silent.recv(1) == b""
        assert protocol.HELLO_S - 1 < time.monotonic() - started < protocol.HELLO_S + 5
    assert "said nothing" in log_of(srv)


def test_a_client_that_never_reads_is_dropped_and_the_others_go_on(srv):
    beat = protocol.frame("heartbeat", None)
    with _raw(srv) as deaf:
        protocol.send(deaf, "hello", {"prefix_fp": "deaf", "prefix": b"", "name": "deaf"})
        flood = beat * (protocol.SEND_LIMIT // 20)  # every heartbeat is answered; none is read
        sender = threading.Thread(target=lambda: _send_quietly(deaf, flood), daemon=True)
        sender.start()
        with gl.Loader(chain(values), share=True, server=str(srv.socket)) as loader:
            assert sorted(indices(loader)) == list(range(40))
        deadline = time.monotonic() + 60
        while "stopped reading" not in log_of(srv):
            assert time.monotonic() < deadline, "the deaf client was never dropped"
            time.sleep(0.2)
    sender.join(timeout=10)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the server closed us, as it should
        sock.sendall(data)


def test_running_out_of_file_descriptors_does_not_end_the_server(tmp_path):
    import resource

    def few_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    sock = tmp_path / "fd.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "globalloader", "serve", "--socket", str(sock), "--memory", "1M", "--workers", "1"],
        preexec_fn=few_fds,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)
        held = []
        for _ in range(100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            held.append(s)
        time.sleep(1.5)
        assert proc.poll() is None, "the server died of EMFILE"
        for s in held:
            s.close()
        time.sleep(1.5)
        with gl.Loader(chain(values), share=True, server=str(sock)) as loader:
            assert sorted(indices(loader)) == list(range(40))
    finally:
        subprocess.run([sys.executable, "-m", "globalloader", "stop", "--socket", str(sock)], timeout=30)
        _, err = proc.communicate(timeout=30)
    assert "cannot accept" in err


@pytest.fixture
def open_folder():
    """A folder every user may enter and write (a shared /tmp-like place), removed afterwards."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="gl-peer-"))
    os.chmod(folder, 0o777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    prelude = "import os, pickle, socket, struct, sys\nos.setgid(65534); os.setuid(65534)\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
def test_a_rogue_server_of_another_user_is_refused_before_its_reply_is_unpickled(open_folder, tmp_path):
    rogue, marker = open_folder / "rogue.sock", tmp_path / "pwned"
    code = (
        f"s = socket.socket(socket.AF_UNIX); s.bind({str(rogue)!r}); os.chmod({str(rogue)!r}, 0o777); s.listen(1)\n"
        "c, _ = s.accept()\n"
        f"p = pickle.dumps((os.system, ('touch {marker}',)))\n"
        "c.sendall(struct.pack('!I', len(p)) + p); c.recv(10)\n"
    )
    prelude = "import os, pickle, socket, struct, sys\nos.setgid(65534); os.setuid(65534)\n"
    rogue_proc = subprocess.Popen([sys.executable, "-c", prelude + code])
    try:
        deadline = time.monotonic() + 10
        while not rogue.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with (
            pytest.raises(errors.ProtocolError, match="runs as uid 65534"),
            gl.Loader(chain(values), share=True, server=str(rogue)) as loader,
        ):
            iter(loader)
        assert not marker.exists(), "the client unpickled a stranger's message"
    finally:
        rogue_proc.kill()
        rogue_proc.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another user")
def test_a_client_of_another_user_is_refused(open_folder):
    server = Server(open_folder / "s.sock", memory="1M", workers=1)
    try:
        os.chmod(server.socket, 0o777)  # a misconfigured socket: the uid check still holds
        out = _as_nobody(f"s = socket.socket(socket.AF_UNIX); s.connect({str(server.socket)!r}); print(s.recv(10))\n")
        assert out.stdout.strip() == "b''", out.stderr
        assert "runs as uid 65534" in log_of(server)
    finally:
        server.stop()


# -- 8. liveness that does not drop a live job ---------------------------------------------------


def test_a_job_stopped_or_holding_the_gil_keeps_its_place(srv, tmp_path):
    out = tmp_path / "paused.jsonl"
    proc = srv.job(out, "--start", "20", "--hold-gil-at", "3", "--pause-at", "6")
    deadline = time.monotonic() + 60
    while not (out.exists() and "paused" in out.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not reach its pause"
        time.sleep(0.1)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(protocol.SILENT_DEAD_S + 3)
    proc.send_signal(signal.SIGCONT)
    (tmp_path / "paused.jsonl.go").write_text("go")
    output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    rows = [r for r in out.read_text().splitlines() if '"indices"' in r]
    seen = Counter(i for r in rows for i in json.loads(r)["indices"])
    assert seen == Counter(range(20, 300)) and "error" not in out.read_text()
    assert "removed" not in log_of(srv), "a live job was dropped"
