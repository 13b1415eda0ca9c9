"""URL -> fsspec filesystem, with the client's own retries turned off and its errors sorted.

Every retry happens in `storage.retry`, so the total behaviour is bounded in one place: S3's
client (s3fs over aiobotocore) is made with one attempt per call in both of its retry layers
(s3fs's `retries` and botocore's `total_max_attempts`), a connect and a read timeout; S3 GETs of
object data go through obstore (Rust's object_store: a third of aiobotocore's CPU per GET) with
its retries off and the same timeouts, its errors translated as s3fs translates botocore's
(see `_obstore_error`); so does the listing of a folder where obstore names every key as it is
(`list_s3_quickly`), so that a job that only lists and reads ahead makes no s3fs client and
waits for no import of it (`_import_s3fs_meanwhile`); other listings, HEAD and writes stay on
s3fs. Two cases read through s3fs still: a whole object whose ETag is no MD5 (the store's
checksum headers, which obstore does not return, are all that checks it), and any GET of a
process forked after its parent's first obstore call, a GET or a listing (obstore's runtime
does not survive a fork; see `_obstore_usable`). The pool of
small downloads ahead reads an object whose ETag is an MD5 without a condition
(`get_s3_whole_unchecked`) and checks the bytes against it instead. GCS's
(gcsfs) and Azure's (adlfs over the Azure SDK) with their retry loops off too. Reads of one
version of an object (If-Match on S3's and Azure's ETag, `ifGenerationMatch` on GCS) are made
per store from one table, `CONDITIONAL`. Options from the caller (`storage_options=`: endpoint,
key/secret, anon, ...) are passed to fsspec as they are, and to obstore translated
(`_make_object_store`); where they say nothing, the standard AWS/GCS environment and config files
apply.

One filesystem instance per process and options serves every thread (fsspec would make one per
thread, and an S3 client costs a tenth of a second or more to make), and S3 clients share one
aiobotocore session per process tree: a forked worker inherits its parsed service models, so its
first request does not parse them again.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import errno
import importlib
import json
import os
import re
import sys
import threading
import types
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from globalloader import _extras
from globalloader.errors import SourceError
from globalloader.storage.checksum import TransferCorrupted, answer_md5, etag_md5

if TYPE_CHECKING:
    from obstore import GetOptions

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
CLIENT_MODULES = ("s3fs", "obstore", "gcsfs", "adlfs")  # the stores' client libraries, see `import_clients`

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


def import_clients() -> None:
    """Import the installed client libraries of the object stores now: for a process that forks
    workers which read remote data (importing s3fs costs a process about 0.15 CPU s, the `import`
    step `benchmarks/remote.py` prints), so that each does not pay it on its first read. One that
    fails to import is named by the read that needs it."""
    for name in CLIENT_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


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
    """S3: If-Match on the ETag (412 PreconditionFailed: changed), through obstore where its
    runtime works in this process, else through s3fs's async call (its `cat_file` takes no
    conditions). obstore neither returns nor verifies the store's checksum headers
    (`x-amz-checksum-*`): a whole object whose ETag is no MD5 (a multipart upload), for which they
    are the store's only checksum, is read through s3fs, whose botocore verifies them."""
    checked_without_headers = span is not None or etag_md5(version) is not None  # a range has no checksum
    get = _get_s3_obstore if checked_without_headers and _obstore_usable() else _get_s3_s3fs
    return await get(fs, path, span, version)


async def _get_s3_s3fs(fs: Any, path: str, span: tuple[int, int] | None, version: str) -> Answer | None:
    """`_get_s3` through s3fs (aiobotocore): its answers name the encryption, so the MD5 is
    known from the answer alone."""
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


async def _get_s3_obstore(fs: Any, path: str, span: tuple[int, int] | None, version: str) -> Answer | None:
    """`_get_s3` through obstore. Its answers carry no encryption headers, so the MD5 is the
    ETag's when it looks like one: a mismatch asks `etag_is_md5` before it counts as corrupted."""
    bucket, key, version_id = fs.split_path(path)
    store = _object_store(fs.storage_options, bucket)  # a MissingExtraError without obstore
    import obstore

    options: GetOptions = {"if_match": version}
    if span is not None:
        options["range"] = span
    if version_id:
        options["version"] = version_id
    try:
        result = await obstore.get_async(store, key, options=options)
        body = bytes(await result.bytes_async())
    except Exception as exc:  # obstore's: translated, or None for a refused condition
        translated = _obstore_error(exc, path)
        if translated is None:
            return None
        raise translated from exc
    return Answer(body, etag_md5(result.meta.get("e_tag") or ""))


