"""`globalloader status --web`: a live page of the server's jobs, arena and savings, and `/metrics`.

A thread asks the server for its status every second and keeps the last minutes as points (rates
from its running totals); the page polls those points as JSON and draws them on canvases, so
there is no chart library to ship and nothing is fetched from the internet. The history lives
here, not in the server: the server stays as it was, and the dashboard goes on across a server
restart (the page says the server stopped answering, then that a new one started).

Access is as tight as the server's socket: the page listens on 127.0.0.1 only, answers only GET,
checks the Host header (no DNS rebinding), and needs the token printed at start, as Jupyter does.
The token comes as `?token=` once (then as an HttpOnly, SameSite=Strict cookie, and the address
loses it), or as `Authorization: Bearer` for a Prometheus scraper; it is compared in constant
time. Pages set a strict Content-Security-Policy and no Referer.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from globalloader._extras import require
from globalloader.errors import ArgumentError, GlobalLoaderError
from globalloader.service import launcher, metrics

DEFAULT_PORT = 8470
POLL_S = 1.0  # how often the dashboard asks the server for its status
WINDOW_S = 300.0  # how much history the page shows
_STATIC = {  # path -> (file in web/, content type)
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
_HEADERS = {  # on every answer
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}


class History:
    """The server's status over the last WINDOW_S seconds, polled every POLL_S seconds.

    Each point has the jobs' own figures (samples/s, waiting share, followed share) and the
    server's rates between two polls (sample store hits and evictions, decodes saved, decode workers'
    busy share, the object-storage cache's downloads and hits when the status has them). A
    server that stops answering, or a new server in its place, is an event, never a crash.
    """

    def __init__(self, fetch: Callable[[], dict[str, Any]]) -> None:
        self._fetch, self.interval = fetch, POLL_S
        self._points: deque[dict[str, Any]] = deque(maxlen=int(WINDOW_S / POLL_S) + 1)
        self._events: deque[tuple[float, str]] = deque(maxlen=50)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._previous: tuple[float, dict[str, Any]] | None = None  # (monotonic time, status)
        self._latest: dict[str, Any] | None = None
        self._down_since: float | None = None
        self._error = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="globalloader-dashboard-poll")

    def start(self) -> None:
        self.poll()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 10)  # a poll waits at most its 5 s request deadline

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        """Ask the server once; record a point, or that it does not answer."""
        try:
            status = self._fetch()
        except GlobalLoaderError as exc:
            with self._lock:
                if self._down_since is None:
                    self._down_since = time.time()
                    self._event(f"the server does not answer ({exc}); waiting for it to come back")
                self._error = str(exc)
                self._previous = None
            return
        now = time.monotonic()
        with self._lock:
            try:
                self._note_changes(status)
                point = self._point(now, status)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # another version's status
                self._error = f"cannot read the server's status ({type(exc).__name__}: {exc})"
                if self._down_since is None:
                    self._down_since = time.time()
                    self._event(self._error)
                return
            self._points.append(point)
            self._previous, self._latest = (now, status), status
            self._down_since, self._error = None, ""

    def _note_changes(self, status: dict[str, Any]) -> None:
        latest = self._latest
        if latest is None or latest["pid"] != status["pid"]:
            verb = "started" if latest is not None else "answers"
            self._event(f"server pid {status['pid']} {verb} (up {status['uptime_s']:.0f} s)")
            before: set[tuple[int, str, int]] = set()
        else:
            before = {(j["id"], j["name"], j["pid"]) for j in latest["jobs"]}
            if self._down_since is not None:
                self._event(f"server pid {status['pid']} answers again")
        now = {(j["id"], j["name"], j["pid"]) for j in status["jobs"]}
        for _, name, pid in sorted(now - before):
            self._event(f"job {name!r} (pid {pid}) joined")
        for _, name, pid in sorted(before - now):
            self._event(f"job {name!r} (pid {pid}) left")

    def _event(self, text: str) -> None:
        self._events.append((time.time(), text))

    def _point(self, now: float, status: dict[str, Any]) -> dict[str, Any]:
        point: dict[str, Any] = {
            "t": round(time.time(), 3),
            "jobs": {
                _job_key(j, status["jobs"]): [j["samples_per_s"], j.get("wait_share", 0.0), j["followed_share"]]
                for j in status["jobs"]
            },
        }
        store = status["pool"]
        point["pool_used"] = round(store["used"] / store["capacity"], 4) if store["capacity"] else 0.0
        previous = self._previous
        if previous is None or previous[1]["pid"] != status["pid"]:
            return point  # no rates across a restart: the totals started again
        dt = now - previous[0]
        before = previous[1]
        if dt <= 0:
            return point

        def rate(after: Any, earlier: Any) -> float | None:
            if not isinstance(after, (int, float)) or not isinstance(earlier, (int, float)) or after < earlier:
                return None
            return round((after - earlier) / dt, 3)

        point["hits"] = rate(store.get("hits", 0), before["pool"].get("hits", 0))
        point["evictions"] = rate(store.get("evictions", 0), before["pool"].get("evictions", 0))
        point["saved"] = rate(status["decodes_saved"], before["decodes_saved"])
        busy = rate(status.get("decode_s", 0.0), before.get("decode_s", 0.0))
        point["decoders_busy"] = None if busy is None else round(min(1.0, busy / max(1, status["workers"])), 4)
        cache, cache_before = status.get("cache"), before.get("cache")
        if isinstance(cache, dict) and isinstance(cache_before, dict):
            point["cache_downloaded"] = rate(cache.get("downloaded_bytes"), cache_before.get("downloaded_bytes"))
            point["cache_hits"] = rate(cache.get("hits"), cache_before.get("hits"))
        return point

    def snapshot(self) -> dict[str, Any]:
        """What the page draws: the latest status, the points, the events, whether the server answers."""
        with self._lock:
            return {
                "now": time.time(),
                "answering": self._down_since is None and self._latest is not None,
                "down_since": self._down_since,
                "error": self._error,
                "interval": self.interval,
                "status": self._latest,
                "points": list(self._points),
                "events": [{"t": t, "text": text} for t, text in self._events],
            }


def _job_key(job: dict[str, Any], jobs: list[dict[str, Any]]) -> str:
    """A job's name in the charts; with its pid and the server's number for it when another job
    has the same name (two Loaders of one process have the same pid too)."""
    same = sum(1 for other in jobs if other["name"] == job["name"])
    return job["name"] if same == 1 else f"{job['name']} (pid {job['pid']}, job {job['id']})"


class _Handler(BaseHTTPRequestHandler):
    server: Dashboard
    server_version = "globalloader-dashboard"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape per second would flood the terminal

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if not self.server.host_allowed(self.headers.get("Host", "")):
            self._send(HTTPStatus.FORBIDDEN, b"globalloader dashboard: unknown Host\n", "text/plain")
            return
        given = parse_qs(url.query).get("token", [None])[0]
        if not self.server.authorized(given, self.headers.get("Authorization", ""), self.headers.get("Cookie", "")):
            self._send(
                HTTPStatus.FORBIDDEN,
                b"globalloader dashboard: this page needs its token: open the address printed by "
                b"`globalloader status --web`\n",
                "text/plain; charset=utf-8",
            )
            return
        if given is not None and url.path == "/":  # keep the token in a cookie, not in the address bar
            self._send(HTTPStatus.SEE_OTHER, headers={"Location": "/", "Set-Cookie": self.server.cookie()})
            return
        if url.path == "/api/status":
            self._send(HTTPStatus.OK, json.dumps(self.server.history.snapshot()).encode(), "application/json")
        elif url.path == "/metrics":
            body, content_type = metrics.exposition(self.server.fetch)
            self._send(HTTPStatus.OK, body, content_type)
        elif url.path in _STATIC:
            name, content_type = _STATIC[url.path]
            self._send(HTTPStatus.OK, resources.files(__package__).joinpath("web", name).read_bytes(), content_type)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def _refuse_write(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, headers={"Allow": "GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_write  # the dashboard is read-only

    def _send(
        self, code: HTTPStatus, body: bytes = b"", content_type: str = "", headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        if content_type:
            self.send_header("Content-Type", content_type)
        for name, value in {**(headers or {}), "Content-Length": str(len(body)), **_HEADERS}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


class Dashboard(ThreadingHTTPServer):
    """The page's HTTP server on 127.0.0.1, with its status history and token."""

    daemon_threads = True

    def __init__(self, socket_path: Path, port: int = DEFAULT_PORT) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ArgumentError(f"--port must be 0 (any free port) to 65535, got {port!r}")
        require("prometheus_client", "service")  # /metrics needs it: say so now, not at the first scrape
        self.socket_path = socket_path
        # A fixed token (for a Prometheus scrape config) from the environment; else a new one per start.
        self.token = os.environ.get("GLOBALLOADER_DASHBOARD_TOKEN") or secrets.token_urlsafe(32)
        if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", self.token):
            raise ArgumentError(
                "$GLOBALLOADER_DASHBOARD_TOKEN must be at least 16 letters, digits, '-' or '_' "
                f"(it guards the dashboard), got {len(self.token)} characters"
            )
        try:
            super().__init__(("127.0.0.1", port), _Handler)
        except OSError as exc:
            raise ArgumentError(f"--port {port}: cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}") from exc
        self.port = self.server_address[1]
        self.history = History(self.fetch)

    def fetch(self) -> dict[str, Any]:
        return launcher.status(self.socket_path, timeout=5.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/?token={self.token}"

    def cookie(self) -> str:
        return f"globalloader-dashboard-{self.port}={self.token}; HttpOnly; SameSite=Strict; Path=/"

    def host_allowed(self, host: str) -> bool:
        return host in (f"127.0.0.1:{self.port}", f"localhost:{self.port}")

    def authorized(self, query_token: str | None, authorization: str, cookie_header: str) -> bool:
        """Whether one of the ways a token may come holds this dashboard's token."""
        candidates = [query_token or ""]
        if authorization.startswith("Bearer "):
            candidates.append(authorization[len("Bearer ") :].strip())
        try:
            morsel = SimpleCookie(cookie_header).get(f"globalloader-dashboard-{self.port}")
        except Exception:  # noqa: BLE001 - a malformed Cookie header is no token, not an error
            morsel = None
        if morsel is not None:
            candidates.append(morsel.value)
        expected = self.token.encode()
        return any(hmac.compare_digest(c.encode(), expected) for c in candidates)


def serve(socket_path: Path, port: int = DEFAULT_PORT) -> None:
    """Run the dashboard until Ctrl-C; prints its address (with the token) first."""
    dashboard = Dashboard(socket_path, port)
    dashboard.history.start()
    print(f"globalloader dashboard for {socket_path}: {dashboard.url}", flush=True)
    print(f"  metrics: http://127.0.0.1:{dashboard.port}/metrics (Authorization: Bearer <token>)", flush=True)
    print("  Ctrl-C stops it", file=sys.stderr, flush=True)
    try:
        dashboard.serve_forever(poll_interval=0.5)
    finally:
        dashboard.history.stop()
        dashboard.server_close()
