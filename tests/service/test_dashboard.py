"""`globalloader status --web`: the token, loopback only, read-only, `/metrics` against the server's
own status numbers, and a dashboard that goes on across a server restart. Real server, real jobs,
the dashboard as its own process, HTTP on loopback. (The page in a browser: test_dashboard_browser.)"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import globalloader as gl
from globalloader.service.dashboard import History
from globalloader.service.launcher import status
from globalloader.service.metrics import JOB_COUNTERS, JOB_GAUGES, SERVER_COUNTERS, SERVER_GAUGES, exposition
from helpers import CLI, Dashboard, Server

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]


def get(board: Any, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, Any, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", board.port, timeout=15)
    try:
        conn.request(method, path, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.headers, reply.read()
    finally:
        conn.close()


def api(board: Any) -> dict[str, Any]:
    code, _, body = get(board, "/api/status", {"Authorization": f"Bearer {board.token}"})
    assert code == 200, body
    return json.loads(body)


def wait_for(check, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_every_path_needs_the_token(dashboard):
    other = dashboard.token[:-1] + ("A" if dashboard.token[-1] != "A" else "B")  # same length, one character off
    for path in ("/", "/api/status", "/metrics", "/dashboard.js"):
        for headers, query in (({}, ""), ({}, f"?token={other}"), ({"Authorization": f"Bearer {other}"}, "")):
            code, _, body = get(dashboard, path + query, headers)
            assert code == 403 and b"token" in body, (path, query, headers, code)
    code, headers, _ = get(dashboard, f"/?token={dashboard.token}")
    assert code == 303 and headers["Location"] == "/"  # the token leaves the address bar
    cookie = headers["Set-Cookie"].split(";")[0]
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    code, headers, body = get(dashboard, "/", {"Cookie": cookie})
    assert code == 200 and b"<title>globalloader server</title>" in body
    assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["Referrer-Policy"] == "no-referrer"
    assert get(dashboard, "/dashboard.js", {"Cookie": cookie})[0] == 200
    assert get(dashboard, "/api/status", {"Cookie": cookie + "x"})[0] == 403


def test_a_fixed_token_from_the_environment(server, tmp_path: Path):
    fixed = "scrape-token-0123456789"
    board = Dashboard(server.socket, tmp_path / "d.log", env={**os.environ, "GLOBALLOADER_DASHBOARD_TOKEN": fixed})
    try:
        assert board.token == fixed
        assert get(board, "/metrics", {"Authorization": f"Bearer {fixed}"})[0] == 200
    finally:
        board.stop()
    short = subprocess.run(
        [*CLI, "status", "--web", "--port", "0", "--socket", str(server.socket)],
        env={**os.environ, "GLOBALLOADER_DASHBOARD_TOKEN": "short"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert short.returncode == 1 and "GLOBALLOADER_DASHBOARD_TOKEN must be at least 16" in short.stderr


def test_read_only_loopback_only_and_no_foreign_host(dashboard):
    bearer = {"Authorization": f"Bearer {dashboard.token}"}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        code, headers, _ = get(dashboard, "/api/status", bearer, method=method)
        assert code == 405 and headers["Allow"] == "GET", method
    assert get(dashboard, "/api/status", {**bearer, "Host": f"evil.example:{dashboard.port}"})[0] == 403
    listening = [  # the kernel's own table of TCP sockets: (local address, state) in hex
        line.split()[1].split(":")[0]
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for line in Path(table).read_text().splitlines()[1:]
        if line.split()[1].endswith(f":{dashboard.port:04X}") and line.split()[3] == "0A"
    ]
    assert listening == ["0100007F"], f"listening on {listening}, not on 127.0.0.1 only"


def metrics(board: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    code, headers, body = get(board, "/metrics", {"Authorization": f"Bearer {board.token}"})
    assert code == 200 and headers["Content-Type"].startswith("text/plain"), body
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def job_labels(job: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return (("job_id", str(job["id"])), ("job_name", job["name"]), ("pid", str(job["pid"])))


def expected(report: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics a status should give, read from the status by hand (names from docs/observe.md)."""
    pool = report["pool"]
    out = {
        ("globalloader_server_up", ()): 1.0,
        ("globalloader_server_uptime_seconds", ()): report["uptime_s"],
        ("globalloader_decode_workers", ()): report["workers"],
        ("globalloader_pool_capacity_bytes", ()): pool["capacity"],
        ("globalloader_pool_used_bytes", ()): pool["used"],
        ("globalloader_pool_samples", ()): pool["samples"],
        ("globalloader_pool_referenced_samples", ()): pool["referenced"],
        ("globalloader_pool_cached_samples", ()): pool["cached"],
        ("globalloader_jobs", ()): len(report["jobs"]),
        ("globalloader_requests_total", ()): report["requests"],
        ("globalloader_decodes_total", ()): report["decodes"],
        ("globalloader_decodes_saved_total", ()): report["decodes_saved"],
        ("globalloader_decode_seconds_total", ()): report["decode_s"],
        ("globalloader_decode_worker_restarts_total", ()): report["worker_restarts"],
        ("globalloader_decode_space_requests_total", ()): report["space_requests"],
        ("globalloader_pool_hits_total", ()): pool.get("hits", 0),
        ("globalloader_pool_evictions_total", ()): pool.get("evictions", 0),
    }
    for job in report["jobs"]:
        labels = job_labels(job)
        for name, _, key in JOB_GAUGES:
            out[(name, labels)] = job[key]
        for name, _, key in JOB_COUNTERS:
            out[(f"{name}_total", labels)] = job[key]
    return out


