"""The example source of docs/custom-sources.md, taken from the page itself: it shuffles, shards
across ranks, runs in process workers and resumes exactly, like a built-in source."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError
from globalloader.sources.base import BatchReads, capable

PAGE = Path(__file__).resolve().parents[2] / "docs" / "custom-sources.md"


@pytest.fixture(scope="module")
def JsonLines():
    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)[0]
    module = types.ModuleType("custom_source_example")  # importable by name: workers unpickle it
    sys.modules[module.__name__] = module
    exec(compile(code, str(PAGE), "exec"), module.__dict__)
    yield module.JsonLines
    del sys.modules[module.__name__]


@pytest.fixture
def source(JsonLines, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"x": i, "text": "é" * (i % 5)}) + "\n" for i in range(203)))
    return JsonLines(path)


def test_it_is_a_source_with_batch_reads(source):
    assert len(source) == 203 and source[5] == {"__key__": "line 5", "x": 5, "text": ""}
    assert capable(source, BatchReads)
    assert [r["x"] for r in source.read_many(np.array([7, 0, 202]))] == [7, 0, 202]
    with pytest.raises(IndexError, match="203"):
        source[203]
    with pytest.raises(IndexError, match="negative"):
        source[-1]


def test_shuffle_and_shards_cover_every_record_once_in_a_new_order(source):
    epochs = []
    for epoch in range(2):
        ranks = [
            [s["x"] for s in gl.Dataset(source).shuffle(seed=3).shard(rank, 2, uneven="drop").iterator(epoch)]
            for rank in range(2)
        ]
        assert not set(ranks[0]) & set(ranks[1]) and len(ranks[0]) == len(ranks[1]) == 101
        epochs.append(ranks[0] + ranks[1])
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_workers_resume_exactly_where_the_checkpoint_was(source, mode):
    chain = gl.Dataset(source).shuffle(seed=1).map(lambda r: {"x": r["x"] * 2}).batch(10)
    expected = [b["x"].tolist() for b in chain]
    with gl.Loader(chain, workers=2, mode=mode) as loader:
        batches = iter(loader)
        first = [next(batches)["x"].tolist() for _ in range(7)]
        state = loader.state_dict()
    assert first == expected[:7]
    with gl.Loader(chain, workers=2, mode=mode) as resumed:
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert [b["x"].tolist() for b in resumed] == expected[7:]


def test_a_half_written_ability_is_named(JsonLines, source):
    class Columnar(JsonLines):
        columnar = True  # but no read_columns

    with pytest.raises(ArgumentError, match=r"Columnar has columnar but not read_columns"):
        gl.Dataset(Columnar(source.path)).batch(4)
