"""TorchShufflingDataset: the global per-epoch shuffle as PyTorch tensors (features, label).

The same shuffle as `ShufflingDataset`; each batch is turned into tensors by a feature/label
spec, so a training loop reads `for features, label in ds:`. Tensors are copies (the batches
are read-only views of Ray's shared memory), which also lets Ray free that memory at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from globalloader._extras import require
from globalloader.errors import ArgumentError
from globalloader.ray.dataset import ShufflingDataset

if TYPE_CHECKING:
    import torch
else:
    torch = require("torch", "torch")


class TorchShufflingDataset(torch.utils.data.IterableDataset):
    """Globally shuffled batches as tensors, for one data-parallel PyTorch trainer.

    Arguments up to `drop_last`, and the keyword arguments after the spec, are those of
    `ShufflingDataset` (see it for the row policy, errors and the batch queue's lifetime).
    Spec:
    - `feature_columns`: one column name (features keep the column's row shape) or a list of
      names (each column flattened per row, then concatenated along dim 1: shape (batch, F)).
    - `feature_types`: a torch dtype for all feature columns, or one per column (default: the
      column's own type for one column, float32 for a list).
    - `label_column` / `label_type`: the label tensor and its dtype (default: the column's own);
      without a label column the dataset yields only the features tensor.
    Columns of bytes or str cannot become tensors: ArgumentError names the column. Iterate it
    directly (or in `DataLoader(ds, batch_size=None)`): batches are already formed.
    """

    def __init__(
        self,
        data: Any,
        num_epochs: int,
        num_trainers: int,
        batch_size: int,
        rank: int,
        num_reducers: int | None = None,
        max_concurrent_epochs: int = 2,
        seed: int = 0,
        drop_last: bool = False,
        *,
        feature_columns: str | Sequence[str],
        feature_types: Any = None,
        label_column: str | None = None,
        label_type: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        single = isinstance(feature_columns, str)
        names = [feature_columns] if isinstance(feature_columns, str) else list(feature_columns)
        if not names or not all(isinstance(n, str) for n in names):
            raise ArgumentError(
                f"feature_columns must be a column name or a non-empty list of them, got {feature_columns!r}"
            )
        if label_column is not None and not isinstance(label_column, str):
            raise ArgumentError(f"label_column must be a column name or None, got {label_column!r}")
        types = (
            feature_types
            if isinstance(feature_types, (list, tuple))
            else ([feature_types if feature_types is not None or single else torch.float32] * len(names))
        )
        if len(types) != len(names) or not all(t is None or isinstance(t, torch.dtype) for t in types):
            raise ArgumentError(
                f"feature_types must be a torch dtype or one per feature column ({len(names)}), got {feature_types!r}"
            )
        if label_type is not None and not isinstance(label_type, torch.dtype):
            raise ArgumentError(f"label_type must be a torch dtype or None, got {label_type!r}")
        self._single = single
        self._features = list(zip(names, types, strict=True))
        self._label = (label_column, label_type)
        columns = names + ([label_column] if label_column and label_column not in names else [])
        kwargs.setdefault("columns", columns)
        self.dataset = ShufflingDataset(
            data,
            num_epochs,
            num_trainers,
            batch_size,
            rank,
            num_reducers,
            max_concurrent_epochs,
            seed,
            drop_last,
            **kwargs,
        )

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataset:
            yield self.to_tensors(batch)

    def to_tensors(self, batch: dict[str, np.ndarray]) -> Any:
        """One NumPy batch -> features tensor, or (features, label)."""
        if self._single:
            name, dtype = self._features[0]
            features = _tensor(batch, name, dtype)
        else:
            rows = len(batch[self._features[0][0]])
            features = torch.cat(
                [_tensor(batch, name, dtype).reshape(rows, -1) for name, dtype in self._features], dim=1
            )
        label_column, label_type = self._label
        if label_column is None:
            return features
        return features, _tensor(batch, label_column, label_type)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.dataset.load_state_dict(state)

    def close(self) -> None:
        self.dataset.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensor(batch: dict[str, np.ndarray], name: str, dtype: Any) -> Any:
    if name not in batch:
        raise ArgumentError(f"column {name!r} is not in the batch (it has {sorted(batch)})")
    values = batch[name]
    if values.dtype == object or values.dtype.kind in "SUV":
        raise ArgumentError(
            f"column {name!r} holds {values.dtype} values, which cannot become "
            "a tensor: pick numeric columns for features and labels"
        )
    tensor = torch.tensor(values)  # a copy: the batch is read-only shared memory
    return tensor if dtype is None else tensor.to(dtype)
