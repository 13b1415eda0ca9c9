"""The identity of what decides a chain's output: the key for sharing, the disk cache and resume checks.

Equal keys must mean equal outputs, so the walk covers everything a function's result can depend
on: its bytecode and constants (nested code included), closure cells, defaults, the module-level
globals its code reads and, recursively, what the functions and classes it reaches read;
`functools.partial` arguments; bound methods' instances; callable objects' class and state (what
pickling would save: `__reduce_ex__`, `__getstate__`, `__dict__`, `__slots__`); NumPy arrays by
dtype, shape and bytes; sources and callables by their `fingerprint` string when they have one.
Code from installed packages, the standard library and globalloader is named by module, name and
package version instead of walked; a user module read as a global counts by the attributes the
code reads from it.

A value whose output-deciding state cannot be seen (a lock, a file, a generator, an object that
refuses to pickle, references nested too deep) is never keyed by its `repr`, which may hold a
memory address: a strict walk raises FingerprintError naming it and how to give an explicit key;
a lenient walk (resume checks only) records just its type. Keys are stable across processes.
"""

from __future__ import annotations

import copyreg
import dis
import functools
import hashlib
import importlib.metadata
import sys
import types
from typing import Any

import numpy as np

from globalloader.errors import FingerprintError
from globalloader.sources.base import declared_fingerprint

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_MAX_DEPTH = 100  # nested references followed before giving up (a reference chain too deep)
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# A class counts by its methods and plain attributes; other dunder entries are bookkeeping (some,
# like __slotnames__, added lazily by pickle), and so is abc's registry.
_CLASS_SKIP = frozenset({"_abc_impl"})
_METHOD_TYPES = (types.FunctionType, staticmethod, classmethod, property)
_DESCRIPTORS = (
    types.WrapperDescriptorType,
    types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
)
# What a code object is besides its bytecode and constants (co_consts is walked on its own).
_CODE_ATTRS = (
    "co_name",
    "co_argcount",
    "co_posonlyargcount",
    "co_kwonlyargcount",
    "co_flags",
    "co_names",
    "co_varnames",
    "co_freevars",
    "co_cellvars",
)
_REDUCE_PARTS = ("constructor", "arguments", "state", "items", "entries", "state setter")
KEY_LENGTH = 32  # hex digits of SHA-256 kept: 128 bits


def fingerprint(value: Any, what: str = "a value", fix: str = "", strict: bool = True) -> str:
    """The key of everything `value`'s behaviour depends on.

    Strict: raises FingerprintError("{what}: ... {fix}") when part of it cannot be established.
    Lenient (`strict=False`): such parts count by their type only, so the key never fails but
    cannot tell two such values apart.
    """
    walk = _Walk(strict)
    try:
        walk.child(_name(value), value)
    except _Opaque as exc:
        raise FingerprintError(
            f"{what}: cannot establish what decides its output: {exc.path} is {exc.reason}. {fix}".rstrip()
        ) from None
    except RecursionError:
        if strict:
            raise FingerprintError(f"{what}: its references nest too deep to be followed. {fix}".rstrip()) from None
        return digest("opaque", _qualified(type(value)))
    return walk.hash.hexdigest()[:KEY_LENGTH]


def digest(*parts: Any) -> str:
    """The strict key of `parts` (strings, numbers, arrays, nested containers of them...)."""
    return fingerprint(parts)


