"""URL -> fsspec filesystem, with the client's own retries turned off and its errors sorted.

Every retry happens in `storage.retry`, so the total behaviour is bounded in one place: S3's
client (s3fs over aiobotocore) is made with one attempt per call in both of its retry layers
(s3fs's `retries` and botocore's `total_max_attempts`), a connect and a read timeout. Options
from the caller (`storage_options=`: endpoint, key/secret, anon, ...) are passed to fsspec as
they are; where they say nothing, the standard AWS/GCS environment and config files apply.

One filesystem instance per process and options serves every thread (fsspec would make one per
thread, and an S3 client costs a tenth of a second or more to make), and S3 clients share one
aiobotocore session per process tree: a forked worker inherits its parsed service models, so its
first request does not parse them again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

from globalloader import _extras
from globalloader.errors import SourceError
from globalloader.storage.checksum import TransferCorrupted, answer_md5

CONNECT_TIMEOUT = 10.0  # seconds for one TCP connect to the object store
READ_TIMEOUT = 30.0  # seconds without a byte on an open response
MAX_CONNECTIONS = 256  # open connections per S3 client (one client serves every thread of a process and the
# pool of downloads ahead, up to its GLOBALLOADER_FETCH_CONCURRENCY requests in flight)
# Schemes that are not object storage: the machine cache never holds them (`memory://` lives in
# one process, `file://` is a local file already).
LOCAL_SCHEMES = frozenset({"file", "local", "memory"})
S3_SCHEMES = frozenset({"s3", "s3a"})  # the schemes s3fs serves

# Errno values of faults that may pass: s3fs maps 503/SlowDown to EBUSY and 500 to EREMOTEIO.
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        errno.EREMOTEIO,
        errno.EIO,
        errno.EAGAIN,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.ETIMEDOUT,
        errno.EPIPE,
    }
)
# Client exceptions that are not OSErrors, by class name (so botocore and aiohttp are never
# imported for a local run): connection drops, timeouts, truncated or unparsable responses.
_TRANSIENT_NAMES = frozenset(
    {
        "HTTPClientError",
        "ConnectionError",
        "ConnectionClosedError",
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseParserError",
        "IncompleteReadError",
        "IncompleteRead",
        "ClientPayloadError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "FSTimeoutError",
        "ProtocolError",
        "FlexibleChecksumError",  # botocore: the body does not match the store's checksum header
    }
)
_THROTTLING = ("SlowDown", "reduce your request rate", "Throttl", "ServiceUnavailable", "InternalError")


def scheme_of(url: str) -> str:
    """The URL's scheme, or "" for a local path."""
    head, sep, _ = url.partition("://")
    return head if sep and "/" not in head else ""


@contextlib.contextmanager
def local_errors(url: str, what: str = "open") -> Iterator[None]:
    """An OSError of the block, on local file `url`, as the SourceError naming it."""
    try:
        yield
    except FileNotFoundError:
        raise SourceError(f"file not found: {url}") from None
    except OSError as exc:
        raise SourceError(f"cannot {what} {url}: {exc.strerror}") from None


