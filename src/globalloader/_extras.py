"""Lazy imports of optional dependencies, failing with the extra to install."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from globalloader.errors import MissingExtraError


def require(module: str, extra: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError telling the user which extra provides it.
    Cheap once imported (readers call it per block): a look-up in `sys.modules`."""
    imported = sys.modules.get(module)
    if imported is not None:
        return imported
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module} is needed here but not installed: pip install 'globalloader[{extra}]'"
        ) from exc
