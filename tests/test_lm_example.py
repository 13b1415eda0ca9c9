"""The README's language-model example runs as written: two Parquet corpora, tokenized,
mixed 70/30, packed to 2048, batched, stopped mid-epoch and resumed exactly."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from globalloader.demo.text import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
LM_EXAMPLE = next(
    text
    for text in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    if "make_text_corpus" in text
)


def run_example() -> dict:
    namespace: dict = {"__name__": "__lm_example__"}
    exec(compile(LM_EXAMPLE, "LM example", "exec"), namespace)
    return namespace


def documents_in(batches: list[dict]) -> list[str]:
    """The documents packed into the rows, in order: token streams split at BOS, cut at EOS."""
    stream = np.concatenate(
        [row[seg > 0] for b in batches for row, seg in zip(b["tokens"], b["segment_ids"], strict=True)]
    )
    starts = np.flatnonzero(stream == ByteTokenizer.BOS)
    ends = np.flatnonzero(stream == ByteTokenizer.EOS)
    assert len(starts) == len(ends) and np.all(starts < ends)  # every document is complete
    return [ByteTokenizer().decode(stream[s : e + 1]) for s, e in zip(starts, ends, strict=True)]


def test_lm_example_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_example()  # its own asserts: the resumed batches equal the uninterrupted run's


def test_lm_example_packs_the_mixed_corpora_exactly_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_example()
    batches = ns["seen"] + ns["rest"]
    for b in batches:
        assert b["tokens"].dtype == np.int32 and b["segment_ids"].shape == b["positions"].shape == b["tokens"].shape
        for seg in b["segment_ids"]:
            assert seg[0] == 1 and np.all(np.diff(seg[seg > 0]) >= 0)  # ids restart per row, count pieces
    padding = [int((b["segment_ids"] == 0).sum()) for b in batches]
    assert sum(padding[:-1]) == 0  # only the epoch's last row is padded

    web = {t for p in ns["web"] for t in pq.read_table(p).column("text").to_pylist()}
    code = {t for p in ns["code"] for t in pq.read_table(p).column("text").to_pylist()}
    docs = documents_in(batches)
    assert len(set(docs)) == len(docs)  # none twice
    from_web = sum(d in web for d in docs)
    from_code = sum(d in code for d in docs)
    assert from_web + from_code == len(docs)  # nothing made up, nothing cut
    # "stop": the epoch ends when the code corpus (300 = 30% of 1000) runs out, proportions exact.
    assert from_code == 300 and abs(from_web - 700) <= 1
    code_positions = [i for i, d in enumerate(docs) if d in code]
    assert code_positions[len(code_positions) // 2] in range(len(docs) // 2 - 10, len(docs) // 2 + 10)  # spread


def test_lm_example_rows_reassemble_documents_with_positions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = run_example()
    first = ns["seen"][0]
    for seg, pos in zip(first["segment_ids"], first["positions"], strict=True):
        for s in np.unique(seg[seg > 0]):
            piece = pos[seg == s]
            assert np.array_equal(piece, np.arange(len(piece)))  # positions restart at 0 per piece
    text = ByteTokenizer().decode(first["tokens"][0], errors="replace")
    assert re.search(r"[A-Z][a-z]+ [a-z]+", text) or "def" in text  # readable text, not noise
