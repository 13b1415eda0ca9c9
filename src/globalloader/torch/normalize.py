"""Normalize a uint8 image batch on its device: the last step of a `normalize=False` pipeline.

A loader that ships uint8 pixels moves a quarter of the bytes of float32 through shared memory,
pinning and the host-to-device copy, and the accelerator does the (x / 255 - mean) / std in
microseconds. `normalize_batch` is that step, with the same constants as `vision.normalize`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from globalloader._extras import require
from globalloader.errors import ArgumentError
from globalloader.vision import IMAGENET_MEAN, IMAGENET_STD

torch = require("torch", "torch")


def normalize_batch(
    batch: Any,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    *,
    chw: bool = False,
    dtype: Any = None,
) -> Any:
    """`(batch / 255 - mean) / std` of a uint8 image tensor, on the tensor's own device.

    `batch` is (..., H, W, C), or (..., C, H, W) with `chw` (the layout the vision transforms
    give with the same flag), e.g. a collated batch from `RandomResizedCropFlipNormalize(
    normalize=False)` moved to the GPU. The result has the same shape, in `dtype` (float32 by
    default; float16 or bfloat16 halve the memory), computed as one cast and one fused
    multiply-add with per-channel scale and offset.
    """
    if not isinstance(batch, torch.Tensor) or batch.dtype != torch.uint8 or batch.ndim < 3:
        got = (
            f"{batch.dtype} of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else type(batch).__name__
        )
        raise ArgumentError(f"normalize_batch: expected a uint8 image tensor of 3 or more dims, got {got}")
    dtype = torch.float32 if dtype is None else dtype
    if not dtype.is_floating_point:
        raise ArgumentError(f"normalize_batch: dtype must be a floating point type, got {dtype}")
    channels = batch.shape[-3] if chw else batch.shape[-1]
    mean_t = torch.tensor([float(m) for m in mean], dtype=torch.float64)
    std_t = torch.tensor([float(s) for s in std], dtype=torch.float64)
    if mean_t.numel() != channels or std_t.numel() != channels:
        raise ArgumentError(
            f"normalize_batch: {channels} channels ({'C of CHW' if chw else 'C of HWC'}, shape "
            f"{tuple(batch.shape)}) but mean has {mean_t.numel()} and std {std_t.numel()} values"
        )
    if bool((std_t <= 0).any()):
        raise ArgumentError(f"normalize_batch: std must be positive, got {tuple(std)}")
    # x * scale + offset == (x / 255 - mean) / std, constants made in float64 then cast once.
    shape = (channels, 1, 1) if chw else (channels,)
    scale = (1.0 / (255.0 * std_t)).to(dtype=dtype, device=batch.device).reshape(shape)
    offset = (-mean_t / std_t).to(dtype=dtype, device=batch.device).reshape(shape)
    return torch.addcmul(offset, batch.to(dtype), scale)
