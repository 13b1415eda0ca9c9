"""The tree codec: a batch or sample as a small picklable tree plus arrays placed at offsets.

Both transports use it: batch segments (`transport.segments`) and the server's arena
(`transport.arena`). `encode_tree` walks a nested structure once, giving each array a 64-byte
aligned offset; `copy_arrays` writes them into any buffer; `decode_tree` rebuilds the structure
with arrays as zero-copy views of a buffer.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from globalloader._extras import require
from globalloader.dataset.collate import Stacked

ALIGN = 64  # cache-line alignment of every array, in a batch segment and in the server's arena


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


# The encoded tree uses builtins only (a pickled class costs ~1 us each way, a tuple ~50 ns).
# Every node is a tuple whose first item says what it is, so user tuples cannot be mistaken
# for nodes: they only ever appear wrapped in a leaf.
_LEAF = 0  # (_LEAF, obj): kept inline, pickled with the message
_ARRAY = 1  # (_ARRAY, offset, dtype, shape): a NumPy array in the segment
_TENSOR = 2  # (_TENSOR, offset, dtype, shape): a torch tensor in the segment
_NODE = 3  # (_NODE, kind, keys, items): a container holding arrays


def encode_tree(obj: Any) -> tuple[tuple, list[tuple[int, np.ndarray]], int]:
    """(encoded tree, arrays with their offsets, bytes needed) for a batch or a sample."""
    placed: list[tuple[int, np.ndarray]] = []  # (offset, array) in walk order
    tree = _encode(obj, placed)
    return tree, placed, _end(placed)


def copy_arrays(buffer: Any, base: int, placed: list[tuple[int, np.ndarray]]) -> None:
    """Copy the arrays of `encode_tree` into `buffer` at `base` + their offsets."""
    for offset, array in placed:
        target = np.ndarray(array.shape, array.dtype, buffer=buffer, offset=base + offset)
        if type(array) is Stacked:
            array.stack_into(target)
        else:
            np.copyto(target, array)


_DTYPES: dict[Any, np.dtype] = {}


def decode_tree(node: tuple, base: np.ndarray) -> Any:
    """Rebuild what `encode_tree` encoded, arrays as views of `base` (a uint8 array)."""
    tag = node[0]
    if tag == _LEAF:
        return node[1]
    if tag == _NODE:
        _, kind, keys, items = node
        values = [decode_tree(item, base) for item in items]
        if kind == 0:
            return dict(zip(keys, values, strict=True))
        if kind == 1:
            return values
        if kind == 2:
            return tuple(values)
        return kind(*values)  # a named tuple class
    _, offset, dtype, shape = node
    descr = _DTYPES.get(dtype)
    if descr is None:
        descr = _DTYPES[dtype] = np.dtype(dtype)
    view = np.ndarray(shape, descr, buffer=base, offset=offset)
    if tag == _TENSOR:
        return require("torch", "torch").from_numpy(view)
    return view


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})  # leaves, checked first


def _as_array(obj: Any) -> tuple[int, np.ndarray] | None:
    """(_ARRAY or _TENSOR, the array to copy) for `obj`, or None to keep it inline."""
    kind = type(obj)
    if kind is np.ndarray or kind is np.memmap or kind is Stacked:
        tag, array = _ARRAY, obj
    else:
        torch = sys.modules.get("torch")  # a tensor implies torch is imported already
        if torch is None or not isinstance(obj, torch.Tensor):
            return None
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad:
            return None
        try:
            array = obj.resolve_conj().resolve_neg().numpy()
        except (TypeError, RuntimeError):
            return None  # no NumPy dtype (bfloat16...): pickled instead
        tag = _TENSOR
    if array.dtype.hasobject or array.nbytes == 0:
        return None  # objects cannot live in shared memory; empty arrays pickle in a few bytes
    return tag, array


def _end(placed: list[tuple[int, np.ndarray]]) -> int:
    """Bytes used by the arrays placed so far."""
    if not placed:
        return 0
    offset, array = placed[-1]
    return offset + array.nbytes


def _encode(obj: Any, placed: list[tuple[int, np.ndarray]]) -> tuple:
    """`obj` as an encoded tree; appends each array with its 64-byte aligned offset to `placed`."""
    kind = type(obj)
    if kind in _SCALARS:
        return (_LEAF, obj)
    shipped = _as_array(obj) if kind is not dict and kind is not list else None
    if shipped is not None:
        tag, array = shipped
        offset = -(-_end(placed) // ALIGN) * ALIGN  # `aligned`, inline: once per array of every batch
        placed.append((offset, array))
        dtype = array.dtype
        # A dtype string is short and fast to pickle; records and the like need the full dtype.
        descr = dtype.str if dtype.names is None else dtype
        return (tag, offset, descr, array.shape)
    if kind is dict:
        code: Any = 0
        items = obj.values()
    elif kind is list:
        code, items = 1, obj
    elif kind is tuple:
        code, items = 2, obj
    elif isinstance(obj, tuple) and hasattr(kind, "_fields"):
        code, items = kind, obj  # a named tuple: rebuilt by calling its class
    else:
        return (_LEAF, obj)
    for item in items:
        if type(item) not in _SCALARS:
            break
    else:
        return (_LEAF, obj)  # keys, labels...: no need to walk item by item
    count = len(placed)
    nodes = [_encode(item, placed) for item in items]
    if len(placed) == count:
        return (_LEAF, obj)  # no arrays inside: one pickled leaf, not rebuilt by the reader
    return (_NODE, code, tuple(obj) if kind is dict else None, nodes)
