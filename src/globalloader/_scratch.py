"""Per-thread scratch arrays: memory a thread reuses from one sample to the next.

A fresh array per sample is memory the C allocator may have handed back to the system since the
last sample, and its page faults can cost a third of a JPEG decode (benchmarks/decode.py). A
scratch array stays valid only until its thread asks for the same name again, so it suits a
caller that copies out what it needs (the crop's resample reads the decoded pixels; normalize's
OpenCV pass reads their float copy). Requests over `LIMIT` bytes get None, and the caller makes an
array of its own: one large image must not pin its size in every thread.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

LIMIT = 16 << 20  # bytes per scratch array
_local = threading.local()


def array(name: str, count: int, dtype: Any) -> np.ndarray | None:
    """`count` elements of `dtype` (1-D) from this thread's scratch `name`, grown as needed; None
    over `LIMIT` bytes."""
    dtype = np.dtype(dtype)
    if count * dtype.itemsize > LIMIT:
        return None
    kept: dict[str, np.ndarray] = _local.__dict__
    buffer = kept.get(name)
    if buffer is None or buffer.size < count:
        buffer = kept[name] = np.empty(count, dtype)
    return buffer[:count]
