"""The identity of a chain (sharing key, disk cache folder, state_dict check): every case that
decides an output changes it, equal things agree, and what cannot be established is refused."""

from __future__ import annotations

import datetime
import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader.dataset.fingerprint import fingerprint
from globalloader.errors import ArgumentError, FingerprintError, StateError
from globalloader.sources.sequence import SequenceSource
from helpers import check_resume

SIZE = 4
SCALE = 2
FACTOR = 10
LOCK = threading.Lock()


def source(n: int = 6) -> SequenceSource:
    return gl.from_sequence(list(range(n)))


def shared_key(fn) -> str:
    """What the server groups jobs by: the fingerprint of the chain up to the last shared map."""
    plan = gl.Dataset(source()).shuffle(0).map(fn, shared=True).batch(2).plan
    return gl.Dataset(plan.source, tuple(plan.maps[: plan.split])).plan.fingerprint


def full(record):
    return np.full(SIZE, record)


def times_factor(x):
    return x * FACTOR


def calls_helper(record):
    return times_factor(record)


def comprehension(record):
    return [v * SCALE for v in range(record)]


# -- what decides the output changes the key; equal things agree ------------------------------
def test_partial_function_and_arguments_decide_the_key():
    assert fingerprint(functools.partial(np.full, 3)) != fingerprint(functools.partial(np.zeros))
    assert fingerprint(functools.partial(np.full, 3)) != fingerprint(functools.partial(np.full, 4))
    assert fingerprint(functools.partial(np.full, 3, 1)) != fingerprint(functools.partial(np.full, 3, fill_value=1))
    assert fingerprint(functools.partial(np.full, 3)) == fingerprint(functools.partial(np.full, 3))
    assert shared_key(functools.partial(np.full, 3)) != shared_key(functools.partial(np.zeros))


def test_module_level_globals_the_code_reads_decide_the_key(monkeypatch):
    before = shared_key(full)
    monkeypatch.setitem(globals(), "SIZE", 8)
    assert shared_key(full) != before
    monkeypatch.setitem(globals(), "SIZE", 4)
    assert shared_key(full) == before


def test_globals_read_by_called_functions_and_nested_code_count(monkeypatch):
    helper_before, nested_before = fingerprint(calls_helper), fingerprint(comprehension)
    monkeypatch.setitem(globals(), "FACTOR", 11)
    assert fingerprint(calls_helper) != helper_before, "a global read by a function it calls"
    monkeypatch.setitem(globals(), "SCALE", 3)
    assert fingerprint(comprehension) != nested_before, "a global read inside a comprehension"
    assert fingerprint(full) == fingerprint(full), "unrelated globals leave the key alone"


def test_closures_defaults_and_keyword_defaults_decide_the_key():
    def closure(k):
        return lambda x: x + k

    def default(k):
        def fn(x, k=k):
            return x + k

        return fn

    def keyword_default(k):
        def fn(x, *, k=k):
            return x + k

        return fn

    for make in (closure, default, keyword_default):
        assert fingerprint(make(3)) != fingerprint(make(4)), make.__name__
        assert fingerprint(make(3)) == fingerprint(make(3)), make.__name__


def test_the_same_function_agrees_and_different_code_differs():
    assert fingerprint(full) == fingerprint(full)
    assert fingerprint(lambda r: r + 1) == fingerprint(lambda r: r + 1)
    assert fingerprint(lambda r: r + 1) != fingerprint(lambda r: r + 2)
    assert fingerprint(lambda r: r in {"a", "b"}) != fingerprint(lambda r: r in {"a", "c"})


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k

    def apply(self, x):
        return x * self.k


class Slotted:
    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


class WithState:
    def __init__(self, k):
        self.k, self._scratch = k, []

    def __getstate__(self):
        return {"k": self.k}

    def __call__(self, x):
        return x * self.k


def test_callable_objects_and_bound_methods_count_their_state():
    for cls in (Scale, Slotted, WithState):
        assert fingerprint(cls(2)) != fingerprint(cls(3)), cls.__name__
        assert fingerprint(cls(2)) == fingerprint(cls(2)), cls.__name__
    assert fingerprint(Scale(2).apply) != fingerprint(Scale(3).apply)
    assert fingerprint(Scale(2).apply) == fingerprint(Scale(2).apply)
    assert fingerprint(Scale(2).apply) != fingerprint(Scale(2)), "apply and __call__ are different code"