def test_metrics_are_the_status_numbers(server, dashboard, tmp_path: Path):
    assert len(SERVER_GAUGES) + len(SERVER_COUNTERS) + 1 == 17  # `expected` names every server-wide metric
    jobs = [
        server.job(tmp_path / f"{name}.out", "--start", "20", "--pause-at", "8", "--sleep", "0.05", "--name", name)
        for name in ("alpha", "beta")
    ]
    try:
        # While they run: each counter of a scrape lies between the status before and after it.
        wait_for(lambda: len(status(server.socket)["jobs"]) == 2 and status(server.socket)["requests"] > 0, "jobs")
        time.sleep(2.5)
        before, scraped, after = status(server.socket), metrics(dashboard), status(server.socket)
        for (name, labels), low in expected(before).items():
            if name.endswith("_total") and not labels:
                high = expected(after)[(name, labels)]
                assert low <= scraped[(name, labels)] <= high, (name, low, scraped[(name, labels)], high)
        by_name = {job["name"]: job for job in before["jobs"]}
        assert [by_name[n]["pid"] for n in ("alpha", "beta")] == [j.pid for j in jobs]
        rates = [scraped[("globalloader_job_samples_per_second", job_labels(by_name[n]))] for n in ("alpha", "beta")]
        assert all(rate > 0 for rate in rates), rates
        # Both paused: nothing moves, and every number of a scrape is the status's own.
        for name in ("alpha", "beta"):
            wait_for(lambda name=name: '"paused"' in (tmp_path / f"{name}.out").read_text(), f"{name} to pause")
        time.sleep(3.0)  # the rate windows empty; the last heartbeats arrive
        before, scraped, after = status(server.socket), metrics(dashboard), status(server.socket)
        steady = {k: v for k, v in expected(before).items() if k[0] != "globalloader_server_uptime_seconds"}
        assert steady == {k: v for k, v in expected(after).items() if k[0] != "globalloader_server_uptime_seconds"}
        for key, value in steady.items():
            assert scraped[key] == pytest.approx(value), key
        assert before["uptime_s"] <= scraped[("globalloader_server_uptime_seconds", ())] <= after["uptime_s"]
        assert {k for k in scraped if k[1]} == {k for k in steady if k[1]}, "no job metric without its status figure"
    finally:
        for job in jobs:
            job.kill()
            job.wait()


def test_two_loaders_of_one_process_with_one_name_are_two_series(server, dashboard):
    """Train and val in one script, both with the default name: same name, same pid. A scrape
    with a duplicate series is refused whole by Prometheus; each job has its own."""
    ds = gl.Dataset(gl.from_sequence(list(range(20)))).map(np.asarray, shared=True).batch(5)
    loaders = [gl.Loader(ds, share=True, server=str(server.socket)) for _ in range(2)]
    try:
        for loader in loaders:
            next(iter(loader))
        code, _, body = get(dashboard, "/metrics", {"Authorization": f"Bearer {dashboard.token}"})
        jobs = status(server.socket)["jobs"]
        polled = wait_for(lambda: (s := api(dashboard)) and len(s["status"]["jobs"]) == 2 and s, "a poll with both")
    finally:
        for loader in loaders:
            loader.close()
    assert code == 200 and len(jobs) == 2 and jobs[0]["name"] == jobs[1]["name"] and jobs[0]["pid"] == jobs[1]["pid"]
    series = [
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    ]
    assert len(series) == len(set(series)), sorted(s for s in series if series.count(s) > 1)
    for name, _, _ in JOB_GAUGES:
        assert {labels for n, labels in series if n == name} == {job_labels(job) for job in jobs}, name
    assert len(polled["points"][-1]["jobs"]) == 2, polled["points"][-1]  # two lines in the charts too (same poll)


