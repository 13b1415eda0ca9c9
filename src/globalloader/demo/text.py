"""The language-model workload's data: synthetic text corpora in Parquet and a byte-level tokenizer.

Two corpora, "web" (prose: Zipf-distributed words in sentences and paragraphs, a few accented,
CJK and emoji words so UTF-8 is more than ASCII) and "code" (indented lines of keywords,
identifiers, operators and numbers). Document sizes are lognormal in bytes, so a few documents
are far longer than the median, as in real pretraining data; that tail is what makes packing and
mixing cost what they cost. Everything is drawn from generators seeded by (seed, corpus, file),
so a corpus is the same byte for byte whatever machine or order wrote it.

`ByteTokenizer` maps UTF-8 bytes to token ids 0..255 (plus BOS and EOS): nothing to download or
train, and the same function runs in every loader the benchmark compares.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from globalloader import _extras
from globalloader._paths import build_once, cache_dir
from globalloader.errors import ArgumentError, check_int
from globalloader.storage import write_atomic

__all__ = ["CORPORA", "ByteTokenizer", "CorpusSpec", "demo_corpora", "document_sizes", "make_text_corpus"]

# Bump when the text recipe changes, so corpora written by an older recipe are rewritten.
_RECIPE = 1


@dataclass(frozen=True)
class CorpusSpec:
    """How one corpus's documents are drawn: lognormal byte sizes (median, sigma), clipped."""

    kind: str
    median_bytes: float
    sigma: float
    min_bytes: int
    max_bytes: int


CORPORA: dict[str, CorpusSpec] = {
    "web": CorpusSpec("web", median_bytes=1200.0, sigma=1.1, min_bytes=40, max_bytes=256_000),
    "code": CorpusSpec("code", median_bytes=1800.0, sigma=1.3, min_bytes=40, max_bytes=512_000),
}

_SYLLABLES = ("ka", "to", "ri", "men", "sa", "lo", "pe", "ur", "ni", "an", "de", "vo", "is", "tha", "qu", "el")
_RARE_WORDS = ("café", "naïve", "über", "façade", "smörgåsbord", "東京", "データ", "🙂", "Zürich", "señor")
_KEYWORDS = ("def", "return", "if", "else", "for", "in", "while", "class", "import", "from", "with", "yield", "not")
_OPERATORS = ("=", "+", "-", "*", "/", "==", "(", ")", "[", "]", ":", ",", ".", "->", "+=", "{", "}")


