"""URL -> fsspec filesystem, with the client's own retries turned off and its errors sorted.

Every retry happens in `storage.retry`, so the total behaviour is bounded in one place: S3's
client (s3fs over aiobotocore) is made with one attempt per call in both of its retry layers
(s3fs's `retries` and botocore's `total_max_attempts`), a connect and a read timeout; GCS's
(gcsfs) and Azure's (adlfs over the Azure SDK) with their retry loops off too. Reads of one
version of an object (If-Match on S3's and Azure's ETag, `ifGenerationMatch` on GCS) are made
per store from one table, `CONDITIONAL`. Options
from the caller (`storage_options=`: endpoint, key/secret, anon, ...) are passed to fsspec as
they are; where they say nothing, the standard AWS/GCS environment and config files apply.

One filesystem instance per process and options serves every thread (fsspec would make one per
thread, and an S3 client costs a tenth of a second or more to make), and S3 clients share one
aiobotocore session per process tree: a forked worker inherits its parsed service models, so its
first request does not parse them again.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import sys
import threading
import types
import weakref
from collections.abc import Awaitable, Callable, Iterator
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
GCS_SCHEMES = frozenset({"gs", "gcs"})  # the schemes gcsfs serves
AZURE_SCHEMES = frozenset({"az", "abfs", "abfss"})  # the schemes adlfs serves

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
        "ProxyError",  # gcsfs: a 502 answer
        "ServiceRequestError",  # the Azure SDK: no connection, or a timeout on one
        "ServiceResponseError",  # the Azure SDK: the answer cut off or too slow
    }
)
# HTTP statuses that may pass: timeouts, throttling, server faults (gcsfs and the Azure SDK raise
# them with the status; s3fs maps them to the errnos above).
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
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
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)) or is_denied(exc):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, TransferCorrupted)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    if http_status(exc) in _TRANSIENT_STATUSES:
        return True
    text = str(exc)
    return any(mark in text for mark in _THROTTLING)


def is_denied(exc: BaseException) -> bool:
    """Whether a failed call was refused for its credentials (401/403), by any store's client."""
    forbidden = isinstance(exc, OSError) and str(exc).startswith("Forbidden:")  # gcsfs's 403
    return isinstance(exc, PermissionError) or forbidden or http_status(exc) in (401, 403)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status a client's exception carries (gcsfs's HttpError `code`, the Azure SDK's
    `status_code`), if any."""
    for name in ("status_code", "code"):
        status = getattr(exc, name, None)
        if isinstance(status, int):
            return status
    return None


class Answer(NamedTuple):
    """The body of one GET, and the MD5 (lowercase hex) of the whole object the answer vouches for
    (None when it vouches for none; see `storage.checksum`)."""

    data: bytes
    md5: str | None


async def _get_s3(fs: Any, path: str, span: tuple[int, int] | None, version: str) -> Answer | None:
    """S3: If-Match on the ETag (412 PreconditionFailed: changed). Through s3fs's async call: its
    `cat_file` takes no conditions."""
    bucket, key, version_id = fs.split_path(path)
    pinned = {"VersionId": version_id} if version_id else {}  # a version_aware client's "?versionId="
    ranged = _range_header(span)
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, IfMatch=version, **ranged, **pinned)
    except OSError as exc:
        code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
        if exc.errno == errno.EINVAL and code == "PreconditionFailed":
            return None
        raise
    try:
        body: bytes = await resp["Body"].read()
    finally:
        resp["Body"].close()
    return Answer(
        body, answer_md5(resp.get("ETag", ""), resp.get("ServerSideEncryption"), resp.get("SSECustomerAlgorithm"))
    )


async def _get_gcs(fs: Any, path: str, span: tuple[int, int] | None, version: str) -> Answer | None:
    """GCS: `ifGenerationMatch` on the generation (412: changed), and the answer's own
    `x-goog-generation` compared; a server that sends no such header (an emulator) is asked for
    the generation again after the read, since a generation is never reused."""
    try:
        url = f"{fs.url(path)}&ifGenerationMatch={version}"
        headers, body = await fs._call("GET", url, headers=_range_header(span))
    except FileExistsError:  # gcsfs's name for 412 Precondition Failed
        return None
    answered = headers.get("x-goog-generation")
    if answered is None:
        bucket, key, _ = fs.split_path(path)
        answered = (await fs._call("GET", "b/{}/o/{}", bucket, key, json_out=True)).get("generation")
    if str(answered) != version:
        return None
    hashes = dict(part.strip().split("=", 1) for part in headers.get("x-goog-hash", "").split(",") if "=" in part)
    md5 = base64.b64decode(hashes["md5"]).hex() if "md5" in hashes and span is None else None
    return Answer(body, md5)


async def _get_azure(fs: Any, path: str, span: tuple[int, int] | None, version: str) -> Answer | None:
    """Azure Blob: If-Match on the ETag (412 ConditionNotMet: changed), and the answer's ETag
    compared."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

    container, blob, version_id = fs.split_path(path)
    window = {"offset": span[0], "length": span[1] - span[0]} if span is not None else {}
    async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
        try:
            stream = await client.download_blob(
                etag=version, match_condition=MatchConditions.IfNotModified, version_id=version_id, **window
            )
            body: bytes = await stream.readall()
        except ResourceModifiedError:
            return None
        except ResourceNotFoundError as exc:
            raise FileNotFoundError(errno.ENOENT, "not found", path) from exc
    if stream.properties.etag != version:
        return None
    md5 = stream.properties.content_settings.content_md5
    return Answer(body, bytes(md5).hex() if md5 and span is None else None)


