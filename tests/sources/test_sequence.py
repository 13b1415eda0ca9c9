"""from_sequence: in-memory sequences as sources."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, FingerprintError, SampleIndexError
from globalloader.sources import Source, from_sequence
from helpers import same


def test_items_are_the_records_as_they_are() -> None:
    record = {"__key__": "a", "x": 1}
    src = from_sequence([record, 5, "text"])
    assert isinstance(src, Source) and len(src) == 3
    assert src[0] is record and src[1] == 5 and src[2] == "text"


def test_numpy_array_and_range() -> None:
    assert from_sequence(np.arange(4) * 2)[3] == 6
    assert len(from_sequence(range(10))) == 10 and from_sequence(range(10))[9] == 9


@pytest.mark.parametrize(
    "items",
    [
        list(range(7)),
        [(f"f{i}.jpg", i % 2) for i in range(7)],
        [{"__key__": str(i), "v": i} for i in range(7)],
        np.arange(7) * 3,
    ],
)
def test_a_dataset_over_from_sequence_yields_what_one_over_the_bare_sequence_yields(items) -> None:
    bare = list(gl.Dataset(items).shuffle(seed=3))
    wrapped = list(gl.Dataset(from_sequence(items)).shuffle(seed=3))
    assert wrapped == bare and sorted(map(repr, bare)) == sorted(map(repr, list(items)))
    assert same(list(gl.Dataset(from_sequence(items)).batch(3)), list(gl.Dataset(items).batch(3)))


def test_fingerprint_hashes_content() -> None:
    assert from_sequence([1, 2, 3]).fingerprint == from_sequence([1, 2, 3]).fingerprint
    assert from_sequence([1, 2, 3]).fingerprint != from_sequence([1, 2, 4]).fingerprint
    assert from_sequence([1, 2, 3]).fingerprint.startswith("sequence:")


def test_unpicklable_items_need_a_key_instead_of_a_guess() -> None:
    items = [threading.Lock()]
    src = from_sequence(items)
    assert src[0] is items[0]  # reading needs no fingerprint
    with pytest.raises(FingerprintError, match=r"cannot be pickled.*key="):
        _ = src.fingerprint
    keyed = from_sequence(items, key="locks-v1")
    assert keyed.fingerprint == from_sequence([threading.Lock()], key="locks-v1").fingerprint
    assert keyed.fingerprint != from_sequence(items, key="locks-v2").fingerprint


def test_pickles() -> None:
    src = from_sequence([{"__key__": "k", "v": np.ones(3)}])
    clone = pickle.loads(pickle.dumps(src))
    assert clone.fingerprint == src.fingerprint and clone[0]["__key__"] == "k"


@pytest.mark.parametrize("bad", [5, "abc", b"abc", {"a": 1}, None])
def test_rejects_non_sequences(bad: object) -> None:
    with pytest.raises(ArgumentError, match="seq must be a sequence"):
        from_sequence(bad)  # type: ignore[arg-type]


def test_index_errors() -> None:
    src = from_sequence([1, 2])
    with pytest.raises(SampleIndexError, match=r"index 2 is out of range .* length 2"):
        src[2]
    with pytest.raises(SampleIndexError, match="index -1 is negative"):
        src[-1]
    with pytest.raises(ArgumentError, match="got float"):
        src[0.0]  # type: ignore[index]


def identical(a: object, b: object) -> bool:
    """The same type and value, -0.0 and NaN's bits included."""
    if type(a) is not type(b):
        return False
    return struct.pack("<d", a) == struct.pack("<d", b) if isinstance(a, float) else a == b


PLAIN = {
    "str": ["", "a/b.jpg", "", "naïve/日本語.png", "nul\0inside", "\udcff-surrogate-escaped", "x" * 10_000],
    "ascii str": [f"/data/train/{i:08d}.JPEG" for i in range(50)] + [""],
    "bytes": [b"", b"\0\0", b"\xff\xfe", "日本".encode(), b"x" * 10_000, b""],
    "int": [0, -1, 1, 2**63 - 1, -(2**63), 7],
    "float": [0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 5e-324],
    "bool": [True, False, False, True],
    "one item": ["only"],
    "empty strs": ["", "", ""],
    "empty bytes": [b""],
}