def _vocabulary(seed: int, size: int, rare: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Pseudo-words and their cumulative Zipf probabilities (word r has weight 1/(r+1)); the
    `rare` words take evenly spaced ranks, so they are neither the commonest nor absent."""
    rng = np.random.default_rng([seed, 7])
    parts = rng.integers(0, len(_SYLLABLES), size=(size, 4))
    lengths = 1 + rng.binomial(3, 0.4, size=size)
    words = ["".join(_SYLLABLES[p] for p in row[:n]) for row, n in zip(parts, lengths, strict=True)]
    for i, word in enumerate(rare):
        words[(i + 1) * size // (len(rare) + 1)] = word
    weights = 1.0 / np.arange(1, size + 1)
    return np.array(words, dtype=object), np.cumsum(weights / weights.sum())


_WEB_WORDS, _WEB_CDF = _vocabulary(0, 4000, _RARE_WORDS)
_IDENTIFIERS, _IDENTIFIER_CDF = _vocabulary(1, 600)


def document_sizes(spec: CorpusSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` target document sizes in bytes: lognormal around `spec.median_bytes`, clipped."""
    sizes = rng.lognormal(np.log(spec.median_bytes), spec.sigma, size=n)
    return np.clip(sizes, spec.min_bytes, spec.max_bytes).astype(np.int64)


def _words(rng: np.random.Generator, words: np.ndarray, cdf: np.ndarray, n: int) -> list[str]:
    index = np.minimum(np.searchsorted(cdf, rng.random(n)), len(words) - 1)
    return list(words[index])


def _web_document(rng: np.random.Generator, size: int) -> str:
    """Prose of about `size` bytes: capitalised sentences of 4-24 words, paragraphs of 2-7 sentences."""
    words = _words(rng, _WEB_WORDS, _WEB_CDF, max(1, size // 6))
    sentence_ends = np.cumsum(rng.integers(4, 25, size=len(words) // 4 + 1))
    paragraph_every = int(rng.integers(2, 8))
    pieces: list[str] = []
    start = 0
    for s, end in enumerate(sentence_ends):
        if start >= len(words):
            break
        sentence = words[start:end]
        pieces.append(sentence[0].capitalize() + (" " + " ".join(sentence[1:]) if len(sentence) > 1 else "") + ".")
        pieces.append("\n\n" if (s + 1) % paragraph_every == 0 else " ")
        start = int(end)
    return "".join(pieces).rstrip()


def _code_document(rng: np.random.Generator, size: int) -> str:
    """Code-like text of about `size` bytes: indented lines mixing keywords, names, operators, numbers."""
    tokens = max(1, size // 5)
    kinds = rng.choice(4, size=tokens, p=[0.2, 0.45, 0.3, 0.05])
    names = _words(rng, _IDENTIFIERS, _IDENTIFIER_CDF, tokens)
    keyword = rng.integers(0, len(_KEYWORDS), size=tokens)
    operator = rng.integers(0, len(_OPERATORS), size=tokens)
    number = rng.integers(0, 1000, size=tokens)
    line_ends = np.cumsum(rng.integers(2, 12, size=tokens // 2 + 1))
    indents = rng.integers(0, 4, size=len(line_ends))
    # Each token's text for every kind (keyword, name, operator, number); its kind picks one.
    texts = [np.array(_KEYWORDS, dtype=object)[keyword], names, np.array(_OPERATORS, dtype=object)[operator]]
    words = np.array([*texts, number.astype(str).astype(object)], dtype=object)[kinds, np.arange(tokens)]
    lines: list[str] = []
    start = 0
    for end, indent in zip(line_ends, indents, strict=True):
        if start >= tokens:
            break
        stop = min(int(end), tokens)
        lines.append("    " * int(indent) + " ".join(words[start:stop]))
        start = stop
    return "\n".join(lines)


_WRITERS = {"web": _web_document, "code": _code_document}


def _write_file(
    path: Path, file: int, spec: CorpusSpec, documents: int, seed: int, rows_per_group: int, bar: Any
) -> None:
    pa = _extras.require("pyarrow", "parquet")
    pq = _extras.require("pyarrow.parquet", "parquet")
    rng = np.random.default_rng([seed, list(CORPORA).index(spec.kind), file])
    texts = []
    for size in document_sizes(spec, documents, rng):
        texts.append(_WRITERS[spec.kind](rng, int(size)))
        bar.update(1)
    with write_atomic(path) as out:  # not durable: `build_once` makes a corpus a crash cut short again
        pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), out.file, row_group_size=rows_per_group)


def make_text_corpus(
    root: str | os.PathLike[str],
    kind: str,
    documents: int,
    files: int = 4,
    rows_per_group: int = 1000,
    seed: int = 0,
    progress: bool = True,
) -> list[Path]:
    """Write (once) `documents` synthetic documents of corpus `kind` ("web" or "code") as `files`
    Parquet files `root/{kind}-NNNNN.parquet` with one string column "text".

    Documents are split evenly over the files (the first files take one more when it does not
    divide); each file holds row groups of `rows_per_group` rows. A second call with the same
    parameters returns the paths without touching the files (`_paths.build_once`). Needs pyarrow
    (the `parquet` extra).
    """
    if kind not in CORPORA:
        raise ArgumentError(f"kind must be one of {sorted(CORPORA)}, got {kind!r}")
    for name, value in (("documents", documents), ("files", files), ("rows_per_group", rows_per_group)):
        check_int(value, name, 1)
    if files > documents:
        raise ArgumentError(f"files ({files}) must not exceed documents ({documents}): a file would be empty")
    check_int(seed, "seed")
    _extras.require("pyarrow.parquet", "parquet")  # fail before any file is touched
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"{kind}-{f:05d}.parquet" for f in range(files)]
    spec = CORPORA[kind]
    params = {"recipe": _RECIPE, "spec": asdict(spec), "documents": documents, "files": files}
    params |= {"rows_per_group": rows_per_group, "seed": seed}

    def build() -> None:
        for stale in root.glob(f"{kind}-*.parquet"):
            stale.unlink()
        per_file = [documents // files + (f < documents % files) for f in range(files)]
        with tqdm(total=documents, desc=f"synthetic {kind} text", unit="doc", disable=not progress) as bar:
            for file, (path, count) in enumerate(zip(paths, per_file, strict=True)):
                _write_file(path, file, spec, count, seed, rows_per_group, bar)

    build_once(root, f"text-{kind}", params, lambda: all(p.is_file() for p in paths), build)
    return paths


def demo_corpora(web_documents: int, code_documents: int, progress: bool = True) -> tuple[list[Path], list[Path]]:
    """The web and code corpora in the cache folder (written once): 8 and 4 files."""
    root = cache_dir("demo", f"text-{web_documents}-{code_documents}")
    web = make_text_corpus(root, "web", web_documents, files=8, progress=progress)
    code = make_text_corpus(root, "code", code_documents, files=4, progress=progress)
    return web, code


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, with BOS (256) before and EOS (257) after each document.

    Byte-level: every string has an encoding, nothing is downloaded or trained, and the cost per
    byte is one NumPy copy, so a benchmark measures the loader rather than the tokenizer.
    Calling the tokenizer on a record `{field: str, ...}` returns `{"tokens": int32 array}`, the
    shape a chain's `map` and `pack(key="tokens")` expect. Stateless, so it pickles to workers.
    """

    BOS = 256
    EOS = 257
    vocab_size = 258

    def __init__(self, field: str = "text", bos: bool = True, eos: bool = True) -> None:
        if not isinstance(field, str):
            raise ArgumentError(f"field must be a str (the record's text column), got {field!r}")
        self.field, self.bos, self.eos = field, bool(bos), bool(eos)

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text`: [BOS] + its UTF-8 bytes + [EOS], as int32."""
        if not isinstance(text, str):
            raise ArgumentError(f"ByteTokenizer.encode: text must be a str, got {type(text).__name__}")
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        ids = np.empty(len(raw) + self.bos + self.eos, dtype=np.int32)
        if self.bos:
            ids[0] = self.BOS
        if self.eos:
            ids[-1] = self.EOS
        ids[int(self.bos) : len(ids) - int(self.eos)] = raw
        return ids

    def decode(self, ids: Any, errors: str = "strict") -> str:
        """The text of `ids`, BOS and EOS dropped. `errors` as for `bytes.decode`: a packed row may
        cut a multi-byte character in two, which "strict" reports and "replace" marks."""
        array = np.asarray(ids)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ArgumentError(
                f"ByteTokenizer.decode: ids must be a 1-D integer array, got {array.dtype} {array.shape}"
            )
        if len(array) and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ArgumentError(
                f"ByteTokenizer.decode: ids must lie in 0..{self.vocab_size - 1}, got {array.min()}..{array.max()}"
            )
        return array[array < 256].astype(np.uint8).tobytes().decode("utf-8", errors=errors)

    def __call__(self, record: dict[str, Any]) -> dict[str, np.ndarray]:
        try:
            text = record[self.field]
        except (KeyError, TypeError):
            raise ArgumentError(
                f"ByteTokenizer: the record has no field {self.field!r} (it has "
                f"{sorted(record) if isinstance(record, dict) else type(record).__name__}); pass field=..."
            ) from None
        return {"tokens": self.encode(text)}

    def __repr__(self) -> str:
        return f"ByteTokenizer(field={self.field!r}, bos={self.bos}, eos={self.eos})"