def test_a_user_class_counts_its_methods_code(monkeypatch):
    before = fingerprint(Scale(2))
    monkeypatch.setattr(Scale, "__call__", lambda self, x: x + self.k)
    assert fingerprint(Scale(2)) != before


def test_builtins_and_library_functions_are_named_by_module_and_name():
    named = [np.zeros, np.ones, np.full, np.sqrt, np.exp, len, abs, str.upper, str.lower, gl.Dataset, gl.Loader]
    keys = [fingerprint(x) for x in named]
    assert len(set(keys)) == len(named)
    assert keys == [fingerprint(x) for x in named]
    assert fingerprint(datetime.timedelta(1)) != fingerprint(datetime.timedelta(2)), "a library object's state"


def test_arrays_and_numpy_scalars_count_dtype_shape_and_bytes():
    a = np.arange(12, dtype=np.int32)
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(a.reshape(3, 4)), "shape"
    assert fingerprint(np.zeros(4, np.int32)) != fingerprint(np.zeros(2, np.int64)), "same bytes, other dtype"
    assert fingerprint(a) != fingerprint(a + 1), "bytes"
    assert fingerprint(a[::2]) == fingerprint(a[::2].copy()), "a strided view counts as its values"
    assert fingerprint(np.float32(1)) != fingerprint(np.float64(1))
    assert fingerprint(np.array(["a", None], dtype=object)) != fingerprint(np.array(["b", None], dtype=object))


def test_containers_order_and_cycles():
    assert fingerprint({"a": 1, "b": [1, 2.0]}) == fingerprint({"a": 1, "b": [1, 2.0]})
    assert fingerprint({"a": 1, "b": [1, 2.0]}) != fingerprint({"a": 1, "b": [1, 2]}), "2 and 2.0 differ"
    assert fingerprint([1, True]) != fingerprint([1, 1])
    assert fingerprint({"x", "y", "z"}) == fingerprint({"z", "y", "x"})
    loop: list = [1]
    loop.append(loop)
    other: list = [2]
    other.append(other)
    assert fingerprint(loop) == fingerprint(loop) != fingerprint(other), "cycles are walked once"


def test_an_lru_cached_function_is_keyed_by_what_it_wraps():
    def cached(k):
        return functools.lru_cache(maxsize=None)(lambda x: x + k)

    assert fingerprint(cached(1)) != fingerprint(cached(2))
    assert fingerprint(cached(1)) == fingerprint(cached(1))


def load_module(tmp_path: Path, monkeypatch, name: str, text: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_attributes_read_from_a_user_module_count(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_module(tmp_path, monkeypatch, "fp_config", "SIZE = 4\nOTHER = 1\n")
    transforms = load_module(
        tmp_path,
        monkeypatch,
        "fp_transforms",
        """
        import fp_config

        def decode(record):
            return [record] * fp_config.SIZE
    """,
    )
    before = fingerprint(transforms.decode)
    monkeypatch.setattr(config, "OTHER", 2)
    assert fingerprint(transforms.decode) == before, "an attribute the code does not read"
    monkeypatch.setattr(config, "SIZE", 8)
    assert fingerprint(transforms.decode) != before


def test_sources_count_by_their_fingerprint_or_content():
    assert gl.Dataset(source(6)).plan.fingerprint == gl.Dataset(source(6)).plan.fingerprint
    assert (
        gl.Dataset(gl.from_sequence([0, 1])).plan.fingerprint != gl.Dataset(gl.from_sequence([0, 2])).plan.fingerprint
    )
    assert gl.Dataset([0, 1, 2]).plan.fingerprint != gl.Dataset([0, 1, 3]).plan.fingerprint, "same type and length"


KEYS_MODULE = """
    import functools
    import numpy as np

    SIZE = 4
    TAGS = {"alpha", "beta", "gamma", "delta", "epsilon"}
    TABLE = {"b": np.arange(3), "a": [1, 2.5, "x", None]}

    def helper(x):
        return x * SIZE

    def decode(record):
        return {"x": helper(np.full(3, record)), "tags": sorted(TAGS), "table": TABLE}

    class Resize:
        def __init__(self, size):
            self.size = size

        def __call__(self, record):
            return np.full(self.size, record)

    VALUES = {
        "decode": decode,
        "partial": functools.partial(np.full, 3),
        "object": Resize(8),
        "method": Resize(8).__call__,
        "lambda": lambda record: record in {"a", "b", "c", "d"},
        "set": TAGS,
    }
"""


def test_keys_are_stable_across_processes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = load_module(tmp_path, monkeypatch, "fp_keys", KEYS_MODULE)
    here = {name: fingerprint(value) for name, value in module.VALUES.items()}
    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import fp_keys; "
        "from globalloader.dataset.fingerprint import fingerprint; "
        "print(json.dumps({k: fingerprint(v) for k, v in fp_keys.VALUES.items()}))"
    )
    for seed in ("1", "2"):  # set iteration order differs with the hash seed
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, check=True
        ).stdout
        assert json.loads(out) == here
    assert len(set(here.values())) == len(here)


