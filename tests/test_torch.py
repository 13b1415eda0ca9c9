"""globalloader.torch.DataLoader behaves as torch.utils.data.DataLoader does, with real workers.

Most checks run both loaders on the same dataset and compare what comes out (values, types,
order), so "same as torch" is measured, not assumed.
"""

from __future__ import annotations

import collections
import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, WeightedRandomSampler, get_worker_info

import globalloader as gl
import globalloader.torch as gt
from globalloader.errors import ArgumentError, StateError, TransformError
from helpers import Server, check_resume

TorchLoader = torch.utils.data.DataLoader


class Pair(NamedTuple):
    image: Any
    label: Any


class Squares(torch.utils.data.Dataset):
    """A map-style dataset of (image tensor, label) pairs, as users write them."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((3, 4, 4), float(i)), i * i


class Mixed(torch.utils.data.Dataset):
    """Every leaf type default_collate handles: dicts, named tuples, numpy, scalars, strings, bfloat16."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return {
            "pair": Pair(np.full((2, 2), i, dtype=np.float32), i),
            "scalars": (np.int16(i), float(i) / 2, i % 2 == 0),
            "name": f"s{i}",
            "half": torch.full((3,), float(i), dtype=torch.bfloat16),
            "grid": [torch.arange(4) * i, np.uint8(i)],
        }


class Noisy(torch.utils.data.Dataset):
    """Draws from the three global RNGs a training augmentation typically uses."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand()), torch.initial_seed()])


class Strided(torch.utils.data.IterableDataset):
    """An iterable dataset that shards itself by worker, as torch documents."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))

    def __len__(self) -> int:
        return self.n


class WorkerIdentity(torch.utils.data.Dataset):
    """Returns what the worker knows about itself: worker_info fields and what worker_init_fn set."""

    def __init__(self) -> None:
        self.tag = -1

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        info = get_worker_info()
        return torch.tensor([info.id, info.num_workers, info.seed, os.getpid(), info.dataset.tag])


def tag_worker(worker_id: int) -> None:
    get_worker_info().dataset.tag = 100 + worker_id


class Tagged(Squares):
    """A dataset that says what it holds, so share=True may key its samples by it."""

    def __init__(self, tag: str) -> None:
        super().__init__(10)
        self.fingerprint = f"squares-10-{tag}"


