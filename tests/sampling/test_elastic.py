"""What remains of an epoch after other worlds consumed part of it, against a plain-Python model."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from globalloader.errors import StateError
from globalloader.sampling.elastic import Layer, Remaining


def model(n: int, layers: list[Layer]) -> list[int]:
    """The definition: each rank's share is strided over what remains (pad wraps around)."""
    remaining = list(range(n))
    for layer in layers:
        m = len(remaining)
        gone = {(r + q * layer.world) % m for r, c in enumerate(layer.counts) for q in range(c)} if m else set()
        remaining = [p for j, p in enumerate(remaining) if j not in gone]
    return remaining


def test_ranks_in_lockstep_leave_a_suffix_without_an_array():
    rest = Remaining(100, (Layer(4, (5,) * 4, "none"), Layer(3, (2,) * 3, "pad")))
    assert rest.array is None and (rest.start, len(rest)) == (26, 74)
    assert rest.positions(np.arange(3)).tolist() == [26, 27, 28]


def test_random_layers_match_the_model():
    rng = random.Random(3)
    for _ in range(200):
        n, layers = rng.randint(0, 60), []
        for _ in range(rng.randint(1, 3)):
            world, uneven = rng.randint(1, 5), rng.choice(["pad", "drop", "none"])
            rest = Remaining(n, tuple(layers))
            most = [rest.share(r, world, uneven) for r in range(world)]
            layers.append(Layer(world, tuple(rng.randint(0, m) for m in most), uneven))
        rest = Remaining(n, tuple(layers))
        assert rest.positions(np.arange(len(rest))).tolist() == model(n, layers)


def test_a_count_beyond_a_share_is_refused_naming_the_rank():
    with pytest.raises(StateError, match="rank 1 of 2: position 6 is beyond its share of the epoch \\(5"):
        Remaining(10, (Layer(2, (5, 6), "none"),))


def test_layers_are_run_length_json_and_malformed_ones_are_refused():
    layer = Layer(64, (7,) * 60 + (8,) * 4, "pad")
    text = json.dumps(layer.to_json())
    assert len(text) < 60 and Layer.from_json(json.loads(text)) == layer
    huge = {"world": 10**12, "counts": [[0, 10**12]], "uneven": "none"}  # refused, never expanded
    for bad in (
        {"world": 2, "counts": [[1, 3]], "uneven": "pad"},
        {"world": 2},
        {"world": 1, "counts": [[1, 1]]},
        huge,
    ):
        with pytest.raises(StateError, match="'base'"):
            Layer.from_json(bad)
