"""Tests for globalloader.demo.text: synthetic text corpora in Parquet and the byte-level tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import globalloader as gl
from globalloader.demo.text import CORPORA, ByteTokenizer, demo_corpora, make_text_corpus
from globalloader.errors import ArgumentError


def texts(paths: list[Path]) -> list[str]:
    return [t for p in paths for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()]


def snapshot(paths: list[Path]) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}


def test_corpus_files_row_groups_and_schema(tmp_path):
    paths = make_text_corpus(tmp_path, "web", 1001, files=3, rows_per_group=100, progress=False)
    assert [p.name for p in paths] == ["web-00000.parquet", "web-00001.parquet", "web-00002.parquet"]
    rows = [pq.ParquetFile(p).metadata.num_rows for p in paths]
    assert rows == [334, 334, 333]
    meta = pq.ParquetFile(paths[0]).metadata
    assert meta.num_row_groups == 4 and meta.row_group(0).num_rows == 100
    assert pq.read_schema(paths[0]).names == ["text"]
    source = gl.Parquet([str(p) for p in paths], columns=["text"])
    assert len(source) == 1001 and isinstance(source[1000]["text"], str)


def test_corpus_is_deterministic_per_seed_and_reused(tmp_path):
    first = make_text_corpus(tmp_path / "a", "code", 200, files=2, progress=False)
    again = make_text_corpus(tmp_path / "b", "code", 200, files=2, progress=False)
    other = make_text_corpus(tmp_path / "c", "code", 200, files=2, seed=1, progress=False)
    assert texts(first) == texts(again)
    assert all(x != y for x, y in zip(texts(first), texts(other), strict=True))
    before = snapshot(first)
    assert make_text_corpus(tmp_path / "a", "code", 200, files=2, progress=False) == first
    assert snapshot(first) == before  # same parameters: nothing rewritten


def test_changed_parameters_or_a_lost_file_rewrite_the_corpus(tmp_path):
    make_text_corpus(tmp_path, "web", 60, files=3, progress=False)
    fewer = make_text_corpus(tmp_path, "web", 40, files=2, progress=False)
    assert sorted(p.name for p in tmp_path.glob("web-*.parquet")) == [p.name for p in fewer]  # no stale third file
    assert len(texts(fewer)) == 40
    fewer[1].unlink()  # as an interrupted or tampered write would leave it
    assert len(texts(make_text_corpus(tmp_path, "web", 40, files=2, progress=False))) == 40


def test_document_sizes_are_heavy_tailed(tmp_path):
    sizes = np.sort([len(t.encode()) for t in texts(make_text_corpus(tmp_path, "web", 3000, files=2, progress=False))])
    # An exponential distribution with the same mean gives the top 1% about 6% of the bytes and a
    # max/median near 12; lognormal(sigma=1.1) gives about 10% and 30-60.
    assert sizes[-30:].sum() / sizes.sum() > 0.08
    assert sizes[-1] / np.median(sizes) > 20
    assert sizes[0] >= CORPORA["web"].min_bytes // 2 and sizes[-1] <= CORPORA["web"].max_bytes * 1.1
    median = np.median(sizes)
    assert 0.7 * CORPORA["web"].median_bytes < median < 1.3 * CORPORA["web"].median_bytes


def test_web_and_code_text_differ_in_kind(tmp_path):
    web = texts(make_text_corpus(tmp_path, "web", 300, files=1, progress=False))
    code = texts(make_text_corpus(tmp_path, "code", 300, files=1, progress=False))
    web_all, code_all = "".join(web), "".join(code)
    sentence_starts = re.compile(r"\. [A-Z]")
    assert len(sentence_starts.findall(web_all)) > 1000 and not sentence_starts.findall(code_all)
    assert code_all.count("\n    ") > 100 and ("def" in code_all and "return" in code_all)
    assert any(ord(c) > 127 for c in web_all)  # UTF-8 beyond ASCII: the tokenizer sees multi-byte characters


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ArgumentError, match="kind"):
        make_text_corpus(tmp_path, "books", 10, progress=False)
    with pytest.raises(ArgumentError, match="documents"):
        make_text_corpus(tmp_path, "web", 0, progress=False)
    with pytest.raises(ArgumentError, match=r"files \(5\)"):
        make_text_corpus(tmp_path, "web", 3, files=5, progress=False)


def test_demo_corpora_live_in_the_cache_folder(isolated_cache):
    web, code = demo_corpora(40, 20, progress=False)
    assert len(web) == 8 and len(code) == 4
    assert all(p.is_relative_to(isolated_cache) for p in web + code)
    assert len(texts(web)) == 40 and len(texts(code)) == 20


@pytest.mark.parametrize("text", ["", "hello", "naïve café 東京 🙂", "line\n\ttab\x00nul"])
def test_tokenizer_round_trips(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and ids[0] == ByteTokenizer.BOS and ids[-1] == ByteTokenizer.EOS
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tokenizer.decode(ids) == text
    assert ByteTokenizer(bos=False, eos=False).encode(text).tolist() == list(text.encode("utf-8"))


def test_tokenizer_round_trips_the_corpus(tmp_path):
    tokenizer = ByteTokenizer()
    for text in texts(make_text_corpus(tmp_path, "web", 100, files=1, progress=False)):
        record = tokenizer({"text": text, "__key__": "x"})
        assert set(record) == {"tokens"}
        assert tokenizer.decode(record["tokens"]) == text


def test_tokenizer_decode_of_a_cut_character():
    ids = ByteTokenizer(bos=False, eos=False).encode("é")
    with pytest.raises(UnicodeDecodeError):
        ByteTokenizer().decode(ids[:1])
    assert ByteTokenizer().decode(ids[:1], errors="replace") == "\ufffd"


def test_tokenizer_errors_name_what_is_wrong():
    tokenizer = ByteTokenizer()
    with pytest.raises(ArgumentError, match="'text'"):
        tokenizer({"body": "x"})
    with pytest.raises(ArgumentError, match=r"0\.\.257"):
        tokenizer.decode(np.array([65, 300]))
    with pytest.raises(ArgumentError, match="str"):
        tokenizer.encode(b"bytes")