def test_the_dashboard_goes_on_across_a_server_restart(server, dashboard):
    first = wait_for(lambda: api(dashboard)["answering"] and api(dashboard), "the first poll")
    old_pid = first["status"]["pid"]
    server.stop()
    down = wait_for(lambda: (s := api(dashboard)) and not s["answering"] and s, "the dashboard to see the server go")
    assert down["status"]["pid"] == old_pid, "the last known state stays on the page"
    assert "does not answer" in down["events"][-1]["text"]
    code, _, body = get(dashboard, "/metrics", {"Authorization": f"Bearer {dashboard.token}"})
    assert code == 200 and "globalloader_server_up 0.0" in body.decode()
    again = Server(server.socket)
    try:
        back = wait_for(lambda: (s := api(dashboard)) and s["answering"] and s, "the new server")
        assert back["status"]["pid"] == again.proc.pid != old_pid
        assert f"server pid {again.proc.pid} started" in back["events"][-1]["text"]
        assert dashboard.proc.poll() is None
    finally:
        again.stop()


@pytest.mark.slow
def test_waiting_and_busy_shares_tell_input_bound_from_compute_bound(server, dashboard, tmp_path: Path):
    def job_status(name: str) -> dict[str, Any] | None:
        return next((j for j in status(server.socket)["jobs"] if j["name"] == name), None)

    # Input-bound: every sample takes the server's decode workers 0.1 s; the loop does nothing.
    waiting = server.job(tmp_path / "w.out", "--start", "20", "--slow-decode", "--name", "waiting")
    try:
        job = wait_for(lambda: (j := job_status("waiting")) and j["consumed"] >= 40 and j, "the slow job", 60)
        time.sleep(3)  # a full rate window
        job = job_status("waiting")
        assert job["wait_share"] > 0.7 and job["samples_per_s"] > 0, job
        assert job["loop_wait_s"] > 3 * job["loop_busy_s"], job
        report = status(server.socket)
        assert report["decode_s"] >= 0.09 * report["decodes"], report  # each decode slept 0.1 s
        points = api(dashboard)["points"][-3:]
        assert all(p["decoders_busy"] > 0.6 for p in points), points  # both decode workers at it
    finally:
        waiting.kill()
        waiting.wait()
    # Compute-bound: decodes are instant; the loop spends 0.2 s on each batch.
    working = server.job(tmp_path / "c.out", "--start", "20", "--epochs", "3", "--sleep", "0.2", "--name", "working")
    try:
        wait_for(lambda: (j := job_status("working")) and j["consumed"] >= 60, "the busy job", 60)
        time.sleep(3)
        job = job_status("working")
        assert job["wait_share"] < 0.2 and job["samples_per_s"] > 0, job
        assert job["loop_busy_s"] > 3 * job["loop_wait_s"], job
    finally:
        working.kill()
        working.wait()


def test_a_cache_section_in_the_status_becomes_metrics_and_points(server):
    """The object-storage cache's figures, when a server's status has them (a real status plus a
    `cache` section as the cache reports it): counters, gauges, and rates between two polls."""
    real = status(server.socket)
    first = {**real, "cache": {"downloaded_bytes": 1000, "hits": 5, "misses": 2, "bytes": 4096, "dir": "/x"}}
    second = {**real, "cache": {**first["cache"], "downloaded_bytes": 3000, "hits": 9}}
    body, _ = exposition(lambda: second)
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples["globalloader_cache_downloaded_bytes_total"] == 3000
    assert samples["globalloader_cache_hits_total"] == 9 and samples["globalloader_cache_misses_total"] == 2
    assert samples["globalloader_cache_bytes"] == 4096 and not any("dir" in name for name in samples)
    history = History(iter([first, second]).__next__)
    history.poll()
    time.sleep(0.2)
    history.poll()
    point = history.snapshot()["points"][-1]
    assert point["cache_downloaded"] > 0 and point["cache_hits"] > 0, point
    plain = History(lambda: real)
    plain.poll()
    plain.poll()
    points = plain.snapshot()["points"]
    assert len(points) == 2 and "saved" in points[-1] and "cache_downloaded" not in points[-1], "no cache, no chart"


def test_a_status_it_cannot_read_is_said_not_fatal(server):
    real = status(server.socket)
    statuses = iter([real, {**real, "pool": None}, real])
    history = History(lambda: next(statuses))
    for _ in range(3):
        history.poll()
        time.sleep(0.05)
    snapshot = history.snapshot()
    assert snapshot["answering"] and len(snapshot["points"]) == 2
    assert any("cannot read the server's status" in e["text"] for e in snapshot["events"]), snapshot["events"]