async def get_s3_whole_unchecked(options: dict[str, Any], bucket: str, key: str, size: int) -> bytes | None:
    """The bytes of a whole S3 object of `size` bytes (its current version: the caller splits a
    versioned path itself) in one call of obstore's (a range from 0: one future, where a
    conditional GET's answer and body are two; a quarter less of the client's CPU per small
    object), with no condition: the caller compares them with the MD5 the listed ETag is, which
    pins the version as If-Match on that ETag does (an object with those bytes has that ETag).
    The range asks for a byte more than `size`, so an object grown since is seen (more bytes come
    back) and never taken for its first `size` bytes. None when this read cannot tell, so the
    caller reads conditionally (and that read names what changed): obstore unusable in this
    process, an empty object, an answer of another length, or a refusal other than a missing
    object, a denial or a transient fault (a range the object, rewritten empty, no longer has)."""
    if size < 1 or not _obstore_usable():
        return None
    store = _object_store(options, bucket)
    import obstore

    try:
        body = bytes(await obstore.get_range_async(store, key, start=0, end=size + 1))
    except Exception as exc:  # obstore's, translated (no condition: never a refused one)
        translated = _obstore_error(exc, f"{bucket}/{key}")
        if translated is None or not (
            isinstance(translated, FileNotFoundError) or is_denied(translated) or is_transient(translated)
        ):
            return None
        raise translated from exc
    return body if len(body) == size else None


def s3_bucket_and_key(url: str) -> tuple[str, str] | None:
    """The bucket and key of an S3 URL, split without s3fs (whose import is most of a job's time
    to its first GET); None where s3fs's own split says more: an access point's ARN, a version
    (`?versionId=`)."""
    bucket, _, key = url.partition("://")[2].partition("/")
    if not bucket or bucket.startswith("arn:") or "?versionId=" in key:
        return None
    return bucket, key


def list_s3_quickly(options: dict[str, Any], bucket: str, prefix: str) -> list[tuple[str, int, str]] | None:
    """(key, size, ETag) of every object under `prefix` (a folder: not empty, ending in "/"),
    listed through obstore: from a process without an S3 client, a third of the time s3fs takes
    (most of that is importing s3fs, botocore and aiohttp; benchmarks/s3_clients.py). None where
    this listing may not name every key as it is, so that the caller lists through s3fs: obstore
    missing or unusable in this process, any error (obstore refuses keys its paths cannot hold:
    an empty, `.` or `..` segment, a control character; s3fs names the others), a zero-byte
    object (a folder marker `dir/`, which obstore names `dir`), a key named twice, an object
    without an ETag, or nothing (the URL may be an object itself). Never a bucket's whole
    listing: there obstore drops a key's leading `/`."""
    if not prefix.endswith("/") or not prefix.strip("/") or options.get("version_aware") or not _obstore_usable():
        return None
    try:
        store = _object_store(options, bucket)
        import obstore

        pages = obstore.list(store, prefix=prefix)
        found = [(meta["path"], meta["size"], meta["e_tag"]) for page in pages for meta in page]
    except Exception:  # noqa: BLE001 - s3fs lists again, and names the fault
        return None
    if not found or any(not size or not etag for _, size, etag in found) or len({k for k, _, _ in found}) < len(found):
        return None
    return [(key, size, str(etag)) for key, size, etag in found]


def _obstore_usable() -> bool:
    """Whether obstore's runtime (tokio's threads) runs in this process: not in a child forked
    after its parent made a GET through it, where every call would hang (obstore is not fork-safe,
    even with a store made after the fork)."""
    return not _OBSTORE_PID or _OBSTORE_PID[0] == os.getpid()


def _object_store(options: dict[str, Any], bucket: str) -> Any:
    """The obstore S3Store of `bucket`, made once per process from these storage options (the
    user's, or those of an s3fs filesystem made from them: the same store), for a call about to
    start obstore's runtime: this process is recorded as the one running it."""
    known = _STORE_SETTINGS.get(id(options))
    if known is None or known[0] is not options:  # worked out once per options dict (a GET each object)
        # Not the aiobotocore session s3fs is given (`_s3_defaults`): the store makes no use of it.
        settings = {name: value for name, value in _s3_config(options).items() if name != "session"}
        known = _STORE_SETTINGS[id(options)] = (options, json.dumps(settings, sort_keys=True, default=repr))
    key = (os.getpid(), known[1], bucket)
    store = _OBJECT_STORES.get(key)
    if store is None:
        with _INSTANCES_LOCK:
            store = _OBJECT_STORES.get(key)
            if store is None:
                store = _OBJECT_STORES[key] = _make_object_store(options, bucket)
    if not _OBSTORE_PID:
        _OBSTORE_PID.append(os.getpid())
    return store


