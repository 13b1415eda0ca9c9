"""globalloader.torch.DataLoader resumes a pass exactly: the samples of an uninterrupted run, and
the values the dataset draws from `torch`, `random` and `numpy` while loading them.

The reference is torch's own DataLoader, run without interruption over four passes; the drop-in,
built the same way, must give exactly its samples and drawn values. States are taken from the
drop-in at the first, middle and last batch of passes 1 to 3, sent through JSON, and loaded into
a new DataLoader built the same way (after the global RNGs were moved elsewhere); what that one
delivers, to the end of pass 4, must be the reference's rest, sample by sample.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch

import globalloader.torch as gt
from globalloader.errors import StateError

PASSES = 4
CHECKPOINT_PASSES = (0, 1, 2)  # the 1st, 2nd and 3rd pass
SAMPLES, BATCH = 13, 3  # 5 batches a pass, the last one short


class Drawing(torch.utils.data.Dataset):
    """Each sample: its index and one value from each RNG a data augmentation draws from."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())], dtype=torch.float64
        )


def build(cls: Any, workers: int, persistent: bool, shuffle: bool, seeded: bool) -> Any:
    """A loader over Drawing; `seeded`: with its own generator, else from torch's global RNG (the
    global RNGs are seeded either way: with num_workers=0 the dataset draws from them)."""
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    generator = torch.Generator().manual_seed(77) if seeded else None
    return cls(
        Drawing(),
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=workers,
        persistent_workers=persistent,
        generator=generator,
    )


def rows(batch: torch.Tensor) -> list[tuple[float, ...]]:
    return [tuple(row.tolist()) for row in batch]


def run_with_states(loader: gt.DataLoader) -> tuple[list[tuple[float, ...]], dict[tuple[int, int], tuple[int, Any]]]:
    """The samples of PASSES passes, and states taken at batch 0, the middle and the end of the
    checkpoint passes, each with how many samples had been delivered when it was taken."""
    samples: list[tuple[float, ...]] = []
    states: dict[tuple[int, int], tuple[int, Any]] = {}
    for p in range(PASSES):
        it = iter(loader)
        if p in CHECKPOINT_PASSES:  # before the first batch
            states[p, 0] = (len(samples), json.loads(json.dumps(loader.state_dict())))
        for k, batch in enumerate(it, 1):
            samples += rows(batch)
            if p in CHECKPOINT_PASSES and k == 2:
                states[p, k] = (len(samples), json.loads(json.dumps(loader.state_dict())))
        if p in CHECKPOINT_PASSES:
            states[p, -1] = (len(samples), json.loads(json.dumps(loader.state_dict())))  # after the last batch
    return samples, states


def run(loader: Any, passes: int) -> list[tuple[float, ...]]:
    return [row for _ in range(passes) for batch in loader for row in rows(batch)]


CONFIGS = [(0, False), (1, False), (1, True), (2, False), (2, True)]


@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
@pytest.mark.parametrize(("workers", "persistent"), CONFIGS, ids=[f"w{w}{'-persistent' * p}" for w, p in CONFIGS])
def test_resume_in_any_pass_gives_the_uninterrupted_samples_and_random_values(workers, persistent, shuffle, seeded):
    reference_loader = build(torch.utils.data.DataLoader, workers, persistent, shuffle, seeded)
    reference = run(reference_loader, PASSES)
    del reference_loader
    assert len(reference) == PASSES * SAMPLES

    loader = build(gt.DataLoader, workers, persistent, shuffle, seeded)
    samples, states = run_with_states(loader)
    loader.close()
    assert samples == reference, "the drop-in differs from torch's DataLoader for the same seed"
    drawn = np.array(reference)[:, 1:]
    assert len(np.unique(drawn, axis=0)) == len(drawn), "no two samples drew the same values"

    for (p, k), (delivered, state) in states.items():
        resumed = build(gt.DataLoader, workers, persistent, shuffle, seeded)
        torch.manual_seed(99)  # the resumed job's RNGs stand elsewhere: the state must restore them
        random.seed(99)
        np.random.seed(99)
        resumed.load_state_dict(state)
        rest = run(resumed, PASSES - p)
        resumed.close()
        expected = reference[delivered:]
        assert [r[0] for r in rest] == [r[0] for r in expected], f"pass {p + 1}, batch {k}: other samples"
        assert rest == expected, f"pass {p + 1}, batch {k}: same samples, other in-worker random values"


