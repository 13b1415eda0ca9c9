"""Content fingerprints of chains: equal fingerprints mean equal outputs (the sharing/cache key).

A function's fingerprint covers its qualified name, bytecode, constants, defaults and closure
values, so editing a transform changes the key. Callable objects are fingerprinted by class and
attributes. Values that cannot be fingerprinted fall back to their `repr`, which is stable for
the usual configuration values (numbers, strings, tuples, arrays).
"""

from __future__ import annotations

import hashlib
import types
from typing import Any

import numpy as np


def digest(*parts: Any) -> str:
    """A short stable hex digest of `parts` (strings, numbers, or nested tuples/lists of them)."""
    h = hashlib.sha1()
    for part in parts:
        h.update(_describe(part).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def fn_fingerprint(fn: Any) -> str:
    """A digest that changes when the function's code or captured values change."""
    return digest(_describe(fn))


def _describe(value: Any, depth: int = 0) -> str:
    if depth > 4:
        return type(value).__qualname__
    if isinstance(value, (str, int, float, bool, bytes, type(None))):
        return repr(value)
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape}{value.dtype}:{hashlib.sha1(value.tobytes()).hexdigest()}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_describe(v, depth + 1) for v in value) + ")"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: repr(kv[0]))
        return "{" + ",".join(f"{k!r}:{_describe(v, depth + 1)}" for k, v in items) + "}"
    if isinstance(value, types.FunctionType):
        code = value.__code__
        closure = tuple(c.cell_contents for c in value.__closure__ or ())
        return "fn:" + "|".join(
            (
                f"{value.__module__}.{value.__qualname__}",
                code.co_code.hex(),
                _describe(tuple(c for c in code.co_consts if not isinstance(c, types.CodeType))),
                _describe(value.__defaults__, depth + 1),
                _describe(closure, depth + 1),
            )
        )
    if isinstance(value, (types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, types.MethodType):
        return "method:" + _describe(value.__func__, depth + 1) + _describe(value.__self__, depth + 1)
    if hasattr(value, "fingerprint") and isinstance(value.fingerprint, str):
        return f"{type(value).__qualname__}:{value.fingerprint}"
    if hasattr(value, "__dict__"):
        cls = type(value)
        return f"obj:{cls.__module__}.{cls.__qualname__}" + _describe(vars(value), depth + 1)
    return repr(value)
