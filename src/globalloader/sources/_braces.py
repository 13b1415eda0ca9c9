"""Shell-style brace expansion for shard names: `shard-{000000..000127}.tar`, `{train,val}`.

Rules (those of bash, which the WebDataset convention follows): `{a,b}` is a list, `{0..9}` and
`{a..e}` are inclusive ranges with an optional step `{0..10..2}`, a range whose ends have leading
zeros is padded to the wider end, groups nest, and the leftmost group varies slowest. A group
with neither a comma nor a range (`{x}`) stays literal. An unbalanced brace is an ArgumentError
rather than a literal, because in a shard pattern it is almost always a typo.
"""

from __future__ import annotations

import re

from globalloader.errors import ArgumentError

_NUMERIC_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_LETTER_RANGE = re.compile(r"^([a-zA-Z])\.\.([a-zA-Z])(?:\.\.(-?\d+))?$")


def expand_braces(pattern: str) -> list[str]:
    """Return every string `pattern` expands to, in order (a pattern without braces: itself)."""
    if not isinstance(pattern, str):
        raise ArgumentError(f"brace pattern must be a str, got {type(pattern).__name__}")
    return _expand(pattern, pattern)


def _expand(text: str, whole: str) -> list[str]:
    start = text.find("{")
    if start < 0:
        if "}" in text:
            raise ArgumentError(f"unbalanced '}}' in pattern {whole!r}")
        return [text]
    if "}" in text[:start]:
        raise ArgumentError(f"unbalanced '}}' in pattern {whole!r}")
    end = _matching_close(text, start, whole)
    prefix, body, suffix = text[:start], text[start + 1 : end], text[end + 1 :]
    alternatives = _split_top_level(body)
    if len(alternatives) > 1:
        choices = [c for alt in alternatives for c in _expand(alt, whole)]
    else:
        items = _range(body, whole)
        # A group that is neither a list nor a range is kept with its braces, as bash does.
        choices = items if items is not None else ["{" + c + "}" for c in _expand(body, whole)]
    tails = _expand(suffix, whole)
    return [prefix + choice + tail for choice in choices for tail in tails]


def _matching_close(text: str, start: int, whole: str) -> int:
    depth = 0
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return pos
    raise ArgumentError(f"unbalanced '{{' in pattern {whole!r}")


def _split_top_level(body: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for pos, char in enumerate(body):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(body[last:pos])
            last = pos + 1
    parts.append(body[last:])
    return parts


def _range(body: str, whole: str) -> list[str] | None:
    match = _NUMERIC_RANGE.match(body)
    if match:
        first, last, step_text = match.groups()
        step = _step(step_text, whole)
        lo, hi = int(first), int(last)
        padded = any(_has_leading_zero(s) for s in (first, last))
        width = max(len(first), len(last)) if padded else 0
        values = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        return [f"{v:0{width}d}" if width else str(v) for v in values]
    match = _LETTER_RANGE.match(body)
    if match:
        first, last, step_text = match.groups()
        step = _step(step_text, whole)
        lo, hi = ord(first), ord(last)
        values = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
        return [chr(v) for v in values]
    return None


def _step(text: str | None, whole: str) -> int:
    step = abs(int(text)) if text else 1
    if step == 0:
        raise ArgumentError(f"range step 0 in pattern {whole!r}")
    return step


def _has_leading_zero(number: str) -> bool:
    digits = number.lstrip("-")
    return len(digits) > 1 and digits.startswith("0")
