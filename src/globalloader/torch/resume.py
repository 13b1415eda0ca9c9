"""The DataLoader's state dict: what a pass records, how a state is checked, how a pass resumes.

torch's DataLoader draws, per pass, a base seed from the loader's `generator` (or torch's global
RNG) when it starts workers (every pass, or only the first with `persistent_workers`), then its
sampler's order; each worker seeds `torch` and `random` with base seed + worker id and `numpy`
from both, and the dataset draws from those as it loads. A state records what is needed to give
a resumed pass the very same values, and nothing that can be recomputed:

- `rng`: the states of the loader's and samplers' generators and of this process's global RNGs
  (torch's, random's, numpy's) at the start of the pass (the sampler's order and the base seed
  are drawn again from them);
- `base_seed` and `fresh_workers`: the seed the pass's workers were started with, and whether
  the pass drew it (False: persistent workers past their first pass, which keep their seed);
- `workers`: per worker, the state of its `torch`/`random`/`numpy` RNGs where its part of the
  pass resumes (None: as freshly seeded) - for a map-style dataset the state after its last
  delivered batch, for an iterable one at the start of the pass (its batches are replayed);
- `process_rng`: this process's global RNG states when `state_dict()` was called;
- `batches`: batches of the pass taken (a batch whose loading raised counts: it is not retried);
- `built`: how the DataLoader was built, so a state is never loaded into a different one.

Everything is ints, strs, bools, None and lists (JSON-able); a state is checked for form, range
and origin before it is used, and refused with a `StateError` saying what is wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from globalloader.errors import StateError
from globalloader.torch.rng import (
    decode_process_rng,
    encode_process_rng,
    process_rng,
    set_generator_state,
    set_process_rng,
    torch_state,
    torch_state_tensor,
)
from globalloader.torch.tensors import torch

if TYPE_CHECKING:
    from globalloader.torch.settings import LoaderSettings

STATE_KIND = "globalloader.torch.DataLoader"
STATE_VERSION = 2
_SEED_RANGE = (-(1 << 63), 1 << 64)  # torch's Generator takes any 64-bit seed
# Every field `make_state` writes: a state without one is refused, never half read.
_FIELDS = ("built", "epoch", "batches", "rng", "base_seed", "fresh_workers", "workers", "process_rng")


class Resume(NamedTuple):
    """How an iterator starts its pass: fresh (the defaults), or resuming a state."""

    skip: int = 0  # batches of the pass already taken
    base_seed: int | None = None  # the pass's base seed (fresh_workers: what drawing must give again)
    fresh_workers: bool = True  # False: the workers keep `base_seed`, none is drawn
    workers: list[Any] | None = None  # per worker: RNG states (`process_rng`) to start from (None: as seeded)

    def check_drawn(self, seed: int) -> None:
        """Refuse a state whose RNG states do not draw the base seed it recorded."""
        if self.base_seed is not None and seed != self.base_seed:
            raise StateError(
                f"load_state_dict: the state's RNG states draw base seed {seed}, but it recorded "
                f"{self.base_seed}: the state is damaged or was made by a DataLoader with another generator"
            )


class Progress:
    """Where one pass stands, kept by the DataLoader (not the iterator, which may be dropped)."""

    __slots__ = ("base_seed", "batches", "done", "fresh_workers", "snapshot", "workers")

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot  # RNG states the pass started from (`rng_snapshot`)
        self.batches = 0  # taken so far (delivered, or raised)
        self.done = False  # the pass has ended
        self.base_seed: int | None = None
        self.fresh_workers = True
        # per worker, its RNG states where its part of the pass stands: None (as seeded), a
        # `process_rng` dict (a resumed state) or what the worker sent (`RngReporter.changed`)
        self.workers: list[Any] | None = None


def past_the_end(skip: int, taken: int) -> StateError:
    """A state whose position is beyond the pass being resumed: it was taken from another dataset."""
    return StateError(
        f"load_state_dict: the state's position batches={skip} is past the end of this pass "
        f"({taken} batches): the dataset is not the one the state was taken from"
    )


def _sampler_generators(loader: LoaderSettings) -> list[tuple[str | None, Any]]:
    """Per sampler object (batch sampler first, each once): (kind, generator); kind "own", "loader"
    (the loader's generator), "shared" (an earlier sampler's) or None (no torch Generator)."""
    samplers: list[Any] = []
    for obj in (loader.batch_sampler, loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if obj is not None and all(obj is not s for s in samplers):
            samplers.append(obj)
    seen: list[Any] = []
    found: list[tuple[str | None, Any]] = []
    for sampler in samplers:
        generator = getattr(sampler, "generator", None)
        if not isinstance(generator, torch.Generator):
            found.append((None, None))
        elif generator is loader.generator:
            found.append(("loader", generator))
        elif any(generator is g for g in seen):
            found.append(("shared", generator))
        else:
            found.append(("own", generator))
            seen.append(generator)
    return found


def rng_snapshot(loader: LoaderSettings) -> dict[str, Any]:
    """The RNG states a pass starts from: this process's global ones, the loader's and the samplers' generators."""
    return {
        # torch's global RNG (base seed, RandomSampler), random's and numpy's (a sampler may draw from them)
        "process": process_rng(),
        "loader": None if loader.generator is None else torch_state(loader.generator.get_state()),
        "samplers": [torch_state(g.get_state()) if kind == "own" else None for kind, g in _sampler_generators(loader)],
    }


