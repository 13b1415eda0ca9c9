"""The single-job workload: a synthetic JPEG folder, the ImageNet train transform, one epoch.

Shared by `globalloader demo` (its first act) and `benchmarks/single_job.py`, so the figures a
user sees and the ones the benchmark records come from the same code. The torch baseline runs the very same
source and transform functions (with the same per-sample seeds) inside
`torch.utils.data.DataLoader`, so the difference measured is the loader's alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from tqdm.auto import tqdm

from globalloader._paths import cache_dir
from globalloader._seeding import generator
from globalloader.dataset.chain import Dataset
from globalloader.execution.loader import Loader
from globalloader.sources import ImageFolder
from globalloader.synthetic import make_jpeg_folder
from globalloader.vision import RandomResizedCropFlipNormalize


def demo_images(n: int, progress: bool = True) -> Path:
    """The synthetic 500x375 JPEG folder of `n` images in the cache folder (made once)."""
    return make_jpeg_folder(cache_dir("demo", f"jpeg-{n}"), n=n, progress=progress)


def train_chain(root: Path, batch_size: int = 64, seed: int = 0) -> Dataset:
    """Decode + random resized crop to 224 + flip + normalize, shuffled, batched."""
    return (
        Dataset(ImageFolder(root))
        .seed(seed)
        .shuffle(seed)
        .map(RandomResizedCropFlipNormalize(size=224), name="decode+augment")
        .batch(batch_size)
    )


def train_step(images: Any) -> float:
    """A stand-in for a training step that reads the whole batch once (as a model's first layer does)."""
    return float(images.mean())


class _TorchImages:
    """The same source and transform as `train_chain`, as a map-style torch Dataset."""

    def __init__(self, root: Path, seed: int, epoch: int) -> None:
        self.source, self.seed, self.epoch = ImageFolder(root), seed, epoch
        self.transform = RandomResizedCropFlipNormalize(size=224)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = generator(self.seed, self.epoch, index, 0)
        return self.transform(self.source[index], rng=rng)


def _epoch(batches: Iterable[Any], total: int, label: str, progress: bool) -> dict[str, float]:
    start = time.perf_counter()
    first = None
    samples = 0
    bar = tqdm(total=total, desc=label, unit="img", disable=not progress, leave=False)
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        train_step(batch["image"])
        n = len(batch["label"])
        samples += n
        bar.update(n)
    bar.close()
    seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds, "first_batch_s": first or 0.0}


def run_globalloader(
    root: Path, workers: int = 2, batch_size: int = 64, epoch: int = 0, progress: bool = True
) -> dict[str, float]:
    """One epoch through `gl.Loader`, workers started inside the timed region (like torch's)."""
    chain = train_chain(root, batch_size)
    with Loader(chain, workers=workers, prefetch=2 * workers) as loader:
        loader.set_epoch(epoch)
        return _epoch(loader, len(chain.source), "globalloader", progress)


def run_torch(
    root: Path, workers: int = 2, batch_size: int = 64, epoch: int = 0, progress: bool = True, loader_class: Any = None
) -> dict[str, float]:
    """One epoch through `torch.utils.data.DataLoader` (or `loader_class`, a drop-in for it) with
    the same functions."""
    import torch

    data = _TorchImages(root, seed=0, epoch=epoch)
    generator = torch.Generator().manual_seed(epoch)
    cls = loader_class or torch.utils.data.DataLoader
    loader = cls(
        cast("torch.utils.data.Dataset[dict[str, Any]]", data),  # duck-typed: torch is imported lazily
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=generator,
    )
    label = "torch DataLoader" if loader_class is None else f"{cls.__module__}.{cls.__name__}"
    return _epoch(loader, len(data), label, progress)