def _make_object_store(options: dict[str, Any], bucket: str) -> Any:
    """An obstore S3Store reaching `bucket` as s3fs with these options does: endpoint, region,
    credentials (given, anonymous, else botocore's own chain: environment, config files,
    instance roles), addressing style, requester pays; one attempt per call and `_fs`'s timeouts."""
    obstore_store = _extras.require("obstore.store", "remote")
    client = dict(options.get("client_kwargs") or {})
    config = dict(options.get("config_kwargs") or {})
    settings: dict[str, Any] = {}
    endpoint = (
        options.get("endpoint_url")
        or client.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        settings["endpoint"] = endpoint
        # botocore addresses a custom endpoint by path unless told "virtual"
        settings["virtual_hosted_style_request"] = (config.get("s3") or {}).get("addressing_style") == "virtual"
    if options.get("requester_pays"):
        settings["request_payer"] = True
    key = options.get("key") or client.get("aws_access_key_id")
    secret = options.get("secret") or client.get("aws_secret_access_key")
    token = options.get("token") or client.get("aws_session_token")
    provider = None
    if options.get("anon"):
        settings["skip_signature"] = True
    elif key and secret:
        settings.update(access_key_id=key, secret_access_key=secret)
        if token:
            settings["token"] = token
    else:
        provider = _botocore_credentials(options.get("profile"))
    region = client.get("region_name") or _botocore_region(options.get("profile"))
    if region:
        settings["region"] = region
    connect = config.get("connect_timeout", CONNECT_TIMEOUT)
    read = config.get("read_timeout", READ_TIMEOUT)
    http = {
        "allow_http": str(endpoint or "").startswith("http://"),
        "connect_timeout": datetime.timedelta(seconds=connect),
        "read_timeout": datetime.timedelta(seconds=read),
        # A backstop only: each try's own deadline (`RetryPolicy.attempt_deadline`) cancels it first.
        "timeout": datetime.timedelta(hours=1),
        "pool_max_idle_per_host": str(config.get("max_pool_connections", MAX_CONNECTIONS)),
    }
    no_retries = {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=read)}
    return obstore_store.S3Store(
        bucket, client_options=http, retry_config=no_retries, credential_provider=provider, **settings
    )


def _botocore_credentials(profile: str | None) -> Callable[[], dict[str, Any]] | None:
    """obstore's credential callback over botocore's chain (the one s3fs follows), or None when
    that chain finds none (obstore then looks at the environment itself)."""
    import botocore.session  # type: ignore[import-untyped]

    found = botocore.session.Session(profile=profile).get_credentials()
    if found is None:
        return None

    def credentials() -> dict[str, Any]:
        frozen = found.get_frozen_credentials()  # refreshed by botocore when they near their end
        temporary = hasattr(found, "refresh_needed")  # botocore's RefreshableCredentials: ask again soon
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": soon if temporary else None,
        }

    return credentials


def _botocore_region(profile: str | None) -> str | None:
    """The region botocore finds (AWS_REGION, AWS_DEFAULT_REGION, the config file), if any."""
    import botocore.session

    region: str | None = botocore.session.Session(profile=profile).get_config_variable("region")
    return region


_STATUS = re.compile(r"status code: (\d{3})")


def _obstore_error(exc: Exception, path: str) -> Exception | None:
    """obstore's error as s3fs would raise it for botocore's (so `is_transient`, `is_denied`,
    `is_throttling` and `storage.retry` judge both alike), or None for a refused If-Match (412)."""
    import obstore.exceptions as failed

    if isinstance(exc, failed.PreconditionError):
        return None
    said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    match = _STATUS.search(said)
    status = int(match.group(1)) if match else None
    if isinstance(exc, FileNotFoundError) or status == 404:
        return FileNotFoundError(errno.ENOENT, said, path)
    if isinstance(exc, (failed.PermissionDeniedError, failed.UnauthenticatedError)) or status in (401, 403):
        return PermissionError(errno.EACCES, said, path)
    if status in (429, 503):  # throttling: s3fs's EBUSY
        return OSError(errno.EBUSY, said, path)
    if status is not None and (status >= 500 or status == 408):
        return OSError(errno.EREMOTEIO, said, path)
    if status is not None or not isinstance(exc, failed.GenericError):
        return OSError(errno.EINVAL, said, path)  # a request the store refuses: not tried again
    return ConnectionError(said)  # no answer: a reset, a cut body, a timeout