def restore_rng(loader: LoaderSettings, snapshot: dict[str, Any]) -> None:
    """Put back the states of `rng_snapshot` (checked by `check_state` beforehand)."""
    set_process_rng(snapshot["process"], "rng.process")
    if loader.generator is not None:
        set_generator_state(loader.generator, snapshot["loader"], "rng.loader")
    generators = _sampler_generators(loader)
    for i, ((kind, generator), state) in enumerate(zip(generators, snapshot["samplers"], strict=True)):
        if kind == "own":
            set_generator_state(generator, state, f"rng.samplers[{i}]")


def built(loader: LoaderSettings) -> dict[str, Any]:
    """What decides a pass's order and seeds, as a state records it."""
    return {
        "iterable": loader._dataset_kind_iterable,
        "dataset_length": _length(loader.dataset),
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type(loader.sampler).__name__,
        "batch_sampler": None if loader.batch_sampler is None else type(loader.batch_sampler).__name__,
        "batches_per_pass": None if loader._dataset_kind_iterable else _length(loader._index_sampler),
        "generator": loader.generator is not None,
        "sampler_generators": [kind for kind, _ in _sampler_generators(loader)],
        "num_workers": loader.num_workers,
        "persistent_workers": loader.persistent_workers,
    }


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:  # no len(): an iterable dataset or an endless sampler
        return None


def make_state(loader: LoaderSettings, progress: Progress, epoch: int | None, process: Any) -> dict[str, Any]:
    """The state dict of a pass (`process`: this process's RNG states now, None before any pass)."""
    return {
        "kind": STATE_KIND,
        "version": STATE_VERSION,
        "built": built(loader),
        "epoch": epoch,
        "batches": progress.batches,
        "rng": progress.snapshot,
        "base_seed": progress.base_seed,
        "fresh_workers": progress.fresh_workers,
        # per worker: None, already encoded (a loaded state's), or as the worker sent it
        "workers": None
        if progress.workers is None
        else [encode_process_rng(w) if isinstance(w, tuple) else w for w in progress.workers],
        "process_rng": process,
    }


