"""The language-model example (the README's) runs as written: two Parquet corpora, tokenized,
mixed 70/30, packed to 2048, batched, stopped mid-epoch and resumed exactly."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq

from globalloader.demo.text import ByteTokenizer

LM_EXAMPLE = """\
import numpy as np
import globalloader as gl
from globalloader.demo.text import ByteTokenizer, make_text_corpus

web = make_text_corpus("lm-text", "web", documents=700, files=2, progress=False)    # synthetic Parquet
code = make_text_corpus("lm-text", "code", documents=300, files=2, progress=False)
tokenize = ByteTokenizer()            # {"text": str} -> {"tokens": int32 UTF-8 bytes between BOS and EOS}

def corpus(files):                    # rows shuffled within windows of 8 row groups: sequential reads
    return gl.Dataset(gl.Parquet(files, columns=["text"])).shuffle(window=8).map(tokenize)

chain = (
    gl.Dataset.mix([corpus(web), corpus(code)], weights=[0.7, 0.3])  # exact proportions, stops when one ends
    .seed(0)                          # the root of every random operator in the chain
    .pack(2048, key="tokens")         # rows of 2048 tokens + segment_ids (0 = padding) + positions
    .batch(8)
)
with gl.Loader(chain, workers=2) as loader:
    it = iter(loader)
    seen = [next(it) for _ in range(5)]
    state = loader.state_dict()       # mid-epoch, mid-row: save it with your checkpoint
    rest = list(it)

with gl.Loader(chain, workers=2) as resumed:
    resumed.load_state_dict(state)    # after a restart: the same batches as if never stopped
    again = list(resumed)
assert seen[0]["tokens"].shape == (8, 2048) and len(again) == len(rest) > 0
for a, b in zip(rest, again, strict=True):
    assert all(np.array_equal(a[k], b[k]) for k in ("tokens", "segment_ids", "positions"))
"""


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