class Sparse(torch.utils.data.Dataset):
    """Draws from a different RNG on different samples, nothing on some; numpy's gaussians come in
    pairs (the second is cached, no new words drawn): the RNG states a worker reports after a task
    change in every way and not at all."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        gauss = float(np.random.randn()) if i % 2 == 0 else 0.0
        uniform = torch.rand(()).item() if i % 3 == 0 else 0.0
        python = random.random() if i % 5 == 0 else 0.0
        return torch.tensor([float(i), gauss, uniform, python], dtype=torch.float64)


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_after_any_batch_restores_rngs_that_moved_partly_or_not_at_all(workers):
    def make(cls: Any) -> Any:
        generator = torch.Generator().manual_seed(5)
        return cls(
            Sparse(), batch_size=1, shuffle=True, num_workers=workers, persistent_workers=True, generator=generator
        )

    reference_loader = make(torch.utils.data.DataLoader)
    reference = run(reference_loader, 2)
    del reference_loader
    loader = make(gt.DataLoader)
    states, samples = [], []
    for p in range(2):
        it = iter(loader)
        states.append((p, len(samples), json.loads(json.dumps(loader.state_dict()))))
        for batch in it:
            samples += rows(batch)
            states.append((p, len(samples), json.loads(json.dumps(loader.state_dict()))))
    loader.close()
    assert samples == reference
    for p, delivered, state in states:
        resumed = make(gt.DataLoader)
        resumed.load_state_dict(state)
        rest = run(resumed, 2 - p)
        resumed.close()
        assert rest == reference[delivered:], f"pass {p + 1}, resumed after {delivered} samples"


def reseed_numpy(worker_id: int) -> None:
    """The classic worker_init_fn: numpy reseeded from torch's worker seed (and a draw of its own)."""
    np.random.seed((torch.initial_seed() + worker_id) % 2**32)
    torch.rand(())


@pytest.mark.parametrize("persistent", [True, False])
def test_what_worker_init_fn_draws_or_seeds_is_part_of_the_resumed_state(persistent):
    def make(cls: Any) -> Any:
        generator = torch.Generator().manual_seed(8)
        return cls(
            Drawing(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=persistent,
            generator=generator, worker_init_fn=reseed_numpy,
        )  # fmt: skip

    reference_loader = make(torch.utils.data.DataLoader)
    reference = run(reference_loader, PASSES)
    del reference_loader
    loader = make(gt.DataLoader)
    samples, states = run_with_states(loader)
    loader.close()
    assert samples == reference
    for (p, k), (delivered, state) in states.items():
        resumed = make(gt.DataLoader)
        resumed.load_state_dict(state)
        rest = run(resumed, PASSES - p)
        resumed.close()
        assert rest == reference[delivered:], f"pass {p + 1}, batch {k}"


class GlobalRngSampler(torch.utils.data.Sampler):
    """A user's sampler drawing its order from numpy's and random's global RNGs, not torch's."""

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self):
        order = np.random.permutation(SAMPLES).tolist()
        random.shuffle(order)
        return iter(order)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_drawing_from_numpy_or_random_resumes_its_order(workers):
    def make(cls: Any) -> Any:
        torch.manual_seed(4)
        random.seed(4)
        np.random.seed(4)
        return cls(Drawing(), batch_size=BATCH, sampler=GlobalRngSampler(), num_workers=workers)

    reference_loader = make(torch.utils.data.DataLoader)
    reference = run(reference_loader, PASSES)
    del reference_loader
    loader = make(gt.DataLoader)
    samples, states = run_with_states(loader)
    assert samples == reference
    for (p, k), (delivered, state) in states.items():
        resumed = make(gt.DataLoader)
        random.seed(99)  # elsewhere: the state must restore them
        np.random.seed(99)
        resumed.load_state_dict(state)
        assert run(resumed, PASSES - p) == reference[delivered:], f"pass {p + 1}, batch {k}"


def test_a_persistent_loader_resumes_a_state_loaded_into_itself():
    """Its workers run on from another pass: they are replaced by workers started from the state."""

    def make(cls: Any) -> Any:
        return build(cls, 2, True, True, True)

    reference_loader = make(torch.utils.data.DataLoader)
    reference = run(reference_loader, 3)
    del reference_loader
    loader = make(gt.DataLoader)
    first = run(loader, 1)
    it = iter(loader)
    head = [row for _ in range(2) for row in rows(next(it))]
    state = json.loads(json.dumps(loader.state_dict()))
    assert first + head + [row for batch in it for row in rows(batch)] + run(loader, 1) == reference
    loader.load_state_dict(state)  # back to the middle of pass 2, in the same loader
    rest = run(loader, 2)
    loader.close()
    assert rest == reference[len(first) + len(head) :]