class Changing(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.offset = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return i + self.offset


class Failing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        if i == 3:
            raise KeyError(f"sample {i} is broken")
        return i


class Slow(torch.utils.data.Dataset):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        time.sleep(self.seconds)
        return i


class Crashing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        os.kill(os.getpid(), signal.SIGKILL)


def same(a: Any, b: Any) -> bool:
    """Equal values and equal types all the way down (tensors: dtype and shape too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def both(dataset: Any, **kwargs: Any) -> tuple[list, list]:
    """The batches of torch's DataLoader and ours, built with the same arguments."""
    runs = []
    for cls in (TorchLoader, gt.DataLoader):
        args = dict(kwargs)
        if "generator_seed" in args:
            args["generator"] = torch.Generator().manual_seed(args.pop("generator_seed"))
        for name in ("sampler", "batch_sampler"):
            if callable(args.get(name)):  # a factory: each loader gets its own sampler and generator
                args[name] = args[name]()
        runs.append(list(cls(dataset, **args)))
    return runs[0], runs[1]


# -- surface ---------------------------------------------------------------------------------


def test_constructor_has_torchs_signature_then_the_extras():
    theirs = list(inspect.signature(TorchLoader.__init__).parameters.values())
    ours = list(inspect.signature(gt.DataLoader.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]
    assert [p.name for p in ours[len(theirs) :]] == ["share", "server"]
    assert gt.DataLoader[list] is not None  # subscriptable like DataLoader[T]


def test_public_attributes_and_len_match_torch():
    dataset = Squares(10)
    for kwargs in (
        {},
        {"batch_size": 3},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": None},
        {"batch_size": 4, "shuffle": True, "num_workers": 2, "prefetch_factor": 3, "timeout": 5},
    ):
        theirs, ours = TorchLoader(dataset, **kwargs), gt.DataLoader(dataset, **kwargs)
        for name in (
            "batch_size",
            "drop_last",
            "num_workers",
            "prefetch_factor",
            "timeout",
            "pin_memory",
            "pin_memory_device",
            "persistent_workers",
            "worker_init_fn",
            "generator",
            "in_order",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.dataset is dataset and ours.collate_fn is theirs.collate_fn
        assert type(ours.sampler) is type(theirs.sampler) and type(ours.batch_sampler) is type(theirs.batch_sampler)
        assert len(ours) == len(theirs)
    positional = gt.DataLoader(dataset, 4, True)  # batch_size, shuffle: torch's positional order
    assert positional.batch_size == 4 and isinstance(positional.sampler, torch.utils.data.RandomSampler)
    assert len(gt.DataLoader(Strided(10), batch_size=4)) == 3
    assert len(gt.DataLoader(Strided(10), batch_size=4, drop_last=True)) == 2
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        positional.batch_size = 8


def test_len_follows_a_growing_dataset():
    data = [1, 2, 3]
    loader = gt.DataLoader(data, batch_size=2)
    data.append(4)
    data.append(5)
    assert len(loader) == 3 and [b.tolist() for b in loader] == [[1, 2], [3, 4], [5]]


def test_invalid_combinations_raise_value_errors_naming_the_argument():
    dataset = Squares(10)
    cases = [
        ({"num_workers": -1}, "num_workers"),
        ({"timeout": -1}, "timeout"),
        ({"batch_size": None, "drop_last": True}, "drop_last"),
        ({"sampler": [0, 1], "shuffle": True}, "shuffle"),
        ({"batch_sampler": [[0, 1]], "batch_size": 2}, "batch_sampler"),
        ({"multiprocessing_context": "spawn"}, "num_workers > 0"),
        ({"num_workers": 1, "multiprocessing_context": "nope"}, "valid start method"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            gt.DataLoader(dataset, **kwargs)
    with pytest.raises(TypeError, match="multiprocessing_context"):
        gt.DataLoader(dataset, num_workers=1, multiprocessing_context=object())
    with pytest.raises(ValueError, match="IterableDataset: expected unspecified shuffle"):
        gt.DataLoader(Strided(4), shuffle=True)


# -- map-style: samplers, shuffle, generator --------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_equal_torchs_for_every_sampler_form(workers):
    dataset = Squares(23)
    forms = [
        {"batch_size": 4, "shuffle": True, "generator_seed": 7},
        {"batch_size": 5, "drop_last": True},
        {
            "batch_size": 3,
            "sampler": lambda: WeightedRandomSampler([1.0] * 23, 30, generator=torch.Generator().manual_seed(3)),
        },
        {"batch_sampler": lambda: BatchSampler(range(20, 2, -3), 2, False)},
        {"batch_size": None, "sampler": [5, 1, 4]},
    ]
    for form in forms:
        if workers:
            form = dict(form, num_workers=workers)
        theirs, ours = both(dataset, **form)
        assert len(theirs) > 0 and same(ours, theirs), form


def test_global_seed_drives_the_shuffle_as_in_torch():
    orders = []
    for cls in (TorchLoader, gt.DataLoader, gt.DataLoader):
        torch.manual_seed(11)
        orders.append([b[1].tolist() for b in cls(Squares(12), batch_size=4, shuffle=True, num_workers=2)])
    assert orders[0] == orders[1] == orders[2]
    torch.manual_seed(12)
    assert [b[1].tolist() for b in gt.DataLoader(Squares(12), batch_size=4, shuffle=True)] != orders[0]


def test_distributed_sampler_ranks_and_set_epoch():
    dataset = Squares(10)
    seen = {}
    for epoch in (0, 1):
        for rank in (0, 1):
            batches = []
            for cls in (TorchLoader, gt.DataLoader):
                sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=5)
                loader = cls(dataset, batch_size=2, sampler=sampler, num_workers=2)
                if isinstance(loader, gt.DataLoader):
                    loader.set_epoch(epoch)  # passed on to the sampler
                else:
                    sampler.set_epoch(epoch)
                batches.append([b[1].tolist() for b in loader])
            assert batches[0] == batches[1]
            seen[epoch, rank] = [i for batch in batches[1] for i in batch]
    squares = {i * i for i in range(10)}
    assert set(seen[0, 0]) | set(seen[0, 1]) == squares and not set(seen[0, 0]) & set(seen[0, 1])
    assert seen[0, 0] != seen[1, 0]


# -- collate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_gives_torchs_types(workers):
    for kwargs in ({"batch_size": 4}, {"batch_size": None}):
        theirs, ours = both(Mixed(), num_workers=workers, **kwargs)
        assert same(ours, theirs), kwargs
    assert isinstance(ours[0]["pair"], Pair)
    assert ours[0]["half"].dtype == torch.bfloat16


class Kinds(torch.utils.data.Dataset):
    """Samples in dict subclasses, one of which (defaultdict) cannot be rebuilt from its items."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return {
            "ordered": collections.OrderedDict(x=np.full(2, i, np.float32)),
            "counts": collections.defaultdict(int, n=np.int64(i)),
        }


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_keeps_dict_subclasses_as_torch_does(workers):
    theirs, ours = both(Kinds(), batch_size=3, num_workers=workers)
    assert same(ours, theirs)
    for mine, torchs in zip(ours, theirs, strict=True):
        assert [type(v) for v in mine.values()] == [type(v) for v in torchs.values()]
        assert mine["counts"]["missing"] == 0  # still a defaultdict


def test_to_tensors_converts_numeric_arrays_and_keeps_container_types():
    batch = collections.OrderedDict(
        image=np.ones((2, 3), np.uint8), pair=Pair(np.zeros(2), "a"), names=np.array(["a", "b"]), rows=(np.arange(2),)
    )
    out = gt.to_tensors(batch)
    assert type(out) is collections.OrderedDict and list(out) == list(batch)
    assert isinstance(out["image"], torch.Tensor) and np.shares_memory(out["image"].numpy(), batch["image"])
    assert type(out["pair"]) is Pair and isinstance(out["pair"][0], torch.Tensor) and out["pair"][1] == "a"
    assert out["names"] is batch["names"]  # strings cannot be a tensor
    assert type(out["rows"]) is tuple and isinstance(out["rows"][0], torch.Tensor)


def test_custom_collate_output_is_returned_as_built():
    def keep(samples):
        return {"arrays": np.stack([s[0].numpy() for s in samples]), "labels": [s[1] for s in samples]}

    theirs, ours = both(Squares(6), batch_size=3, num_workers=2, collate_fn=keep)
    assert same(ours, theirs) and isinstance(ours[0]["arrays"], np.ndarray)


# -- iterable datasets, workers, seeds ---------------------------------------------------------


def test_iterable_dataset_sharded_by_worker_info():
    for kwargs in ({"batch_size": 3}, {"batch_size": 3, "drop_last": True}, {"batch_size": None}):
        theirs, ours = both(Strided(20), num_workers=2, **kwargs)
        assert same(ours, theirs), kwargs
    flat = [int(x) for b in gt.DataLoader(Strided(20), batch_size=3, num_workers=3) for x in b]
    assert sorted(flat) == list(range(20))


def test_worker_info_and_worker_init_fn():
    loader = gt.DataLoader(
        WorkerIdentity(),
        batch_size=2,
        num_workers=2,
        worker_init_fn=tag_worker,
        generator=torch.Generator().manual_seed(3),
    )
    it = iter(loader)
    rows = torch.cat(list(it)).tolist()
    pids = [w.pid for w in it._workers]
    base = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(3)).item()
    for i, (worker, count, seed, pid, tag) in enumerate(rows):
        assert worker == (i // 2) % 2 and count == 2 and seed == base + worker
        assert pid == pids[worker] and tag == 100 + worker
    assert get_worker_info() is None and loader.dataset.tag == -1


def test_workers_are_seeded_as_torch_seeds_them():
    theirs, ours = both(Noisy(), batch_size=1, num_workers=4, generator_seed=9)
    assert same(ours, theirs)
    values = torch.cat(ours)
    for column in range(3):  # torch, random, numpy: no two workers repeat each other
        assert len(set(values[:, column].tolist())) == 8


@pytest.mark.slow
def test_spawn_context_and_prefetch_factor():
    theirs, ours = both(Squares(9), batch_size=2, num_workers=2, multiprocessing_context="spawn", prefetch_factor=3)
    assert same(ours, theirs)


# -- iterator semantics -----------------------------------------------------------------------


def test_every_iter_starts_a_new_pass():
    loader = gt.DataLoader(list(range(10)), batch_size=2, num_workers=2)
    assert next(iter(loader)).tolist() == [0, 1]
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # the peek above took nothing
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert len(list(loader)) == 5  # breaking out of a loop does not resume mid-pass
    a, b = iter(loader), iter(loader)
    assert [x.tolist() for x in a] == [x.tolist() for x in b] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_in_order_false_delivers_every_batch_once():
    batches = [b.tolist() for b in gt.DataLoader(Slow(0.0), batch_size=1, num_workers=2, in_order=False)]
    assert sorted(batches) == [[0], [1]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_sample_fails_its_batch_and_the_pass_goes_on(workers):
    it = iter(gt.DataLoader(Failing(), batch_size=2, num_workers=workers))
    assert next(it).tolist() == [0, 1]
    with pytest.raises(KeyError, match="sample 3 is broken"):
        next(it)
    assert next(it).tolist() == [4, 5]
    with pytest.raises(StopIteration):
        next(it)


class Unsendable(torch.utils.data.Dataset):
    """Sample 3 holds a lock; every sample a tensor large enough to travel in shared memory."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return {"x": torch.full((256, 256), i), "lock": threading.Lock() if i == 3 else None}


def as_list(samples: list) -> list:
    return samples


def test_a_batch_that_cannot_be_pickled_is_named_and_the_pass_goes_on():
    it = iter(gt.DataLoader(Unsendable(), batch_size=2, num_workers=2, collate_fn=as_list))
    assert [int(s["x"][0, 0]) for s in next(it)] == [0, 1]
    with pytest.raises(
        TransformError,
        match=r"the batch of Unsendable \(index \[2, 3\]\) \(its samples or collate_fn's output\) cannot be sent "
        r"from worker 1 to the loop: TypeError: cannot pickle '_thread.lock'",
    ):
        next(it)
    assert [int(s["x"][0, 0]) for s in next(it)] == [4, 5]
    with pytest.raises(StopIteration):
        next(it)


def test_persistent_workers_keep_their_dataset_copy_others_do_not():
    dataset = Changing()
    for persistent, expected in ((True, [0, 1, 2, 3]), (False, [10, 11, 12, 13])):
        dataset.offset = 0
        loader = gt.DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=persistent)
        first = iter(loader)
        assert [x for b in first for x in b.tolist()] == [0, 1, 2, 3]
        pids = [w.pid for w in first._workers]
        dataset.offset = 10
        second = iter(loader)
        assert [x for b in second for x in b.tolist()] == expected
        assert ([w.pid for w in second._workers] == pids) is persistent
        loader.close()


def test_timeout_zero_waits_and_a_positive_timeout_raises():
    assert [b.tolist() for b in gt.DataLoader(Slow(1.5), batch_size=1, num_workers=2)] == [[0], [1]]
    with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
        next(iter(gt.DataLoader(Slow(2), batch_size=1, num_workers=1, timeout=1)))


def test_pin_memory_is_accepted_and_pins_only_with_an_accelerator():
    batch = next(iter(gt.DataLoader(Squares(4), batch_size=2, num_workers=1, pin_memory=True)))
    assert batch[0].is_pinned() == gt.tensors.accelerator_available()


def test_a_killed_worker_is_reported_with_its_pid_and_signal():
    it = iter(gt.DataLoader(Crashing(), batch_size=2, num_workers=1))
    pid = it._workers[0].pid
    with pytest.raises(RuntimeError, match=rf"worker \(pid {pid}\) is killed by signal: Killed"):
        next(it)


def run_script(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_workers_forked_after_torch_ran_threads_do_not_deadlock():
    done = run_script(
        """
        import torch
        from globalloader.torch import DataLoader

        class Conv(torch.utils.data.Dataset):
            x = torch.ones(1, 1, 24000)
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return torch.nn.functional.conv1d(self.x, torch.ones(1, 1, 2)).sum()

        torch.set_num_threads(2)
        Conv()[0]  # the main process runs torch's thread pool before the workers fork
        print([b.tolist() for b in DataLoader(Conv(), batch_size=2, num_workers=2, timeout=20)])
    """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[[47998.0, 47998.0], [47998.0, 47998.0]]"


def test_a_failed_iterator_is_freed_at_once_and_never_finalized_in_a_forked_worker():
    """An iterator whose pass raised used to stay alive in a reference cycle through its error's
    traceback; a worker forked later inherited it, and the worker's garbage collector finalized
    it there: 'Exception ignored ... can only join a child process' on the job's stderr (and its
    shared memory unlinked from the wrong process)."""
    done = run_script(
        """
        import gc, os, time
        import torch
        from globalloader.torch import DataLoader

        class Failing(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                if i == 1:
                    raise KeyError("broken")
                return i

        class Collecting(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                gc.collect()  # a worker's garbage collector runs at some point; here, at once
                return i

        def alive(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().split()[2] not in "ZX"
            except FileNotFoundError:  # ended and reaped
                return False

        gc.disable()  # garbage stays uncollected in this process, as between two collections
        it = iter(DataLoader(Failing(), batch_size=1, num_workers=1, multiprocessing_context="fork"))
        pid = it._workers[0].pid
        next(it)
        try:
            next(it)
        except KeyError:
            pass
        del it  # nothing else holds the failed iterator: its worker stops now
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("failed iterator's worker alive:", alive(pid))

        it = iter(DataLoader(Failing(), batch_size=1, num_workers=1, multiprocessing_context="fork"))
        next(it)
        try:
            next(it)
        except KeyError as exc:
            cycle = [exc, it]
            cycle.append(cycle)  # the user's own reference cycle keeps it until a collection
        del it, cycle
        loader = DataLoader(Collecting(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        print([b.tolist() for b in loader])
    """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["failed iterator's worker alive: False", "[[0, 1], [2, 3]]"]
    assert done.stderr == ""  # the workers' stderr too: they inherit the script's


@pytest.mark.slow
def test_no_worker_outlives_its_parent():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import time, torch
        from globalloader.torch import DataLoader

        class Stuck(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                time.sleep(600)

        it = iter(DataLoader(Stuck(), num_workers=2))
        print(*[w.pid for w in it._workers], flush=True)
        next(it)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"workers {alive} outlived their parent"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


# -- globalloader extras -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_resumes_a_pass_exactly(workers):
    check_resume(
        lambda: gt.DataLoader(
            Squares(30), batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(1)
        ),
        3,
    )


def test_state_dict_of_an_iterable_dataset_resumes_too():
    check_resume(lambda: gt.DataLoader(Strided(20), batch_size=3, num_workers=2), 2)


def test_state_dict_refuses_a_foreign_state():
    with pytest.raises(StateError, match=r"not a globalloader.torch.DataLoader state"):
        gt.DataLoader(Squares(4)).load_state_dict({"epoch": 0})


def test_torch_source_fingerprint_is_the_datasets_own_or_none():
    assert gt.TorchSource(Tagged("a")).fingerprint != gt.TorchSource(Tagged("b")).fingerprint
    with pytest.raises(AttributeError, match="no `fingerprint` attribute"):
        _ = gt.TorchSource(Squares(10)).fingerprint
    with pytest.raises(ArgumentError, match="no `fingerprint` attribute"):
        gt.DataLoader(Squares(10), batch_size=2, share=True)
    with pytest.raises(ArgumentError, match="worker_init_fn="):
        gt.DataLoader(Tagged("a"), batch_size=2, share=True, num_workers=1, worker_init_fn=tag_worker)


@pytest.mark.slow
def test_share_true_feeds_the_job_from_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the server imports this module's dataset
    server = Server(tmp_path / "s.sock")
    try:
        loader = gt.DataLoader(
            Tagged("a"), batch_size=4, shuffle=True, num_workers=1, share=True, server=str(server.socket)
        )
        labels = [int(y) for x, y in loader for y in y]
        assert sorted(labels) == [i * i for i in range(10)] and len(loader) == 3
        loader.close()
    finally:
        server.stop()


def test_iterable_dataset_and_collate_give_tensors():
    ds = gl.Dataset(gl.from_sequence([{"x": np.ones(2) * i, "y": i} for i in range(6)])).batch(3)
    with gl.Loader(ds, workers=1) as loader:
        batches = list(gt.IterableDataset(loader))
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].shape == (3, 2) for b in batches)
    assert torch.equal(batches[1]["y"], torch.tensor([3, 4, 5]))
    out = gt.collate([{"x": np.zeros(2), "name": "a"}, {"x": np.ones(2), "name": "b"}])
    assert torch.equal(out["x"], torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert out["name"] == ["a", "b"]


def test_nothing_left_in_shared_memory():
    list(gt.DataLoader(Squares(8), batch_size=2, num_workers=2))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"gl-{os.getpid()}-t")]
