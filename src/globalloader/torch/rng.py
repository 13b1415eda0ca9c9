"""The random number generator states a DataLoader resume restores (which ones: `torch.resume`),
as plain strings, ints and lists (so a state can go into any checkpoint, JSON included) and back,
refusing a malformed one with a `StateError` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import random
from typing import Any, cast

import numpy as np

try:
    from numpy.random.mtrand import get_bit_generator
except ImportError:  # numpy < 1.25 cannot hand out its global bit generator: full states every task
    get_bit_generator = None  # type: ignore[assignment]

from globalloader.errors import StateError
from globalloader.torch.tensors import torch

_RANDOM_VERSION = 3  # random.getstate()'s format: (3, 625 words, gauss_next)
_MT_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, field: str) -> bytes:
    if not isinstance(text, str):
        raise StateError(f"load_state_dict: {field} should be a base64 str, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise StateError(f"load_state_dict: {field} is not valid base64 ({exc})") from exc


def torch_state(state: Any) -> str:
    """A torch RNG state (the ByteTensor of `get_rng_state`/`Generator.get_state`) as a str."""
    return _b64(state.numpy().tobytes())


def torch_state_tensor(text: Any, field: str) -> Any:
    """The ByteTensor `torch_state` was made from (checked to be a CPU generator's state)."""
    data = _unb64(text, field)
    if len(data) != torch.get_rng_state().numel():
        raise StateError(f"load_state_dict: {field} is not a torch CPU RNG state ({len(data)} bytes)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def set_generator_state(generator: Any, text: Any, field: str) -> None:
    """Put a `torch_state` back into `generator` (None: torch's global RNG)."""
    state = torch_state_tensor(text, field)
    try:
        if generator is None:
            torch.set_rng_state(state)
        else:
            generator.set_state(state)
    except RuntimeError as exc:  # a state of the wrong size or kind
        raise StateError(f"load_state_dict: {field} is not a torch CPU RNG state ({exc})") from exc


def process_rng() -> dict[str, Any]:
    """The states of this process's global `torch`, `random` and `numpy` RNGs."""
    return encode_process_rng(
        (torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state(legacy=True))
    )


def encode_process_rng(raw: tuple[bytes, Any, Any]) -> dict[str, Any]:
    """The JSON-able form of what `RngReporter.changed` (or a capture) returned."""
    torch_bytes, (version, words, gauss), (_, key, pos, has_gauss, cached) = raw
    return {
        "torch": _b64(torch_bytes),
        "random": [version, _b64(np.asarray(words, dtype=np.uint32).tobytes()), gauss],
        "numpy": [_b64(np.asarray(key, dtype=np.uint32).tobytes()), int(pos), int(has_gauss), float(cached)],
    }


class RngReporter:
    """In a worker: its global RNGs' states after a task, or None when none has moved since the
    last report (a dataset that draws nothing costs a check of ~25 us a task, no states sent).

    The check reads torch's and random's states and numpy's MT19937 words and position in place;
    numpy's cached second gaussian can change without them, so while one is cached the full
    state is taken every time.
    """

    def __init__(self) -> None:
        self._last: tuple[bytes, Any, bytes | None] | None = None
        self._gauss_cached = True

    def changed(self) -> tuple[bytes, Any, Any] | None:
        seen = (torch.get_rng_state().numpy().tobytes(), random.getstate(), _numpy_words())
        if seen[2] is not None and not self._gauss_cached and seen == self._last:
            return None
        numpy_state = cast("tuple[Any, ...]", np.random.get_state(legacy=True))
        self._last, self._gauss_cached = seen, bool(numpy_state[3])
        return seen[0], seen[1], numpy_state


def _numpy_words() -> bytes | None:
    """numpy's global MT19937 state (key words and position) read in place, None if it is another generator."""
    if get_bit_generator is None:
        return None
    generator = get_bit_generator()
    if not isinstance(generator, np.random.MT19937):
        return None
    return ctypes.string_at(generator.ctypes.state_address, _MT_STATE_BYTES)


def set_process_rng(state: Any, field: str) -> None:
    """Put back the states `process_rng` returned (`field` names it in errors)."""
    decoded = decode_process_rng(state, field)
    torch.set_rng_state(decoded[0])
    random.setstate(decoded[1])
    np.random.set_state(decoded[2])


def decode_process_rng(state: Any, field: str) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """(torch ByteTensor, random state, numpy state) of a `process_rng` value, checked."""
    try:
        version, words, gauss = state["random"]
        key, pos, has_gauss, cached = state["numpy"]
        torch_text = state["torch"]
    except (TypeError, KeyError, ValueError) as exc:
        raise StateError(f"load_state_dict: {field} is not a process RNG state ({exc!r})") from exc
    torch_bytes = torch_state_tensor(torch_text, f"{field}.torch")
    random_words = _unb64(words, f"{field}.random")
    numpy_key = _unb64(key, f"{field}.numpy")
    if version != _RANDOM_VERSION or len(random_words) != 625 * 4 or not (gauss is None or isinstance(gauss, float)):
        raise StateError(f"load_state_dict: {field}.random is not a random.getstate() of this Python")
    if len(numpy_key) != 624 * 4 or not isinstance(pos, int) or not 0 <= pos <= 624 or has_gauss not in (0, 1):
        raise StateError(f"load_state_dict: {field}.numpy is not a numpy.random MT19937 state")
    if not isinstance(cached, float):
        raise StateError(f"load_state_dict: {field}.numpy's cached gaussian should be a float, got {cached!r}")
    random_state = (version, tuple(np.frombuffer(random_words, dtype=np.uint32).tolist()), gauss)
    numpy_state = ("MT19937", np.frombuffer(numpy_key, dtype=np.uint32).copy(), pos, has_gauss, cached)
    try:  # what the RNGs themselves check (e.g. random's position word), on throwaway instances
        random.Random().setstate(random_state)
        np.random.RandomState().set_state(numpy_state)
    except (ValueError, TypeError) as exc:
        raise StateError(f"load_state_dict: {field} is not a valid RNG state ({exc})") from exc
    return torch_bytes, random_state, numpy_state
