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
from globalloader.execution import Loader
from globalloader.sources import (
    ArrowCopy,
    DecodeFields,
    Files,
    ImageFolder,
    Parquet,
    TarShards,
    TarWriter,
    from_sequence,
)

__all__ = [
    "ArrowCopy",
    "Dataset",
    "DecodeFields",
    "Files",
    "ImageFolder",
    "Loader",
    "Parquet",
    "TarShards",
    "TarWriter",
    "collate",
    "errors",
    "from_sequence",
    "sources",
]
assert __all__ == sorted(__all__)
