"""ray/ is a front door: it uses the floors below through their public names only (no private
module, name or attribute of sources/, dataset/ or any other package), so a change inside them
cannot break the Ray engine unseen. The import contract `ray-public-only` checks the modules;
this AST walk checks the names and attributes, which import-linter does not see."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import globalloader

PACKAGE = Path(globalloader.__file__).parent
RAY = PACKAGE / "ray"
ROOT = PACKAGE.parents[1]
# The ground floor (_seeding, _extras, ...): private to the project, shared by every floor.
GROUND = frozenset(path.stem for path in PACKAGE.glob("_*.py") if path.stem != "__init__")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_in_ray() -> set[str]:
    """Private names ray/ itself defines (functions, classes, its objects' attributes): reading
    them, on `self` or on another of ray's objects, is ray's own business."""
    names = set()
    for path in RAY.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if _private(name)}


def _imported_module(module: str) -> bool:
    """A private module below another package (`globalloader.sources._arrow_values`)."""
    parts = module.split(".")
    return parts[0] == "globalloader" and parts[1:2] != ["ray"] and any(_private(p) for p in parts[2:])


def _violations(path: Path, own: set[str]) -> list[str]:
    found = []
    where = f"ray/{path.name}"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[:2] == ["globalloader", "ray"]:
                continue
            if _imported_module(node.module):
                found.append(f"{where}:{node.lineno}: imports private module {node.module}")
            for alias in node.names:
                ground = node.module == "globalloader" and alias.name in GROUND
                if _private(alias.name) and not ground:
                    found.append(f"{where}:{node.lineno}: imports private name {alias.name} from {node.module}")
        elif isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno}: imports private module {alias.name}"
                for alias in node.names
                if _imported_module(alias.name)
            ]
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            owner = node.value.id if isinstance(node.value, ast.Name) else ""
            if owner not in ("self", "cls"):
                found.append(f"{where}:{node.lineno}: reads private attribute {ast.unparse(node)}")
    return found


def test_ray_uses_only_public_names_of_other_packages() -> None:
    own = _defined_in_ray()
    found = [hit for path in sorted(RAY.glob("*.py")) for hit in _violations(path, own)]
    assert found == [], "ray/ must use the public API of the floors below (export what it needs there): " + "; ".join(
        found
    )


def test_the_import_contract_forbids_every_private_module_below_ray() -> None:
    """The contract lists every private module of the packages ray/ builds on, so a new one is covered."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    contract = next(c for c in contracts if c["id"] == "ray-public-only")
    private = sorted(
        ".".join(("globalloader", *path.relative_to(PACKAGE).with_suffix("").parts))
        for path in PACKAGE.glob("*/_*.py")
        if path.stem != "__init__" and path.parent.name not in ("ray", "torch")
    )
    assert contract["type"] == "forbidden" and contract["source_modules"] == ["globalloader.ray"]
    assert sorted(contract["forbidden_modules"]) == private