class DrawingStream(torch.utils.data.IterableDataset):
    """An iterable dataset sharded by worker, drawing from the three RNGs for each item."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, SAMPLES, step):
            yield torch.tensor(
                [float(i), torch.rand(()).item(), random.random(), float(np.random.rand())], dtype=torch.float64
            )


@pytest.mark.parametrize("persistent", [True, False])
def test_an_iterable_dataset_resumes_with_its_random_values_too(persistent):
    def make(cls: Any) -> Any:
        torch.manual_seed(3)
        return cls(DrawingStream(), batch_size=BATCH, num_workers=2, persistent_workers=persistent)

    reference_loader = make(torch.utils.data.DataLoader)
    reference = run(reference_loader, PASSES)
    del reference_loader
    loader = make(gt.DataLoader)
    samples, states = run_with_states(loader)
    loader.close()
    assert samples == reference
    for (p, k), (delivered, state) in states.items():
        resumed = make(gt.DataLoader)
        resumed.load_state_dict(state)
        rest = run(resumed, PASSES - p)
        resumed.close()
        assert rest == reference[delivered:], f"pass {p + 1}, batch {k}"


def test_a_state_is_small_plain_data():
    loader = gt.DataLoader(Drawing(), batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    text = json.dumps(state)
    assert json.loads(text) == state
    # the RNG states themselves (three per worker and in this process, one per generator) and a few ints
    assert len(text) < 64_000, len(text)
    loader.close()


# -- refused states -----------------------------------------------------------------------------


def state_after(loader: gt.DataLoader, batches: int) -> dict[str, Any]:
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"dataset": torch.utils.data.TensorDataset(torch.arange(20))}, "dataset_length=13 in the state, 20 here"),
        ({"batch_size": 4}, "batch_size=3 in the state, 4 here"),
        ({"drop_last": True}, "drop_last=False in the state, True here"),
        ({"shuffle": False}, "sampler='RandomSampler' in the state, 'SequentialSampler' here"),
        ({"num_workers": 1}, "num_workers=0 in the state, 1 here"),
        ({"generator": None}, "generator=True in the state, False here"),
    ],
)
def test_a_state_of_a_differently_built_loader_is_refused_naming_what_differs(other, named):
    args = {"dataset": Drawing(), "batch_size": BATCH, "shuffle": True, "generator": torch.Generator().manual_seed(1)}
    state = state_after(gt.DataLoader(**args), 2)
    different = gt.DataLoader(**{**args, **other})
    with pytest.raises(StateError, match="built differently: .*" + named.replace("(", r"\(")):
        different.load_state_dict(state)


def test_a_state_out_of_range_or_malformed_is_refused():
    def make() -> gt.DataLoader:
        return gt.DataLoader(Drawing(), batch_size=BATCH, shuffle=True, num_workers=2)

    state = state_after(make(), 2)
    process = state["rng"]["process"]
    cases = [
        ({"batches": 6}, r"batches=6 is out of range: between 0 and 5"),
        ({"batches": -1}, r"batches=-1 is out of range"),
        ({"batches": "2"}, r"batches should be an int"),
        ({"batches": True}, r"batches should be an int"),
        ({"epoch": -3}, r"epoch should be None or an int >= 0"),
        ({"base_seed": 1 << 70}, r"base_seed should be None or a 64-bit int"),
        ({"workers": [None]}, r"workers should be None or a list of 2 RNG states"),
        ({"workers": [None, {"torch": "AAAA"}]}, r"workers\[1\] is not a process RNG state"),
        ({"rng": {**state["rng"], "process": {**process, "torch": "!!"}}}, r"rng.process.torch is not valid base64"),
        ({"rng": {**state["rng"], "process": {**process, "torch": "AAAA"}}}, r"rng.process.torch is not a torch CPU"),
        ({"rng": {**state["rng"], "loader": "AAAA"}}, r"rng.loader should be the generator's state exactly when"),
        ({"process_rng": {**state["process_rng"], "random": [3, "AAAA", None]}}, r"process_rng.random is not"),
        ({"version": 1}, r"state version 1"),
        ({"built": None}, r"'built' missing"),
        ({"fresh_workers": False}, r"fresh_workers=False is only for persistent workers"),
    ]
    for change, message in cases:
        with pytest.raises(StateError, match=message):
            make().load_state_dict({**state, **change})
    for name in ("epoch", "process_rng", "workers", "base_seed"):  # a missing field, not a raw KeyError
        with pytest.raises(StateError, match=f"the state has no field '{name}'"):
            make().load_state_dict({k: v for k, v in state.items() if k != name})
    loader = make()
    loader.load_state_dict({**state, "base_seed": 5})  # well-formed, but not what its RNG states draw
    with pytest.raises(StateError, match=r"draw base seed \d+, but it recorded 5"):
        iter(loader)
    make().load_state_dict(state)  # the untouched state is accepted


def test_a_pass_out_of_order_cannot_be_checkpointed_mid_pass():
    loader = gt.DataLoader(Drawing(), batch_size=BATCH, num_workers=2, in_order=False)
    it = iter(loader)
    assert loader.state_dict()["batches"] == 0
    next(it)
    with pytest.raises(StateError, match="in_order=False"):
        loader.state_dict()
    list(it)
    assert loader.state_dict()["batches"] == 5  # a finished pass has a position again


def test_a_batch_that_raised_counts_as_taken():
    class Failing(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> int:
            if i == 2:
                raise KeyError("sample 2 is broken")
            return i

    for workers in (0, 2):
        loader = gt.DataLoader(Failing(), batch_size=2, num_workers=workers)
        it = iter(loader)
        assert next(it).tolist() == [0, 1]
        with pytest.raises(KeyError, match="sample 2 is broken"):
            next(it)
        state = loader.state_dict()
        assert state["batches"] == 2
        resumed = gt.DataLoader(Failing(), batch_size=2, num_workers=workers)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == [[4, 5]], workers
