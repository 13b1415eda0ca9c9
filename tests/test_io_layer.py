"""storage/ is the one I/O layer: the sources and the chain's operators read and write files only
through it (local and remote reads cannot drift apart, every whole-file write is atomic)."""

from __future__ import annotations

import ast
from pathlib import Path

import globalloader

PACKAGE = Path(globalloader.__file__).parent
# Calls that open, map or write a file by its name (or descriptor) behind storage's back.
_OPENING_CALLS = frozenset(
    {
        "open",  # builtins.open, os.open, io.open, Path.open, fsspec's
        "fdopen",
        "mmap",
        "memory_map",
        "OSFile",
        "open_input_file",
        "open_input_stream",
        "open_output_stream",
        "read_bytes",
        "read_text",
        "write_bytes",
        "write_text",
        "replace",  # os.replace / Path.replace: the rename of a hand-made atomic write
        "rename",
    }
)
# tarfile reads and writes the tar format over a file object storage opened (`fileobj=`).
_FORMAT_OVER_A_FILE_OBJECT = {("tarfile", "open")}


def _in_memory(arg: ast.expr) -> bool:
    """Whether a call's argument is bytes in memory (`io.BytesIO(...)`), not a file's name."""
    return isinstance(arg, ast.Call) and ast.unparse(arg.func) in ("io.BytesIO", "BytesIO")


def _opening_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if owner == "storage":
            continue  # the I/O layer itself
        if name == "replace" and owner not in ("os", "pathlib", "Path"):
            continue  # str.replace, NamedTuple._replace and the like
        if (owner, name) == ("np", "load") and not _in_memory(node.args[0]):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: np.load of a file by its name")
        if name == "ParquetFile" and not ast.unparse(node.args[0]).startswith("storage."):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: ParquetFile of a file storage did not open")
        if name in _OPENING_CALLS and (owner, name) not in _FORMAT_OVER_A_FILE_OBJECT:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(func)}(...)")
    return found


def test_sources_and_operators_open_no_file_themselves() -> None:
    found = [
        hit
        for folder in ("sources", "dataset")
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for hit in _opening_calls(path)
    ]
    assert found == [], (
        "open files through globalloader.storage (read_whole, RangeReader, open_arrow, "
        f"memory_map, write_atomic), not directly: {found}"
    )