# -- what cannot be established is refused, by name, with the way out ---------------------------
def _generator():
    yield 1


DEEP: list = []
for _ in range(200):
    DEEP = [DEEP]

OPAQUE = {  # case: (the value a map captures, what the error must call it)
    "lock": (lambda: LOCK, "_thread.lock"),
    "generator": (_generator, "generator"),
    "file": (lambda: open(os.devnull), "TextIOWrapper"),  # noqa: SIM115 - the test closes it
    "memory-address repr": (zlib.compressobj, "zlib.Compress"),
    "reference chain too deep": (lambda: DEEP, "too deep"),
}


@pytest.mark.parametrize("case", list(OPAQUE))
def test_values_whose_state_cannot_be_seen_are_refused_with_a_named_error(case):
    make, named = OPAQUE[case]
    value = make()

    def decode(record):
        return value, record

    with pytest.raises(FingerprintError) as err:
        shared_key(decode)
    if hasattr(value, "close"):
        value.close()
    message = str(err.value)
    assert "map 'decode'" in message and named in message
    assert "closure variable 'value'" in message
    assert 'key="decode-v1"' in message


def test_an_explicit_key_or_a_fingerprint_attribute_stands_for_the_walk():
    def guarded(record):
        return LOCK, record

    keyed = gl.Dataset(source()).map(guarded, shared=True, key="decode-v2").plan.fingerprint
    assert keyed == gl.Dataset(source()).map(lambda r: r, shared=True, key="decode-v2").plan.fingerprint
    assert keyed != gl.Dataset(source()).map(guarded, shared=True, key="decode-v3").plan.fingerprint

    class Guarded:
        def __init__(self, version):
            self.lock, self.fingerprint = threading.Lock(), version

        def __call__(self, record):
            return record

    assert shared_key(Guarded("v1")) == shared_key(Guarded("v1")) != shared_key(Guarded("v2"))
    with pytest.raises(ArgumentError, match="key must be a non-empty string"):
        gl.Dataset(source()).map(guarded, key="")


def test_a_plain_loader_with_an_unfingerprintable_map_runs_and_resumes():
    def chain():
        return gl.Dataset(source(40)).shuffle(1).map(lambda r: (LOCK.locked(), r)).batch(4)

    for workers, mode in ((0, "thread"), (2, "thread"), (2, "process")):
        check_resume(lambda workers=workers, mode=mode: gl.Loader(chain(), workers=workers, mode=mode), at=3)
    check_resume(lambda: chain().iterator(), at=5)


def test_share_true_refuses_an_unfingerprintable_map_in_the_training_process(tmp_path):
    socket = tmp_path / "never.sock"
    chain = gl.Dataset(source()).map(lambda r: (LOCK, r), shared=True, name="decode").batch(2)
    with (
        gl.Loader(chain, share=True, server=str(socket)) as loader,
        pytest.raises(FingerprintError, match=r"map 'decode'.*_thread\.lock.*key="),
    ):
        iter(loader)
    assert not socket.exists(), "no server may be started for a job that cannot be keyed"


