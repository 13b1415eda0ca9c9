"""Brace expansion matches the shell rules the WebDataset convention (and braceexpand) uses."""

from __future__ import annotations

import braceexpand
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from globalloader.errors import ArgumentError
from globalloader.sources._files import expand_braces

PATTERNS = [
    "plain.tar",
    "shard-{000000..000003}.tar",
    "shard-{0..3}.tar",
    "shard-{8..11}.tar",
    "shard-{3..0}.tar",
    "{train,val}/part-{00..02}.tar",
    "a{b,c{d,e}}f",
    "x{1..10..3}y",
    "{a..e}",
    "{e..a..2}",
    "lit{x}eral",
    "{-2..2}",
    "{a,}b",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_braceexpand(pattern: str) -> None:
    assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern))


def test_zero_padding_follows_wider_end() -> None:
    assert expand_braces("s{008..010}") == ["s008", "s009", "s010"]
    assert expand_braces("s{08..100}")[:2] == ["s008", "s009"]


def test_leftmost_group_varies_slowest() -> None:
    assert expand_braces("{a,b}{1,2}") == ["a1", "a2", "b1", "b2"]


@pytest.mark.parametrize("pattern", ["shard-{0..3.tar", "shard-0..3}.tar", "a}{b,c}", "{a,{b}"])
def test_unbalanced_brace_names_pattern(pattern: str) -> None:
    with pytest.raises(ArgumentError, match="unbalanced") as info:
        expand_braces(pattern)
    assert repr(pattern) in str(info.value)


def test_zero_step_and_wrong_type() -> None:
    with pytest.raises(ArgumentError, match="step 0"):
        expand_braces("{1..5..0}")
    with pytest.raises(ArgumentError, match="must be a str"):
        expand_braces(b"shard.tar")  # type: ignore[arg-type]


_ranges = st.builds(
    lambda a, b, pad: f"{{{a:0{pad}d}..{b:0{pad}d}}}", st.integers(0, 12), st.integers(0, 12), st.integers(1, 3)
)
_pattern = st.recursive(
    st.text("abc-_/.", max_size=3) | _ranges,
    lambda inner: (
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "{" + ",".join(xs) + "}")
        | st.lists(inner, min_size=1, max_size=3).map("".join)
    ),
    max_leaves=6,
)


@settings(max_examples=100, deadline=None)
@given(_pattern)
def test_random_patterns_match_braceexpand(pattern: str) -> None:
    assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern))
