"""Tests for globalloader._scratch: per-thread arrays reused from one sample to the next."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from globalloader import _scratch


def test_a_name_gives_the_same_memory_again_grown_when_asked_for_more():
    a = _scratch.array("test-reuse", 100, np.float32)
    assert a.shape == (100,) and a.dtype == np.float32
    assert np.shares_memory(_scratch.array("test-reuse", 50, np.float32), a)
    bigger = _scratch.array("test-reuse", 1000, np.float32)
    assert bigger.shape == (1000,) and np.shares_memory(_scratch.array("test-reuse", 10, np.float32), bigger)


def test_names_and_threads_never_share_memory():
    mine = _scratch.array("test-a", 64, np.uint8)
    assert not np.shares_memory(_scratch.array("test-b", 64, np.uint8), mine)
    theirs: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: theirs.append(_scratch.array("test-a", 64, np.uint8)))
    thread.start()
    thread.join()
    assert not np.shares_memory(theirs[0], mine)


@pytest.mark.parametrize(("count", "dtype"), [(_scratch.LIMIT + 1, np.uint8), (_scratch.LIMIT // 4 + 1, np.float32)])
def test_more_than_the_limit_is_refused_and_keeps_nothing(count, dtype):
    small = _scratch.array("test-limit", 8, dtype)
    assert _scratch.array("test-limit", count, dtype) is None
    assert np.shares_memory(_scratch.array("test-limit", 8, dtype), small)
    assert _scratch.array("test-limit", _scratch.LIMIT // np.dtype(dtype).itemsize, dtype) is not None