def _range_header(span: tuple[int, int] | None) -> dict[str, str]:
    """The HTTP Range header of bytes [start, end), or none for the whole object."""
    return {} if span is None else {"Range": f"bytes={span[0]}-{span[1] - 1}"}


class _Conditional(NamedTuple):
    """How one object store names an object's version and reads only that version."""

    field: str  # the `info()` field that is the version
    is_version: Callable[[str], bool]  # whether a FileStat's version came from that field
    get: Callable[[Any, str, tuple[int, int] | None, str], Awaitable[Answer | None]]  # (fs, path, span, version)


def _quoted(version: str) -> bool:
    return version.startswith('"')  # S3 and Azure quote their ETags; mtimes are not quoted


_S3 = _Conditional("ETag", _quoted, _get_s3)
_AZURE = _Conditional("etag", _quoted, _get_azure)
_GCS = _Conditional("generation", str.isdigit, _get_gcs)
# scheme -> how its store reads one version: one table, so each store's rules live in one place
CONDITIONAL = dict.fromkeys(S3_SCHEMES, _S3) | dict.fromkeys(GCS_SCHEMES, _GCS) | dict.fromkeys(AZURE_SCHEMES, _AZURE)


def version_field(url: str) -> str | None:
    """The `info()` field that is the version of an object at `url`, for a store that can read
    only that version (see `read_if_version`); None for others."""
    known = CONDITIONAL.get(scheme_of(url))
    return known.field if known is not None else None


def can_read_if_version(url: str, version: str) -> bool:
    """Whether `read_if_version` can pin a read of `url` to `version` (its store has conditional
    reads and the version is that store's own, not an mtime fallback)."""
    known = CONDITIONAL.get(scheme_of(url))
    return known is not None and bool(version) and known.is_version(version)


def read_if_version(
    fs: Any, url: str, path: str, start: int, end: int, version: str, *, whole: bool, timeout: float
) -> Answer | None:
    """Bytes [start, end) of the object at `path` if it is still version `version` (the value of
    its `version_field`), else None.

    One conditional GET, so the answer is all of that version or a refusal (412), never bytes of a
    version written since. A `whole` object is asked for without a range, so that the store sends
    its checksum of the object (none is sent with a range). The call is cancelled after `timeout`
    seconds (an FSTimeoutError).
    """
    from fsspec.asyn import sync  # type: ignore[import-untyped]

    span = None if whole else (start, end)
    answer: Answer | None = sync(fs.loop, CONDITIONAL[scheme_of(url)].get, fs, path, span, version, timeout=timeout)
    return answer


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
    # The clients' own retry loops: one attempt each; storage.retry decides the rest.
    if scheme in S3_SCHEMES:
        fs.retries = 1
    elif scheme in GCS_SCHEMES:
        # gcsfs's `_request` is wrapped in a retry loop (6 tries, sleeps up to 32 s) when its class
        # is made: this instance calls the unwrapped request.
        fs._request = types.MethodType(type(fs)._request.__wrapped__, fs)
    elif scheme in AZURE_SCHEMES:
        # The Azure SDK's retry policy (3 retries, backoff from 15 s), shared by every blob
        # client the service client makes.
        for policy in fs.service_client._pipeline._impl_policies:
            if hasattr(policy, "total_retries"):
                policy.total_retries = 0
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
