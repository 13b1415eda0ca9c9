"""What pyproject.toml promises: the extras a fresh install needs, and the test markers."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> dict[str, str]:
    """Requirement name (lower case, extras dropped) -> its version part."""
    out = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(.*)", req)
        assert match, req
        out[match.group(1).lower()] = match.group(3)
    return out


def test_the_bench_extra_has_what_the_ray_benchmark_imports_beyond_ray_data():
    bench = _names(PROJECT["project"]["optional-dependencies"]["bench"])
    # Ray's memory_summary talks to its state API over gRPC; importing Ray Data needs aiohttp.
    assert {"grpcio", "aiohttp", "ray", "torch", "pillow"} <= bench.keys()
    benchmark = (ROOT / "benchmarks" / "ray_shuffle.py").read_text()
    assert "memory_summary" in benchmark, "the benchmark no longer needs grpcio: drop it from the extra"


def test_every_extra_gives_lower_bounds_only():
    for extra, requirements in PROJECT["project"]["optional-dependencies"].items():
        for name, version in _names(requirements).items():
            assert re.fullmatch(r">=\s*[\w.]+", version), f"{extra}: {name}{version} is not a lower bound only"


def test_the_version_comes_from_one_place():
    assert PROJECT["project"]["dynamic"] == ["version"] and "version" not in PROJECT["project"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "globalloader._version.__version__"}


def test_markers_are_registered_and_strict():
    options = PROJECT["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in options["addopts"].split()
    assert {m.split(":")[0] for m in options["markers"]} == {"slow", "integration"}


def test_the_lint_extra_brings_the_gate_tools_and_never_torch():
    lint = _names(PROJECT["project"]["optional-dependencies"]["lint"])
    assert {"ruff", "mypy", "import-linter", "pre-commit"} <= lint.keys()
    # The gates run without the heavy extras; mypy reads their own hints only where installed.
    assert not {"torch", "ray", "pillow", "pyarrow"} & lint.keys()


def test_the_fast_jpeg_decoder_is_in_the_vision_and_test_extras():
    extras = PROJECT["project"]["optional-dependencies"]
    # The test extra too: without it the tests of the libjpeg-turbo path would compare Pillow to itself.
    assert "simplejpeg" in _names(extras["vision"]) and "simplejpeg" in _names(extras["test"])
    # OpenCV's warp (antialias=False) likewise, tested against Pillow's.
    assert "opencv-python-headless" in _names(extras["vision"]) and "opencv-python-headless" in _names(extras["test"])