def etag_is_md5(fs: Any, path: str, etag: str) -> bool:
    """Whether S3's ETag `etag` of the object at `path` is its MD5: one HEAD through s3fs (whose
    answer names the encryption) when a GET's bytes did not match it, kept per object version.
    An object no longer at that ETag is said to have an MD5 ETag: the mismatch is then retried,
    and the conditional GET names the change."""
    bucket, key, version_id = fs.split_path(path)
    known = _ETAG_IS_MD5.get((path, etag))
    if known is None:
        pinned = {"VersionId": version_id} if version_id else {}
        head = fs.call_s3("head_object", Bucket=bucket, Key=key, **pinned)
        encryption, customer_key = head.get("ServerSideEncryption"), head.get("SSECustomerAlgorithm")
        if head.get("ETag") != etag:
            return True
        known = answer_md5(etag, encryption, customer_key) is not None
        if len(_ETAG_IS_MD5) >= _ETAG_IS_MD5_KEPT:
            _ETAG_IS_MD5.pop(next(iter(_ETAG_IS_MD5)))
        _ETAG_IS_MD5[path, etag] = known
    return known


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


def file_info(fs: Any, url: str, path: str, timeout: float) -> dict[str, Any]:
    """The client's `info()` of the object at `path`, cancelled after `timeout` seconds.

    On GCS, one GET of the object: gcsfs's `info` also lists the name as a folder at the same
    time (a request billed as a pricier class-A operation), and when that listing answers first
    it GETs the object a second time, a request still on its way when `info` returns. Only a
    name that is no object is asked again the client's way, to tell a folder from nothing.
    """
    if scheme_of(url) in GCS_SCHEMES:
        from fsspec.asyn import sync

        with contextlib.suppress(FileNotFoundError):
            info: dict[str, Any] = sync(fs.loop, fs._get_object, path, timeout=timeout)
            return info
    found: dict[str, Any] = fs.info(path, **bounded(fs, timeout))
    return found


def is_throttling(exc: BaseException) -> bool:
    """Whether a failed call is the store asking for fewer requests (503 SlowDown, 429). A 429 in
    the text counts only as a status ("(429)", botocore's code of a bodiless answer; "status code:
    429"): a message also holds URLs, bucket names and timings ("in 429.1µs"), which are not one."""
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:  # s3fs's translation of 503 SlowDown
        return True
    if http_status(exc) == 429:
        return True
    text = str(exc)
    return (
        any(mark in text for mark in _THROTTLING[:4])
        or "Too Many Requests" in text
        or "(429)" in text
        or any(status == "429" for status in _STATUS.findall(text))
    )


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
_OBJECT_STORES: dict[tuple[int, str, str], Any] = {}  # (pid, options, bucket) -> obstore S3Store
# id of an options dict -> (the dict, kept so its id is never another's; what of it decides a store)
_STORE_SETTINGS: dict[int, tuple[dict[str, Any], str]] = {}
_OBSTORE_PID: list[int] = []  # the process that started obstore's runtime (its first GET or listing)
_ETAG_IS_MD5: dict[tuple[str, str], bool] = {}  # (path, ETag) -> whether the ETag is the MD5
_ETAG_IS_MD5_KEPT = 65536  # answers kept, the oldest dropped first
_INSTANCES_LOCK = threading.Lock()
_SESSION: list[Any] = []  # the aiobotocore session S3 clients share (made once, kept across forks)
# Options that shape the aiobotocore session itself: given any, s3fs makes its own.
_SESSION_OPTIONS = frozenset({"session", "profile", "session_vars", "event_hooks"})


def _s3_config(options: dict[str, Any]) -> dict[str, Any]:
    """The options with botocore's config completed: one attempt per call, the timeouts, the
    connections (what `_make_object_store` reads of it too)."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1})
    config.setdefault("connect_timeout", CONNECT_TIMEOUT)
    config.setdefault("read_timeout", READ_TIMEOUT)
    config.setdefault("max_pool_connections", MAX_CONNECTIONS)
    return {**options, "config_kwargs": config}


def _s3_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs = _s3_config(kwargs)
    if _SESSION_OPTIONS.isdisjoint(kwargs):
        if not _SESSION:
            try:
                import aiobotocore.session  # type: ignore[import-untyped]
            except ImportError:  # no s3fs either: url_to_fs names the missing package
                return kwargs
            session = aiobotocore.session.AioSession()
            session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
            _SESSION.append(session)
        kwargs["session"] = _SESSION[0]
    return kwargs


def _timestamp(value: Any) -> datetime.datetime:
    """botocore's timestamps, an ISO 8601 one in UTC (each listed object's LastModified) read by
    the standard library: botocore's own parser goes through dateutil, a third of the client's
    CPU in a LIST (benchmarks/s3_clients.py). Others are left to botocore's."""
    if isinstance(value, str) and value.endswith("Z"):
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(value[:-1]).replace(tzinfo=datetime.UTC)
    from botocore.utils import parse_timestamp  # type: ignore[import-untyped]

    parsed: datetime.datetime = parse_timestamp(value)
    return parsed


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
