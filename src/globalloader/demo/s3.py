"""A local S3-compatible server (moto's server mode on loopback) and an HTTP proxy in front of
it that counts requests and bytes per key and can inject faults: latency, 503 SlowDown,
connection resets (before a response or in the middle of its body), forced 403/404 per key,
bodies corrupted in transit or trickled a byte at a time.

The demo's remote act, `benchmarks/remote.py` and the tests use it; it needs moto's server
(the `test` extra). Not part of the library: nothing outside the demo imports it.
"""

from __future__ import annotations

import collections
import hashlib
import http.client
import http.server
import json
import os
import random
import socket
import socketserver
import struct
import threading
import time
import uuid
from typing import Any

from globalloader import storage

_ERROR = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
    "<Resource>{path}</Resource><RequestId>gl-test</RequestId></Error>"
)
_CODES = {
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class MotoServer:
    """moto's ThreadedMotoServer on a free loopback port."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

        with socket.socket() as free:  # a free port for the server
            free.bind(("127.0.0.1", 0))
            self.port = int(free.getsockname()[1])
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop()


class FaultProxy(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """Forwards every request to `upstream`, injecting faults on GET/HEAD once `faults_on`.

    Rates are per request, drawn from a seeded generator: `slowdown` answers 503 SlowDown,
    `reset` drops the connection (half of them after part of the body). `forced` maps a key
    substring to a status (403, 404, 500 or 503) answered for every request on it. `latency` seconds are
    added to each request. `corrupt` maps a key substring to how many more GET bodies of it get
    one byte flipped (the headers unchanged: a transfer damaged in transit); `no_checksums` drops
    the store's `x-amz-checksum-*` headers (an object stored without an additional checksum);
    `trickle` maps a key substring to the seconds between the bytes of its GET bodies, each sent
    alone. `opaque_etags` holds key substrings whose ETags are shown as no MD5 (as S3 shows those
    of objects encrypted with KMS; moto's are the MD5 still): another hex in answers, mapped back
    in If-Match. `bytes_sent[key]` counts the body bytes of successful GETs (before they are
    sent, so a client that has them sees them counted); GET /__stats__ answers
    their total and the count of GETs as JSON, for other processes.
    """

    daemon_threads = True
    allow_reuse_address = True
    # Connections waiting to be accepted: a client with a hundred GETs in flight opens them at
    # once, and socketserver's default of 5 drops the others' SYNs (each then retried after 1, 3,
    # 7 s...: delays no object store adds).
    request_queue_size = 1024

    def __init__(self, upstream_port: int, *, seed: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_port = upstream_port
        self.latency = 0.0
        self.slowdown = 0.0
        self.reset = 0.0
        self.faults_on = False
        self.forced: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self.no_checksums = False
        self.trickle: dict[str, float] = {}
        self.opaque_etags: set[str] = set()
        self._true_etags: dict[str, str] = {}  # an opaque ETag shown -> the store's own
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()  # "GET /bucket/key" -> count
        self.conditional: collections.Counter[str] = collections.Counter()  # the same, those with If-Match
        self.faults: collections.Counter[str] = collections.Counter()  # kind -> count
        self.in_flight = self.most_in_flight = 0  # GETs being answered at once
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a request cut off at the end of a test (the server stopped) is no news

    def total_bytes(self, prefix: str = "", suffix: str = "") -> int:
        """Body bytes of successful GETs of keys starting with `prefix`, ending with `suffix`."""
        with self.lock:
            return sum(n for key, n in self.bytes_sent.items() if key.startswith(prefix) and key.endswith(suffix))

    def count(self, method: str, prefix: str = "", suffix: str = "") -> int:
        """Requests of `method` on keys starting with `prefix` and ending with `suffix`."""
        with self.lock:
            return sum(
                n for key, n in self.requests.items() if key.startswith(f"{method} {prefix}") and key.endswith(suffix)
            )

    def count_conditional(self, method: str, suffix: str = "") -> int:
        """Requests of `method` that carried If-Match, on keys ending with `suffix`."""
        with self.lock:
            return sum(n for key, n in self.conditional.items() if key.startswith(method) and key.endswith(suffix))

    def count_peak_afresh(self, timeout: float = 10.0) -> None:
        """Start `most_in_flight` again from the GETs answered from now on, once those being
        answered end: a client may read a whole answer (a listing's) before its handler here
        counts it done."""
        deadline = time.monotonic() + timeout
        while self.in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.in_flight} GETs still being answered by the proxy after {timeout} s")
            time.sleep(0.005)
        self.most_in_flight = 0

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body would wait for the
    # client's delayed ACK of the headers (up to 40 ms on a kept-alive connection), a delay no
    # object store adds and that `latency` does not count.
    disable_nagle_algorithm = True
    server: FaultProxy

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _proxy(self) -> None:
        proxy, method = self.server, self.command
        path = self.path.split("?", 1)[0]
        if path == "/__stats__":  # for other processes (benchmarks): bytes and GETs so far
            data = json.dumps({"bytes": proxy.total_bytes(), "gets": proxy.count("GET")}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with proxy.lock:
            proxy.requests[f"{method} {path}"] += 1
            if "If-Match" in self.headers:
                proxy.conditional[f"{method} {path}"] += 1
            draw = proxy.rng.random()
            cut = proxy.rng.random()
            if method == "GET":
                proxy.in_flight += 1
                proxy.most_in_flight = max(proxy.most_in_flight, proxy.in_flight)
        try:
            self._answer(method, path, body, draw, cut)
        finally:
            if method == "GET":
                with proxy.lock:
                    proxy.in_flight -= 1

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _proxy

    def _answer(self, method: str, path: str, body: bytes, draw: float, cut: float) -> None:
        proxy = self.server
        if proxy.latency:
            time.sleep(proxy.latency)
        forced = next((status for part, status in proxy.forced.items() if part in path), None)
        if forced is not None:
            self._error(forced, path, method)
            return
        faulty = proxy.faults_on and method in ("GET", "HEAD")
        if faulty and draw < proxy.slowdown:
            with proxy.lock:
                proxy.faults["503"] += 1
            self._error(503, path, method)
            return
        if faulty and draw < proxy.slowdown + proxy.reset and (method == "HEAD" or cut < 0.5):
            with proxy.lock:
                proxy.faults["reset"] += 1
            self._reset()
            return
        upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            with proxy.lock:  # HTTP header names are case-insensitive: obstore sends "if-match"
                headers = {k: proxy._true_etags.get(v, v) if k.lower() == "if-match" else v for k, v in headers.items()}
            upstream.request(method, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date") and not (
                proxy.no_checksums and key.lower().startswith("x-amz-checksum-")
            ):
                if key.lower() == "etag" and any(part in path for part in proxy.opaque_etags):
                    value = _opaque(proxy, value)
                self.send_header(key, value)
        length = response.getheader("Content-Length") if method == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if method == "HEAD":
            return
        if faulty and draw < proxy.slowdown + proxy.reset and len(data) > 1:  # reset mid-body
            with proxy.lock:
                proxy.faults["reset"] += 1
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self._reset()
            return
        ok = method == "GET" and 200 <= response.status < 300
        if ok and data:
            data = self._corrupted(path, data)
            pause = next((seconds for part, seconds in proxy.trickle.items() if part in path), None)
            if pause is not None:
                self._trickle(data, pause)
                return
        if not ok:
            self.wfile.write(data)
            return
        with proxy.lock:  # counted before it is sent: a client holding the body sees it counted
            proxy.bytes_sent[path] += len(data)
        try:
            self.wfile.write(data)
        except OSError:  # not sent whole: not counted
            with proxy.lock:
                proxy.bytes_sent[path] -= len(data)
            raise

    def _corrupted(self, path: str, data: bytes) -> bytes:
        """`data` with one byte flipped, if `corrupt` still asks it for `path`: another byte each
        time, as damage in transit is (the same wrong bytes twice are the object's own)."""
        proxy = self.server
        with proxy.lock:
            part = next((part for part, left in proxy.corrupt.items() if part in path and left > 0), None)
            if part is None:
                return data
            proxy.corrupt[part] -= 1
            at = proxy.faults["corrupt"] % len(data)
            proxy.faults["corrupt"] += 1
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]

    def _trickle(self, data: bytes, pause: float) -> None:
        """Send `data` a byte at a time, `pause` seconds apart, until done or the client leaves."""
        with self.server.lock:
            self.server.faults["trickle"] += 1
        try:
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(pause)
        except OSError:  # the client gave up: what a trickle is for
            self.close_connection = True

    def _error(self, status: int, path: str, method: str) -> None:
        code, message = _CODES[status]
        body = _ERROR.format(code=code, message=message, path=path).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends a TCP RST, the client sees "connection reset by peer".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


def _opaque(proxy: FaultProxy, etag: str) -> str:
    """Another 32-hex ETag for `etag` (an encrypted object's look), remembered to map it back."""
    shown = f'"{hashlib.md5(etag.encode(), usedforsecurity=False).hexdigest()}"'
    with proxy.lock:
        proxy._true_etags[shown] = etag
    return shown


def new_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh name on the server; returns the name."""
    name = f"gl-{uuid.uuid4().hex[:12]}"
    fs, _ = storage.Store(options(endpoint)).filesystem(f"s3://{name}")
    fs.call_s3("create_bucket", Bucket=name)  # no location constraint: the server's default region
    return name


def options(endpoint: str) -> dict[str, Any]:
    """storage_options for s3fs against `endpoint`."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }


def write_shards(
    bucket: str, opts: dict[str, Any], n: int = 40, per_shard: int = 8, size: int = 2000, *, index: bool = False
) -> list[str]:
    """Tar shards of `n` samples (random bytes of about `size`, and the index as cls) in `bucket`,
    with their index sidecars if `index`."""
    from globalloader.sources import TarWriter

    with TarWriter(f"s3://{bucket}/shard-%03d.tar", maxcount=per_shard, storage_options=opts, index=index) as writer:
        for i in range(n):
            writer.write({"__key__": f"s{i:05d}", "bin": os.urandom(size + i % 7), "cls": i})
    return writer.paths