@pytest.mark.parametrize("name", sorted(PLAIN))
@pytest.mark.parametrize("container", [list, tuple])
def test_plain_items_come_back_identical_from_flat_buffers(name: str, container: type) -> None:
    items = container(PLAIN[name])
    src = from_sequence(items)
    assert len(src) == len(items)
    assert all(identical(src[i], item) for i, item in enumerate(items))
    clone = pickle.loads(pickle.dumps(src))  # what a spawned worker or the shared server gets
    assert all(identical(clone[i], item) for i, item in enumerate(items))
    assert clone.fingerprint == src.fingerprint


@pytest.mark.parametrize(
    "items",
    [
        [1, 2**64, 3],  # beyond int64
        [1, "a", b"b", 2.0, True],  # mixed
        [1, True],  # bool is an int subclass: the kinds differ
        [np.str_("a"), np.str_("b")],  # subclasses keep their type
        [np.float64(1.0), np.float64(2.0)],
        [None, None],
        [],
    ],
    ids=["beyond-int64", "mixed", "int-and-bool", "np.str_", "np.float64", "none", "empty"],
)
def test_other_items_are_served_as_they_are(items: list) -> None:
    src = from_sequence(items)
    assert all(src[i] is item for i, item in enumerate(items))


def test_fingerprint_tells_kinds_and_boundaries_apart_and_equal_items_alike() -> None:
    kinds = [["1"], [b"1"], [1], [1.0], [True], [np.int64(1)]]
    prints = {from_sequence(items).fingerprint for items in kinds}
    assert len(prints) == len(kinds)
    assert from_sequence(["ab", "c"]).fingerprint != from_sequence(["a", "bc"]).fingerprint
    assert from_sequence(["a", ""]).fingerprint != from_sequence(["", "a"]).fingerprint
    assert from_sequence([0.0]).fingerprint != from_sequence([-0.0]).fingerprint
    assert from_sequence(["a", "b"]).fingerprint == from_sequence(("a", "b")).fingerprint
    assert from_sequence([b"a"] * 3).fingerprint == from_sequence([b"a"] * 3).fingerprint


@pytest.mark.parametrize("items", [PLAIN["str"] * 20, PLAIN["int"] * 20, PLAIN["bool"] * 20])
def test_process_workers_yield_the_items_in_batches_and_alone(items: list) -> None:
    with gl.Loader(gl.Dataset(from_sequence(items)), workers=2) as loader:
        got = list(loader)
    assert all(identical(a, b) for a, b in zip(got, items, strict=True))
    with gl.Loader(gl.Dataset(from_sequence(items)).batch(8), workers=2) as loader:
        assert same(list(loader), list(gl.Dataset(items).batch(8)))


_PRIVATE_MEMORY = """
import json, os, sys
import globalloader as gl
from globalloader.sources import from_sequence


def children():
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(pid) for pid in f.read().split()}


def private_bytes(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            fields = dict(line.split(":", 1) for line in rollup if ":" in line)
        total += sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))
    return total


items = [f"/data/imagenet/train/n{i % 1000:08d}/{i:08d}.JPEG" for i in range(250_000)]
private = {}
for name, source in (("flat", from_sequence(items)), ("list", items)):
    before = children()
    with gl.Loader(gl.Dataset(source).batch(500), workers=2, start_method="fork") as loader:
        assert sum(len(b) for b in loader) == len(items)
        private[name] = private_bytes(children() - before)
print(json.dumps(private))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux's /proc/PID/smaps_rollup")
def test_forked_workers_reading_a_list_of_strings_do_not_copy_it() -> None:
    """Reading an item of a list writes its refcount, so a worker copies the page it lies on; the
    flat buffers are only read. The list here is ~25 MB of str objects: the workers reading it
    through from_sequence hold far less private memory than through the bare list (the measure
    is the pages the workers copied, not a time). In a new interpreter, so that what the test
    process holds (which its forked workers inherit) does not count."""
    run = subprocess.run([sys.executable, "-c", _PRIVATE_MEMORY], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    private = json.loads(run.stdout)
    assert private["flat"] < private["list"] / 2, private
