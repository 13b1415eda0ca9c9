"""globalloader.torch.normalize_batch: uint8 batches normalized as vision.normalize does, on device."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import globalloader.torch as gt
from globalloader import vision
from globalloader.errors import ArgumentError


@pytest.mark.parametrize("chw", [False, True])
def test_normalize_batch_equals_the_transforms_own_normalize(chw):
    images = np.random.default_rng(0).integers(0, 256, (4, 20, 30, 3), dtype=np.uint8)
    expected = np.stack([vision.normalize(image, chw=chw) for image in images])
    batch = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)) if chw else images)
    out = gt.normalize_batch(batch, chw=chw)
    assert out.dtype == torch.float32 and out.shape == batch.shape and out.device == batch.device
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=2e-6)
    assert batch.dtype == torch.uint8  # the input is left alone


def test_a_collated_normalize_false_batch_normalizes_to_the_float_pipeline():
    y, x = np.mgrid[0:120, 0:160]
    buffer = io.BytesIO()
    Image.fromarray(np.stack([y * 2, x, (x + y) % 256], 2).astype(np.uint8)).save(buffer, "JPEG")
    record = {"jpg": buffer.getvalue()}
    raw = vision.RandomResizedCropFlipNormalize(size=24, chw=True, normalize=False)
    float_ = vision.RandomResizedCropFlipNormalize(size=24, chw=True)
    batch = torch.from_numpy(np.stack([raw(record, rng=np.random.default_rng(s))["jpg"] for s in range(3)]))
    expected = np.stack([float_(record, rng=np.random.default_rng(s))["jpg"] for s in range(3)])
    np.testing.assert_allclose(gt.normalize_batch(batch, chw=True).numpy(), expected, rtol=0, atol=2e-6)


def test_custom_statistics_and_half_precision():
    batch = torch.full((2, 3, 3, 1), 255, dtype=torch.uint8)
    out = gt.normalize_batch(batch, mean=[0.5], std=[0.25], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.all((out.float() - 2.0).abs() < 0.02)  # bf16: 8 bits


def test_wrong_inputs_are_argument_errors():
    with pytest.raises(ArgumentError, match="uint8"):
        gt.normalize_batch(torch.zeros(2, 4, 4, 3))
    with pytest.raises(ArgumentError, match="uint8"):
        gt.normalize_batch(np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(ArgumentError, match=r"4 channels .*mean has 3"):
        gt.normalize_batch(torch.zeros(2, 4, 4, 4, dtype=torch.uint8))
    with pytest.raises(ArgumentError, match="std must be positive"):
        gt.normalize_batch(torch.zeros(1, 2, 2, 1, dtype=torch.uint8), mean=[0.5], std=[0.0])
    with pytest.raises(ArgumentError, match="floating point"):
        gt.normalize_batch(torch.zeros(1, 2, 2, 3, dtype=torch.uint8), dtype=torch.int32)