def check_state(loader: LoaderSettings, state: Any) -> Resume:
    """How to resume `state` in `loader`, or a StateError saying why it cannot be."""
    if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
        raise StateError(f"load_state_dict: not a {STATE_KIND} state dict (got {type(state).__name__})")
    if "shared" in state:
        raise StateError("load_state_dict: this state comes from a DataLoader with share=; build it the same way")
    if state.get("version") != STATE_VERSION:
        raise StateError(
            f"load_state_dict: state version {state.get('version')!r}, this globalloader reads version "
            f"{STATE_VERSION}: the state was made by another version; start the pass over"
        )
    missing = [k for k in _FIELDS if k not in state]
    if missing:
        raise StateError(f"load_state_dict: the state has no field {missing[0]!r}: it is damaged or was edited")
    theirs, ours = state.get("built"), built(loader)
    if not isinstance(theirs, dict):
        raise StateError("load_state_dict: the state does not say how its DataLoader was built ('built' missing)")
    differs = [f"{k}={theirs.get(k)!r} in the state, {v!r} here" for k, v in ours.items() if theirs.get(k) != v]
    if differs:
        raise StateError(
            "load_state_dict: the state was taken from a DataLoader built differently: "
            + "; ".join(differs)
            + ". Build the DataLoader as the one that saved it"
        )
    batches = state.get("batches")
    if not isinstance(batches, int) or isinstance(batches, bool):
        raise StateError(f"load_state_dict: batches should be an int, got {batches!r}")
    limit = ours["batches_per_pass"]
    if batches < 0 or (limit is not None and batches > limit):
        bound = "0 or more" if limit is None else f"between 0 and {limit} (the batches of a pass)"
        raise StateError(f"load_state_dict: the state's position batches={batches} is out of range: {bound}")
    epoch = state.get("epoch")
    if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0):
        raise StateError(f"load_state_dict: epoch should be None or an int >= 0, got {epoch!r}")
    _check_snapshot(state.get("rng"), ours["generator"], ours["sampler_generators"])
    fresh = state.get("fresh_workers")
    if not isinstance(fresh, bool):
        raise StateError(f"load_state_dict: fresh_workers should be a bool, got {fresh!r}")
    seed = state.get("base_seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not _SEED_RANGE[0] <= seed < _SEED_RANGE[1]
    ):
        raise StateError(f"load_state_dict: base_seed should be None or a 64-bit int, got {seed!r}")
    if not fresh and (seed is None or not loader.persistent_workers):
        raise StateError("load_state_dict: fresh_workers=False is only for persistent workers with a base_seed")
    workers = state.get("workers")
    if workers is not None:
        if not isinstance(workers, list) or len(workers) != loader.num_workers:
            raise StateError(
                f"load_state_dict: workers should be None or a list of {loader.num_workers} RNG states "
                f"(one per worker), got {workers!r:.80}"
            )
        for w, rng in enumerate(workers):
            if rng is not None:
                decode_process_rng(rng, f"workers[{w}]")
    process = state.get("process_rng")
    if process is not None:
        decode_process_rng(process, "process_rng")
    return Resume(skip=batches, base_seed=seed, fresh_workers=fresh, workers=workers)


def _check_snapshot(snapshot: Any, has_generator: bool, kinds: list[str | None]) -> None:
    samplers = len(kinds)
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("samplers"), list):
        raise StateError(f"load_state_dict: rng should be the RNG states of a pass start, got {snapshot!r:.80}")
    if len(snapshot["samplers"]) != samplers:
        raise StateError(
            f"load_state_dict: rng.samplers has {len(snapshot['samplers'])} entries, this DataLoader {samplers}"
        )
    decode_process_rng(snapshot.get("process"), "rng.process")
    if (snapshot.get("loader") is None) is has_generator:
        raise StateError("load_state_dict: rng.loader should be the generator's state exactly when there is one")
    if snapshot.get("loader") is not None:
        torch_state_tensor(snapshot["loader"], "rng.loader")
    for i, (kind, state) in enumerate(zip(kinds, snapshot["samplers"], strict=True)):
        if (state is not None) != (kind == "own"):
            raise StateError(
                f"load_state_dict: rng.samplers[{i}] should be a state exactly when that sampler has its own generator"
            )
        if state is not None:
            torch_state_tensor(state, f"rng.samplers[{i}]")