class _Opaque(Exception):
    """Internal: the value at `path` has state that cannot be seen."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path, self.reason = path, reason


class _Walk:
    """One depth-first walk feeding a SHA-256. A memo numbers every object that can be shared or
    be part of a cycle, so a second visit writes a back-reference (like pickle's memo); immutable
    values are always written out, since whether two equal ones are one object varies by process."""

    def __init__(self, strict: bool, path: list[str] | None = None) -> None:
        self.strict = strict
        self.hash = hashlib.sha256()
        self.memo: dict[int, int] = {}
        self.alive: list[Any] = []  # keeps everything walked alive, so an id is never reused mid-walk
        self.path: list[str] = list(path or [])

    def put(self, tag: str, payload: str | bytes = b"") -> None:
        data = payload.encode("utf-8", "surrogatepass") if isinstance(payload, str) else payload
        self.hash.update(b"%s\x00%d\x00" % (tag.encode(), len(data)))
        self.hash.update(data)

    def child(self, label: str, value: Any) -> None:
        self.path.append(label)
        try:
            if len(self.path) > _MAX_DEPTH:
                self.opaque(value, f"nested more than {_MAX_DEPTH} references deep (a reference chain too deep)")
            else:
                self.value(value)
        finally:
            self.path.pop()

    def opaque(self, value: Any, reason: str) -> None:
        if not self.strict:
            self.put("opaque", _qualified(type(value)))
            return
        path = self.path if len(self.path) <= 8 else [*self.path[:3], "...", *self.path[-3:]]
        raise _Opaque(" -> ".join(path), f"a {_qualified(type(value))}: {reason}")

    # -- dispatch ----------------------------------------------------------------------------
    def value(self, v: Any) -> None:
        t = type(v)
        if t in _ATOMS:
            self.put(t.__name__, v if t in (str, bytes) else repr(v))
        elif t is np.ndarray:  # subclasses (masked arrays) carry more state: walked as objects
            self.array(v)
        elif isinstance(v, np.generic):
            self.put("numpy scalar", _dtype(v.dtype))
            self.put("bytes", v.tobytes())
        elif _is_tensor(v):
            self.tensor(v)
        elif t is tuple:
            self.sequence("tuple", v)
        elif t is frozenset:
            self.unordered("frozenset", v)
        elif t is types.CodeType:
            self.code(v)
        elif id(v) in self.memo:
            self.put("ref", str(self.memo[id(v)]))
        else:
            self.memo[id(v)] = len(self.memo)
            self.alive.append(v)
            self.referenced(v, t)

    def referenced(self, v: Any, t: type) -> None:
        """Values that can be shared or be part of a cycle (walked once, then referenced)."""
        if t is list:
            self.sequence("list", v)
        elif t is dict:
            self.mapping(v)
        elif t is set:
            self.unordered("set", v)
        elif isinstance(v, types.ModuleType):
            self.put("module", _module_identity(v))
        elif isinstance(v, type):
            self.cls(v)
        elif self.named(v, t):
            pass
        elif t is types.FunctionType:
            self.function(v)
        elif t is types.MethodType:
            self.put("method")
            self.child("function", v.__func__)
            self.child("bound to", v.__self__)
        elif isinstance(v, functools.partial):
            self.put("partial", _qualified(t))
            self.child("partial function", v.func)
            self.child("partial arguments", v.args)
            self.child("partial keywords", v.keywords)
            if vars(v):
                self.child("partial attributes", vars(v))
        elif isinstance(v, (types.BuiltinFunctionType, types.MethodWrapperType)):
            owner = v.__self__
            if owner is None or isinstance(owner, types.ModuleType):
                module = getattr(v, "__module__", None) or getattr(owner, "__name__", "builtins")
                self.put("builtin", f"{module}.{v.__qualname__}@{_version(module)}")
            else:
                self.put("bound builtin", v.__name__)
                self.child("bound to", owner)
        elif isinstance(v, _DESCRIPTORS):
            self.put("descriptor", f"{_qualified(v.__objclass__)}.{v.__name__}")
        elif isinstance(v, (staticmethod, classmethod)):
            self.put(t.__name__)
            self.child("function", v.__func__)
        elif isinstance(v, property):
            self.put("property")
            for part in ("fget", "fset", "fdel"):
                self.child(part, getattr(v, part))
        elif t is types.CellType:
            try:
                contents = v.cell_contents
            except ValueError:
                self.put("empty cell")
            else:
                self.child("cell", contents)
        else:
            self.obj(v)

    def named(self, v: Any, t: type) -> bool:
        """Keyed by its own `fingerprint` string, if it has one."""
        try:
            fp = declared_fingerprint(v)
        except Exception as exc:  # noqa: BLE001 - a failing property: its identity is unknown
            self.opaque(v, f"its fingerprint attribute raised {type(exc).__name__}: {exc}")
            return True
        if fp is not None:
            self.put("fingerprint", f"{_qualified(t)}\x00{fp}")
            return True
        return False

    # -- data --------------------------------------------------------------------------------
    def array(self, a: np.ndarray) -> None:
        self.put("ndarray", f"{_dtype(a.dtype)}{a.shape}")
        if a.dtype.hasobject:
            self.child("object array", a.tolist())
        else:
            self.hash.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data if a.size else b"")

    def tensor(self, x: Any) -> None:
        """By dtype, shape and bytes: pickling a tensor writes storage ids, different every run."""
        try:
            data = x.detach().cpu().contiguous().reshape(-1).view(sys.modules["torch"].uint8).numpy()
        except Exception as exc:  # noqa: BLE001 - sparse, quantized, meta... tensors
            self.opaque(x, f"its values cannot be read ({type(exc).__name__}: {exc})")
            return
        self.put("tensor", f"{_qualified(type(x))}|{x.dtype}|{tuple(x.shape)}|{x.requires_grad}")
        self.hash.update(data.data)

    def sequence(self, tag: str, items: list[Any] | tuple[Any, ...]) -> None:
        if all(type(x) in _ATOMS for x in items):  # the common case, at C speed: repr is exact here
            self.put(tag + " of atoms", repr(items))
            return
        self.put(tag, str(len(items)))
        for k, x in enumerate(items):
            self.child(f"[{k}]", x)

    def mapping(self, d: dict[Any, Any]) -> None:
        self.put("dict", str(len(d)))
        for k, x in d.items():
            self.child("key", k)
            self.child(f"[{k!r:.60}]" if type(k) in _ATOMS else f"[{type(k).__name__} key]", x)

    def unordered(self, tag: str, items: set[Any] | frozenset[Any]) -> None:
        """Sets iterate in hash order, which differs between processes: key the sorted items."""
        if all(type(x) in _ATOMS for x in items):
            keys = sorted(f"{type(x).__name__}:{x!r}" for x in items)
        else:
            keys = []
            for x in items:
                sub = _Walk(self.strict, [*self.path, "{item}"])
                sub.value(x)
                keys.append(sub.hash.hexdigest())
            keys.sort()
        self.put(tag, "\x00".join(keys))

    # -- code --------------------------------------------------------------------------------
    def function(self, fn: types.FunctionType) -> None:
        code = fn.__code__
        module = fn.__globals__.get("__name__")
        if _is_library(module):  # named, not walked; a library factory's closure still counts
            self.put("library function", f"{module}.{code.co_qualname}@{_version(module)}")
            self.closure(fn)
            return
        self.put("function", f"{module}.{fn.__qualname__}")
        self.code(code)
        if fn.__defaults__:
            self.child("defaults", fn.__defaults__)
        if fn.__kwdefaults__:
            self.child("keyword defaults", fn.__kwdefaults__)
        self.closure(fn)
        if vars(fn):
            self.child("attributes", vars(fn))
        self.globals_read(fn)

    def closure(self, fn: types.FunctionType) -> None:
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:
                self.put("empty cell", name)
                continue
            self.put("cell", name)
            self.child(f"closure variable {name!r} of {fn.__qualname__}", contents)

    def globals_read(self, fn: types.FunctionType) -> None:
        scope = fn.__globals__
        for name, attrs in _names_read(fn.__code__):
            if name not in scope:
                self.put("builtin name", name)  # resolved in builtins when called
                continue
            value = scope[name]
            self.put("global", name)
            self.child(f"global {name!r} read by {fn.__qualname__}", value)
            if isinstance(value, types.ModuleType) and not _is_library(value.__name__):
                for attr in attrs:
                    if hasattr(value, attr):
                        self.put("module attribute", attr)
                        self.child(f"{name}.{attr}", getattr(value, attr))

    def code(self, code: types.CodeType) -> None:
        self.put("code", repr(tuple(getattr(code, attr) for attr in _CODE_ATTRS)))
        self.put("bytecode", code.co_code)
        self.put("exception table", getattr(code, "co_exceptiontable", b""))
        self.child(f"constants of {code.co_name}", code.co_consts)

    def cls(self, c: type) -> None:
        name = f"{c.__module__}.{c.__qualname__}"
        if _is_library(c.__module__):
            self.put("class", f"{name}@{_version(c.__module__)}")
            return
        self.put("user class", name)
        if type(c) is not type:
            self.child(f"metaclass of {c.__qualname__}", type(c))
        self.child(f"bases of {c.__qualname__}", c.__bases__)
        for attr, x in vars(c).items():
            dunder = attr.startswith("__") and attr.endswith("__")
            if attr in _CLASS_SKIP or (dunder and not isinstance(x, _METHOD_TYPES)):
                continue
            self.put("attribute", attr)
            self.child(f"{c.__qualname__}.{attr}", x)

    # -- any other object: its class and the state pickling would save ----------------------
    def obj(self, v: Any) -> None:
        reducer = copyreg.dispatch_table.get(type(v))
        try:
            reduced = reducer(v) if reducer is not None else v.__reduce_ex__(4)
        except Exception as exc:  # noqa: BLE001 - whatever refuses to pickle has unseen state
            self.opaque(v, f"its state cannot be read ({type(exc).__name__}: {exc})")
            return
        self.alive.append(reduced)
        if not isinstance(reduced, (str, tuple)):
            self.opaque(v, f"its __reduce__ returned a {type(reduced).__name__}")
            return
        if isinstance(reduced, str):  # pickled as a reference to a module-level name
            module = getattr(v, "__module__", None) or type(v).__module__
            wrapped = getattr(v, "__wrapped__", None)
            if wrapped is not None:  # e.g. functools.lru_cache: what it wraps decides the output
                self.put("wrapper", _qualified(type(v)))
                self.child("wrapped function", wrapped)
            elif _is_library(module):
                self.put("named", f"{module}.{reduced}@{_version(module)}")
            else:
                self.opaque(v, "pickled by name only, so its content cannot be seen")
            return
        self.put("object", str(len(reduced)))
        self.child("class", type(v))
        # __reduce__ gives 2 to 6 parts; the labels name the longest form.
        for label, part in zip(_REDUCE_PARTS, reduced, strict=False):
            if label in ("items", "entries") and part is not None:
                part = list(part)
            self.child(label, part)


def _name(value: Any) -> str:
    name = getattr(value, "__qualname__", None)
    return name if isinstance(name, str) else type(value).__qualname__


def _qualified(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: only a process using torch has tensors
    return torch is not None and isinstance(value, torch.Tensor)


def _dtype(dtype: np.dtype) -> str:
    return f"{dtype.str}{dtype.descr if dtype.fields else ''}"


@functools.cache
def _is_library(module: str | None) -> bool:
    """Installed packages, the standard library and globalloader: named by version, not walked."""
    if not module or module == "__main__":
        return False
    top = module.partition(".")[0]
    if top == "globalloader" or top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    path = getattr(sys.modules.get(module), "__file__", None) or ""
    return "site-packages" in path or "dist-packages" in path


@functools.cache
def _version(module: str) -> str:
    top = module.partition(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return sys.version.split()[0]
    version = getattr(sys.modules.get(top), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return getattr(sys.modules.get(module), "__file__", None) or ""


def _module_identity(module: types.ModuleType) -> str:
    if _is_library(module.__name__):
        return f"{module.__name__}@{_version(module.__name__)}"
    return f"{module.__name__}:{getattr(module, '__file__', None) or ''}"


@functools.lru_cache(maxsize=4096)
def _names_read(code: types.CodeType) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Globals read by `code` and the code nested in it, each with the attributes read from it
    right away (`cfg.SIZE` reads `SIZE` of a module `cfg`)."""
    found: dict[str, set[str]] = {}
    pending = [code]
    while pending:
        unit = pending.pop()
        instructions = list(dis.get_instructions(unit))
        for k, ins in enumerate(instructions):
            if ins.opname in _GLOBAL_OPS:
                attrs = found.setdefault(ins.argval, set())
                after = instructions[k + 1] if k + 1 < len(instructions) else None
                if after is not None and after.opname in _ATTR_OPS:
                    attrs.add(after.argval)
        pending.extend(c for c in unit.co_consts if isinstance(c, types.CodeType))
    return tuple((name, tuple(sorted(attrs))) for name, attrs in found.items())
