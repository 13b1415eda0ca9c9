from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import check_resume

import globalloader as gl
import globalloader.torch as gt
from globalloader.errors import ArgumentError


class Squares(torch.utils.data.Dataset):
    """A map-style torch dataset of (image tensor, label) pairs, as users write them."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int):
        return torch.full((3, 4, 4), float(i)), i * i


def flatten(loader) -> list[int]:
    return [int(x) for _, labels in loader for x in labels]


def test_dataloader_matches_torch_batches_exactly_without_shuffle():
    ours = list(gt.DataLoader(Squares(), batch_size=8, num_workers=2))
    theirs = list(torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=0))
    assert len(ours) == len(theirs) == 7
    for (xa, ya), (xb, yb) in zip(ours, theirs):
        assert isinstance(xa, torch.Tensor) and xa.dtype == xb.dtype and torch.equal(xa, xb)
        assert ya.dtype == yb.dtype and torch.equal(ya, yb)


def test_dataloader_shuffle_is_seeded_and_independent_of_workers():
    orders = [
        flatten(gt.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=w, drop_last=True, seed=3))
        for w in (0, 2)
    ]
    assert orders[0] == orders[1] and len(orders[0]) == 48
    assert orders[0] != sorted(orders[0])
    other_seed = flatten(gt.DataLoader(Squares(), batch_size=4, shuffle=True, drop_last=True, seed=4))
    assert other_seed != orders[0]


def test_dataloader_resumes_mid_epoch():
    check_resume(lambda: gt.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2), 3)


def test_dataloader_refuses_unsupported_arguments_by_name():
    with pytest.raises(ArgumentError, match="sampler"):
        gt.DataLoader(Squares(), sampler=[1, 2])


def test_iterable_dataset_and_collate_give_tensors():
    ds = gl.Dataset(gl.from_sequence([{"x": np.ones(2) * i, "y": i} for i in range(6)])).batch(3)
    with gl.Loader(ds, workers=1) as loader:
        batches = list(gt.IterableDataset(loader))
    assert all(isinstance(b["x"], torch.Tensor) and b["x"].shape == (3, 2) for b in batches)
    assert torch.equal(batches[1]["y"], torch.tensor([3, 4, 5]))
    out = gt.collate([{"x": np.zeros(2), "name": "a"}, {"x": np.ones(2), "name": "b"}])
    assert torch.equal(out["x"], torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert out["name"] == ["a", "b"]
