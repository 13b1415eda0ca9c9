"""DecodeFields: a tar shard record's bytes fields decoded by their extension, as a map step.

TarShards yields every member as bytes, as `webdataset.WebDataset(url)` does before its
`.decode()`; `Dataset(...).map(DecodeFields())` is that decode step. It is a pure function of
the record (no randomness, no state), so it may be cached (`cache()`) and shared across jobs
(`map(DecodeFields(), shared=True)`).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from globalloader.errors import ArgumentError, CorruptSampleError
from globalloader.vision import IMAGE_EXTENSIONS, decode_image, sample_name, to_array

IMAGE_OUTPUTS = ("numpy", "pil", None)
_BYTES = (bytes, bytearray, memoryview)


_TEXT = ("utf-8 text", lambda data: bytes(data).decode("utf-8"))
_INT = ("an int", lambda data: int(bytes(data).decode("ascii").strip()))
# Extension -> (what it is, for the error message; how to decode its bytes). An .npy member
# holding Python objects is refused (allow_pickle=False), never unpickled.
_DECODERS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "txt": _TEXT,
    "text": _TEXT,
    "json": ("JSON", lambda data: json.loads(bytes(data))),
    "cls": _INT,
    "cls2": _INT,
    "index": _INT,
    "npy": ("a .npy array", lambda data: np.load(io.BytesIO(bytes(data)), allow_pickle=False)),
}


@dataclass(frozen=True)
class DecodeFields:
    """Record -> record with each bytes field decoded by its extension (the part of the field's
    name after its last dot, so "seg.png" is an image and "meta.json" JSON):

    - images (jpg, jpeg, png, webp, ppm, pgm, pbm, pnm, bmp, tif, tiff, gif), with Pillow (the
      `vision` extra, imported only when a record has one): `image="numpy"` gives a uint8 HWC
      array, `"pil"` a Pillow image, None keeps the bytes; `mode` converts ("RGB"; None keeps
      the file's mode);
    - json: the parsed value; txt, text: a str (UTF-8);
    - cls, cls2, index: an int;
    - npy: a NumPy array (np.load with allow_pickle=False: object arrays are refused).

    Other fields (unknown extensions, pickles such as pyd, which are never unpickled) stay bytes;
    fields that are not bytes (already decoded) and `__key__`/`__url__` are left as they are.
    The input record is not changed. A field that does not decode raises CorruptSampleError
    naming the record's key (and shard) and the field, so `on_error="skip"` can skip it.
    """

    image: str | None = "numpy"
    mode: str | None = "RGB"

    def __post_init__(self) -> None:
        if self.image not in IMAGE_OUTPUTS:
            raise ArgumentError(f"DecodeFields: image must be one of {IMAGE_OUTPUTS}, got {self.image!r}")
        if self.mode is not None and not isinstance(self.mode, str):
            raise ArgumentError(f"DecodeFields: mode must be a Pillow mode such as 'RGB', or None, got {self.mode!r}")

    def __call__(self, record: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(record, Mapping):
            raise ArgumentError(f"DecodeFields: expected a dict record, got {type(record).__name__}")
        out = dict(record)
        for field, value in record.items():
            if isinstance(value, _BYTES) and not field.startswith("__"):
                out[field] = self._decode(record, field, value)
        return out

    def _decode(self, record: Mapping[str, Any], field: str, data: Any) -> Any:
        extension = field.rsplit(".", 1)[-1].lower()
        if extension in IMAGE_EXTENSIONS:
            if self.image is None:
                return data
            img = decode_image(data, f"{sample_name(record)}, field {field!r}", self.mode)
            return to_array(img) if self.image == "numpy" else img
        decoder = _DECODERS.get(extension)
        if decoder is None:
            return data
        kind, decode = decoder
        try:
            return decode(data)
        except (ValueError, EOFError, OSError) as exc:  # JSON, UTF-8, int() and np.load errors
            raise CorruptSampleError(
                f"{sample_name(record)}, field {field!r}: cannot decode as {kind}: {exc}"
            ) from None