def test_a_disk_cache_refuses_an_unfingerprintable_map_unless_keyed(tmp_path):
    ds = gl.Dataset(source()).map(lambda r: {"v": r, "locked": LOCK.locked()}, name="decode")
    with pytest.raises(FingerprintError, match=r"cache\(.*map 'decode'.*_thread\.lock.*cache\(path, key="):
        ds.cache(tmp_path)
    assert [r["v"] for r in ds.cache(tmp_path, key="decode-v1")] == list(range(6))
    assert [r["v"] for r in ds.cache()] == list(range(6)), "an in-memory cache needs no key"
    with pytest.raises(ArgumentError, match="path"):
        ds.cache(key="decode-v1")


# -- the same identity keys the disk cache and the state_dict check ---------------------------
class CountedSource:
    """Sequence records that count reads (a cache hit reads nothing); keyed by its content."""

    def __init__(self, n: int) -> None:
        self.inner = source(n)
        self.fingerprint = self.inner.fingerprint
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict:
        self.reads += 1
        return self.inner[index]


def scaled(record):
    return {"x": record * SCALE}


def test_the_disk_cache_is_not_stale_after_a_global_changes(tmp_path, monkeypatch):
    def run():
        src = CountedSource(4)
        return [r["x"] for r in gl.Dataset(src).map(scaled).cache(tmp_path)], src.reads

    assert run() == ([0, 2, 4, 6], 4)
    assert run() == ([0, 2, 4, 6], 0), "the same chain reads its cache"
    monkeypatch.setitem(globals(), "SCALE", 3)
    assert run() == ([0, 3, 6, 9], 4), "a changed global must not read stale entries"
    monkeypatch.setitem(globals(), "SCALE", 2)
    assert run() == ([0, 2, 4, 6], 0)


def test_a_state_dict_of_another_chain_is_refused(monkeypatch):
    def chain(fn):
        return gl.Dataset(source(20)).shuffle(0).map(fn).batch(4)

    def state_of(ds):
        with gl.Loader(ds) as loader:
            it = iter(loader)
            next(it)
            return loader.state_dict()

    state = state_of(chain(functools.partial(np.full, 3)))
    with gl.Loader(chain(functools.partial(np.full, 3))) as same:
        same.load_state_dict(state)
    with gl.Loader(chain(functools.partial(np.zeros))) as other, pytest.raises(StateError, match="different chain"):
        other.load_state_dict(state)

    state = state_of(chain(full))
    monkeypatch.setitem(globals(), "SIZE", 8)
    with gl.Loader(chain(full)) as other, pytest.raises(StateError, match="different chain"):
        other.load_state_dict(state)
    iterator = chain(full).iterator()
    with pytest.raises(StateError, match="different chain"):
        iterator.load_state_dict(state)


def test_a_map_that_fills_a_memo_as_it_runs_resumes_into_a_chain_built_fresh():
    memo: dict = {}

    def memoized(record):
        return memo.setdefault(record, record * 2)

    def chain():
        return gl.Dataset(source(40)).shuffle(2).map(memoized)

    fresh = chain()  # built before any sample ran, as a new process resuming would build it
    it = chain().iterator()
    [next(it) for _ in range(7)]
    state = it.state_dict()  # the memo now holds 7 entries: the key was taken when the chain was built
    rest = list(it)
    resumed = fresh.iterator()
    resumed.load_state_dict(state)
    assert list(resumed) == rest


def test_torch_tensors_count_by_dtype_shape_and_values():
    torch = pytest.importorskip("torch")
    a = torch.arange(6.0)
    assert fingerprint(a) == fingerprint(torch.arange(6.0)), "pickled tensors carry storage ids; keys must not"
    assert fingerprint(a) != fingerprint(a + 1)
    assert fingerprint(a) != fingerprint(a.reshape(2, 3))
    assert fingerprint(a) != fingerprint(a.double())
    torch.manual_seed(0)
    first = torch.nn.Linear(3, 2)
    torch.manual_seed(0)
    assert fingerprint(first) == fingerprint(torch.nn.Linear(3, 2)) != fingerprint(torch.nn.Linear(3, 2))
