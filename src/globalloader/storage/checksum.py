"""End-to-end checks of downloads: the bytes received against what the object is known to hold,
so that bytes corrupted in transit are fetched again, never cached or served.

What a whole object is checked against, every one that is known:
- the MD5 its S3 ETag is: a plain 32-hex ETag (no "-N" of a multipart upload) of an object not
  encrypted with KMS or a customer key (their ETags are no MD5), as the answer itself says, or,
  for a client whose answers do not name the encryption, as a HEAD says once the bytes differ
  from the ETag (`Digest`'s `etag_is_md5`);
- a CRC-32 the project recorded when it wrote the object (a tar shard's `.idx` sidecar);
- the store's own checksum of a whole-object answer (S3's `x-amz-checksum-*` headers), which the
  S3 client verifies as it reads the body (botocore's FlexibleChecksumError).

A range of an object (a block of a large Parquet file, one sample read without the cache) has no
checksum of its own at the store: it is checked by TCP (and TLS on https) only. A mismatch is a
`TransferCorrupted`, a transient fault: `storage.retry` fetches the bytes again; the same wrong
bytes twice are the object's own, a SourceError (see `Digest`).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Callable

from globalloader.errors import SourceError

_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')  # an S3 ETag of a one-part upload: the MD5
# S3's server-side encryption whose ETags are not the MD5 of the object.
_OPAQUE_ETAG_ENCRYPTION = frozenset({"aws:kms", "aws:kms:dsse"})


class TransferCorrupted(Exception):
    """Bytes received that do not match the object's checksum: corrupted in transit."""


def etag_md5(etag: str) -> str | None:
    """The MD5 (lowercase hex) an S3 ETag is, or None when it is not one (multipart, other
    stores' versions)."""
    match = _MD5_ETAG.match(etag)
    return match.group(1).lower() if match else None


def answer_md5(etag: str, encryption: str | None, customer_key: str | None) -> str | None:
    """The MD5 an S3 GET answer vouches for: its ETag's, unless KMS or a customer key encrypts
    the object (its ETag is then no MD5)."""
    if encryption in _OPAQUE_ETAG_ENCRYPTION or customer_key:
        return None
    return etag_md5(etag)


class Digest:
    """The checks of the tries at one whole download: each try's running MD5 and/or CRC-32,
    `check`ed once all its bytes were fed.

    Corruption in transit is random: a try whose bytes are wrong is a TransferCorrupted (tried
    again), but the same wrong bytes twice mean the object itself differs from its checksum (a
    shard rewritten behind its sidecar, a store whose ETags are no MD5s): a SourceError at once,
    naming where the CRC-32 was recorded (`recorded_in`) and what to do (`fix`). Bytes that differ
    from an MD5 an answer only presumed from the ETag are checked by `etag_is_md5()` first: an
    ETag it says is no MD5 (an encrypted object) leaves nothing to check the MD5 against.
    """

    def __init__(
        self,
        url: str,
        crc32: int | None = None,
        recorded_in: str = "",
        fix: str = "",
        etag_is_md5: Callable[[], bool] | None = None,
    ) -> None:
        self.url, self.crc32, self.recorded_in, self.fix = url, crc32, recorded_in, fix
        self.etag_is_md5 = etag_is_md5
        self._wrong: set[tuple[str, int]] = set()
        self.restart(None)

    def restart(self, md5: str | None) -> None:
        """Start a try whose answers vouch for this MD5 (None: they vouch for none)."""
        self.md5 = md5
        self._md5 = hashlib.md5(usedforsecurity=False) if md5 is not None else None
        self._crc = 0

    def update(self, data: bytes) -> None:
        if self._md5 is not None:
            self._md5.update(data)
        if self.crc32 is not None:
            self._crc = zlib.crc32(data, self._crc)

    def matches(self) -> bool:
        """Whether the try's bytes match every known checksum, asking nothing (`check` may ask
        the store, with a HEAD, whether the ETag is an MD5): False means `check` decides."""
        return (self._md5 is None or self._md5.hexdigest() == self.md5) and (
            self.crc32 is None or self._crc == self.crc32
        )

    def check(self) -> None:
        """Nothing if the try's bytes match every known checksum; else a TransferCorrupted, or
        a SourceError when an earlier try had the same wrong bytes."""
        if self.matches():
            return
        md5 = self._md5.hexdigest() if self._md5 is not None else ""
        if md5 != (self.md5 or "") and self.etag_is_md5 is not None and not self.etag_is_md5():
            md5 = ""  # an encrypted object's ETag: no MD5 to check
            self._md5 = None
        if self._md5 is not None and md5 != self.md5:
            problem = f"the MD5 of the bytes received from {self.url} is {md5}, its ETag says {self.md5}"
            again = "the store's ETag of it is no MD5 (an encrypted object?) or the object is damaged at the store"
        elif self.crc32 is not None and self._crc != self.crc32:
            problem = (
                f"{self.url} does not match {self.recorded_in} (CRC-32 {self._crc:#010x}, recorded {self.crc32:#010x})"
            )
            again = f"it was rewritten since; {self.fix}"
        else:
            return
        if (md5, self._crc) in self._wrong:
            raise SourceError(f"{problem}, twice: {again}")
        self._wrong.add((md5, self._crc))
        raise TransferCorrupted(problem)
