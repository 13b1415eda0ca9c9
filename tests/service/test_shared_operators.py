"""The new chain operators in shared mode, with a real server: tails (filter, pack, batches cut
in the consumer) and combined sources keep every job's epoch exact, and resume exactly."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]

LENGTHS = [(7 * i) % 19 for i in range(150)]


def tokenize(i):
    return {"tokens": np.arange(LENGTHS[i], dtype=np.int32) + 1000 * i}


def long_enough(doc) -> bool:
    return len(doc["tokens"]) >= 2


def packed(shared: bool = True) -> gl.Dataset:
    return (
        gl.Dataset(gl.from_sequence(list(range(150))))
        .shuffle(seed=4)
        .map(tokenize, shared=shared)
        .filter(long_enough)
        .pack(16)
        .batch(3)
    )


def real_tokens(batches) -> Counter:
    return Counter(int(t) for b in batches for t in b["tokens"][b["segment_ids"] > 0])


EXPECTED = Counter(int(t) for i, n in enumerate(LENGTHS) if n >= 2 for t in np.arange(n) + 1000 * i)


def test_a_packed_chain_through_the_server_has_every_token_once_and_resumes_exactly(server):
    with gl.Loader(packed(), workers=2, share=True, server=str(server.socket)) as loader:
        whole = list(loader)
        assert real_tokens(whole) == EXPECTED
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))  # the tail carries arrays: as torch.save
    for share in (True, False):
        with gl.Loader(packed(), workers=1, share=share, server=str(server.socket)) as resumed:
            resumed.load_state_dict(state)
            rest = list(resumed)
        assert real_tokens(head + rest) == EXPECTED, f"share={share}"
        assert all(b["tokens"].shape[1] == 16 for b in head + rest)


def test_a_mix_of_deterministic_parts_is_shared_exactly_once_per_epoch(server):
    a = gl.Dataset(gl.from_sequence(list(range(60)))).map(lambda x: x * 2, shared=True, key="double")
    b = gl.Dataset(gl.from_sequence(list(range(1000, 1040))))
    chain = gl.Dataset.mix([a, b], [0.6, 0.4]).shuffle(seed=1).batch(7)
    local = Counter(int(x) for batch in chain for x in batch)
    with gl.Loader(chain, workers=2, share=True, server=str(server.socket)) as loader:
        for _ in range(2):
            assert Counter(int(x) for batch in loader for x in batch) == local


def test_sharing_a_mix_whose_part_draws_random_numbers_is_refused_before_any_server_starts(tmp_path):
    noisy = gl.Dataset(gl.from_sequence(list(range(10)))).map(lambda x, rng: x + rng.random())
    chain = gl.Dataset.mix([noisy, noisy], [0.5, 0.5])
    with (
        pytest.raises(ArgumentError, match="deterministic"),
        gl.Loader(chain, share=True, server=str(tmp_path / "none.sock")) as loader,
    ):
        iter(loader)
    assert not (tmp_path / "none.sock").exists()