def is_transient(exc: BaseException) -> bool:
    """Whether a failed call may succeed if made again (5xx, throttling, reset, timeout,
    corrupted transfer)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, TransferCorrupted)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    text = str(exc)
    return any(mark in text for mark in _THROTTLING)


class S3Answer(NamedTuple):
    """The body of one S3 GET, and the MD5 of the whole object its ETag vouches for (None when
    the ETag is no MD5; see `checksum.answer_md5`)."""

    data: bytes
    md5: str | None


def read_s3_if_match(
    fs: Any, path: str, start: int, end: int, etag: str, *, whole: bool, timeout: float
) -> S3Answer | None:
    """Bytes [start, end) of the S3 object at `path` if it still has ETag `etag`, else None.

    One GET with If-Match (`get_s3_if_match`) on the client's event loop, cancelled after
    `timeout` seconds (an FSTimeoutError).
    """
    from fsspec.asyn import sync  # type: ignore[import-untyped]

    answer: S3Answer | None = sync(fs.loop, get_s3_if_match, fs, path, start, end, etag, whole=whole, timeout=timeout)
    return answer


async def get_s3_if_match(fs: Any, path: str, start: int, end: int, etag: str, *, whole: bool) -> S3Answer | None:
    """`read_s3_if_match` as a coroutine of the client's event loop (for many GETs in flight).

    One GET with If-Match, so the answer is all of that version or a refusal (412: None), never
    bytes of a version written since. Through s3fs's async call: its `cat_file` takes no
    conditions. A `whole` object is asked for without a range, so that the store sends its
    checksum of the object (S3 sends none with a range) and the client checks the body against it.
    """
    bucket, key, version_id = fs.split_path(path)
    pinned = {"VersionId": version_id} if version_id else {}  # a version_aware client's "?versionId="
    ranged = {} if whole else {"Range": f"bytes={start}-{end - 1}"}
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, IfMatch=etag, **ranged, **pinned)
        try:
            body: bytes = await resp["Body"].read()
        finally:
            resp["Body"].close()
    except OSError as exc:
        code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
        if exc.errno == errno.EINVAL and code == "PreconditionFailed":
            return None
        raise
    md5 = answer_md5(resp.get("ETag", ""), resp.get("ServerSideEncryption"), resp.get("SSECustomerAlgorithm"))
    return S3Answer(body, md5)


def is_throttling(exc: BaseException) -> bool:
    """Whether a failed call is the store asking for fewer requests (503 SlowDown, 429)."""
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:  # s3fs's translation of 503 SlowDown
        return True
    text = str(exc)
    return any(mark in text for mark in _THROTTLING[:4]) or "429" in text or "Too Many Requests" in text


def bounded(fs: Any, timeout: float) -> dict[str, float]:
    """The keyword arguments that cancel a call of `fs` after `timeout` seconds: fsspec's async
    clients (S3, GCS, Azure, HTTP) take `timeout=`; local and in-memory ones need none."""
    return {"timeout": timeout} if getattr(fs, "async_impl", False) else {}


def filesystem(url: str, options: dict[str, Any] | None) -> tuple[Any, str]:
    """(fsspec filesystem, path) for `url`; instances are shared per process and options."""
    scheme = scheme_of(url)
    kwargs = dict(options or {})
    key = (os.getpid(), scheme, json.dumps(kwargs, sort_keys=True, default=repr))
    fs = _INSTANCES.get(key)
    if fs is None:
        with _INSTANCES_LOCK:
            fs = _INSTANCES.get(key)
            if fs is None:
                fs = _INSTANCES[key] = _make(url, scheme, kwargs)
    return fs, fs._strip_protocol(url)


def _make(url: str, scheme: str, kwargs: dict[str, Any]) -> Any:
    fsspec = _extras.require("fsspec", "remote")
    if scheme in S3_SCHEMES:
        kwargs = _s3_defaults(kwargs)
    try:
        fs, _ = fsspec.core.url_to_fs(url, **kwargs)
    except (ImportError, ValueError, TypeError) as exc:
        raise SourceError(f"cannot open {url}: {exc}") from None
    if scheme in S3_SCHEMES:
        fs.retries = 1  # s3fs's own loop: one attempt; storage.retry decides the rest
    return fs


_INSTANCES: dict[tuple[int, str, str], Any] = {}  # (pid, scheme, options) -> filesystem
_INSTANCES_LOCK = threading.Lock()
_SESSION: list[Any] = []  # the aiobotocore session S3 clients share (made once, kept across forks)
# Options that shape the aiobotocore session itself: given any, s3fs makes its own.
_SESSION_OPTIONS = frozenset({"session", "profile", "session_vars", "event_hooks"})


def _s3_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    config = dict(kwargs.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT)
    config.setdefault("read_timeout", READ_TIMEOUT)
    config.setdefault("max_pool_connections", MAX_CONNECTIONS)
    kwargs["config_kwargs"] = config
    if _SESSION_OPTIONS.isdisjoint(kwargs):
        if not _SESSION:
            try:
                import aiobotocore.session  # type: ignore[import-untyped]
            except ImportError:  # no s3fs either: url_to_fs names the missing package
                return kwargs
            _SESSION.append(aiobotocore.session.AioSession())
        kwargs["session"] = _SESSION[0]
    return kwargs


def _forget_inherited_clients() -> None:
    """In a forked child: drop the close-at-exit hooks of the S3 clients the parent made.

    fsspec makes new filesystem instances in a child; the inherited ones would be collected,
    and their finalizers would close the parent's aiobotocore sessions on an event loop that does
    not run here ("... attached to a different loop" tracebacks at exit). Their sockets and event
    loop are the parent's (closing them here could unregister the parent's sockets from its
    epoll set): the child keeps them untouched until it exits.
    """
    global _INSTANCES_LOCK
    _INSTANCES_LOCK = threading.Lock()  # a thread of the parent may have held it at the fork
    s3fs = sys.modules.get("s3fs")
    if s3fs is None:
        return
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        info = finalizer.peek()
        if info is not None and isinstance(info[0], s3fs.S3FileSystem):
            finalizer.detach()
            _INHERITED.append(info[0])


_INHERITED: list[Any] = []  # the parent's S3 clients, kept so their __del__ never runs here


os.register_at_fork(after_in_child=_forget_inherited_clients)
