"""globalloader: a fast, resumable data loader that shares loading across training jobs.

Typical use:

    import globalloader as gl
    ds = gl.Dataset(gl.ImageFolder("train")).shuffle(seed=0).map(decode).batch(256)
    with gl.Loader(ds, workers=8) as loader:
        for batch in loader: ...
"""

from globalloader import errors, sources
from globalloader._version import __version__ as __version__
from globalloader.dataset import Dataset, collate
from globalloader.execution import Loader, write_shards
from globalloader.sources import (
    MDS,
    ArrowCopy,
    DecodeFields,
    Files,
    HFDataset,
    ImageFolder,
    LitData,
    Parquet,
    ParquetWriter,
    TarShards,
    TarWriter,
    from_sequence,
)

__all__ = [  # noqa: RUF022  # sorted as sorted() sorts (ruff would put the all-caps MDS first)
    "ArrowCopy",
    "Dataset",
    "DecodeFields",
    "Files",
    "HFDataset",
    "ImageFolder",
    "LitData",
    "Loader",
    "MDS",
    "Parquet",
    "ParquetWriter",
    "TarShards",
    "TarWriter",
    "collate",
    "errors",
    "from_sequence",
    "sources",
    "write_shards",
]
assert __all__ == sorted(__all__)
