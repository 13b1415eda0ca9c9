"""The documentation agrees with the code, checked without building the site (CI builds it).

Every error class has its section, every CLI subcommand and option and every environment variable
the code reads is on the CLI page, every Python example compiles, the cheap ones run as written,
and the site's configuration names only pages that exist and packages the `docs` extra installs.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest

import globalloader
from globalloader import cli, errors

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MKDOCS = (ROOT / "mkdocs.yml").read_text()
# Pages whose examples run here; the others start a server (shared) or a Ray cluster (ray).
RUN_AS_WRITTEN = (
    "getting-started.md",
    "chain.md",
    "resume.md",
    "elastic.md",
    "errors.md",
    "torch.md",
    "observe.md",
    "custom-sources.md",
)


def _examples(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def _sections(page: Path, level: str = "## ") -> dict[str, str]:
    """Heading text -> the text up to the next heading of the same level."""
    parts = re.split(rf"^{level}(.+)$", page.read_text(), flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


# -- errors -----------------------------------------------------------------------------------


def test_every_error_class_has_its_section_and_no_other():
    """One section per class, under its own name; an alias (an earlier name bound to the same
    class) is no class of its own, but the page must name it."""
    bound = {
        name: obj
        for name, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, Exception) and obj.__module__ == errors.__name__
    }
    classes = {obj.__name__ for obj in bound.values()}
    aliases = {name for name, obj in bound.items() if name != obj.__name__}
    assert "GlobalLoaderError" in classes and len(classes) >= 10
    sections = _sections(DOCS / "errors.md")
    assert set(sections) == classes
    for name, text in sections.items():
        assert len(text.split()) >= 15, f"errors.md: the section on {name} says almost nothing"
    page = (DOCS / "errors.md").read_text()
    unnamed = sorted(alias for alias in aliases if f"`{alias}`" not in page)
    assert not unnamed, f"errors.md does not name the aliases {unnamed}"


# -- command line ------------------------------------------------------------------------------


def test_every_subcommand_and_option_is_on_the_cli_page(capsys):
    listed = re.search(r"\{([a-z,]+)\}", _help(capsys))
    assert listed, "the top-level help lists no subcommands"
    commands = listed.group(1).split(",")
    sections = _sections(DOCS / "cli.md")
    for command in commands:
        heading = f"`globalloader {command}`"
        assert heading in sections, f"cli.md has no section {heading}"
        usage = _help(capsys, command).split("\n\n")[0]  # the usage block lists every option; the rest is prose
        options = set(re.findall(r"--[a-z][a-z-]*", usage)) - {"--help"}
        documented = set(re.findall(r"`(--[a-z][a-z-]*)", sections[heading]))
        assert options == documented, (
            f"globalloader {command}: options {sorted(options)}, documented {sorted(documented)}"
        )


def test_every_environment_variable_the_code_reads_is_on_the_cli_page():
    read = set()
    for path in (ROOT / "src" / "globalloader").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get\(|\[)\s*[\"'](GLOBALLOADER_[A-Z_]+)", path.read_text()))
    assert {"GLOBALLOADER_SOCKET", "GLOBALLOADER_CACHE_DIR"} <= read
    page = (DOCS / "cli.md").read_text()
    missing = sorted(name for name in read if f"`{name}`" not in page)
    assert not missing, f"cli.md does not document {missing}"


# -- examples ----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_example_compiles(page):
    for number, code in enumerate(_examples(page), start=1):
        compile(code, f"{page.name} example {number}", "exec")


@pytest.mark.parametrize("name", RUN_AS_WRITTEN)
def test_examples_run_as_written(name, tmp_path, monkeypatch):
    """A page's examples run in order in one namespace, as a reader pastes them."""
    examples = _examples(DOCS / name)
    assert examples, f"{name} has no example"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for number, code in enumerate(examples, start=1):
        exec(compile(code, f"{name} example {number}", "exec"), namespace)


def test_getting_started_has_a_training_loop():
    code = "\n".join(_examples(DOCS / "getting-started.md"))
    assert "gl.Loader(" in code and "set_epoch" in code and "for batch in loader" in code


# -- the joint sampler's specification ---------------------------------------------------------


def test_the_joint_sampler_is_specified_in_the_docs_and_referenced_there():
    assert "The joint sampler" in _sections(DOCS / "shared.md")
    rule = _sections(DOCS / "shared.md", "### ")
    assert {"Definitions", "The rule", "Why each order is uniform", "Guarantees"} <= set(rule)
    old_spec = "SAMPLER" + ".md"  # the specification these docs replace, outside the repository
    for folder in ("src", "tests", "benchmarks", "docs"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md"):
                assert old_spec not in path.read_text(), f"{path.relative_to(ROOT)} still cites {old_spec}"
    assert "docs/shared.md" in (ROOT / "src" / "globalloader" / "sampling" / "joint.py").read_text()


# -- the site's configuration ------------------------------------------------------------------


def test_nav_lists_every_page_and_only_existing_ones():
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", MKDOCS, flags=re.MULTILINE))
    assert nav == {str(p.relative_to(DOCS)) for p in PAGES}


def test_api_reference_covers_the_public_modules_and_they_exist():
    targets = set()
    for page in (DOCS / "api").glob("*.md"):
        targets |= set(re.findall(r"^::: ([\w.]+)$", page.read_text(), flags=re.MULTILINE))
    assert {
        "globalloader",
        "globalloader.errors",
        "globalloader.vision",
        "globalloader.torch",
        "globalloader.ray",
        "globalloader.sampling",
    } <= targets
    for target in targets:  # found in the source without importing it (torch, ray stay unloaded)
        base = ROOT / "src" / Path(*target.split("."))
        assert base.with_suffix(".py").is_file() or (base / "__init__.py").is_file(), target


def test_every_top_level_name_is_explained_in_a_guide():
    guides = "\n".join(p.read_text() for p in PAGES if p.parent == DOCS)
    mentions = ("`{}", "gl.{}", "globalloader.{}")
    missing = [name for name in globalloader.__all__ if not any(m.format(name) in guides for m in mentions)]
    assert not missing, f"no guide page mentions {missing}"


def test_the_docs_extra_installs_what_mkdocs_yml_uses():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = {re.split(r"[<>=\[]", requirement)[0].lower() for requirement in extras["docs"]}
    assert "name: material" in MKDOCS and "mkdocs-material" in installed
    assert "- mkdocstrings:" in MKDOCS and {"mkdocstrings", "mkdocstrings-python"} <= installed
    assert "mkdocs" in installed
    assert all(re.fullmatch(r"[\w.\[\]-]+>=[\w.]+", r) for r in extras["docs"]), "lower bounds only"
