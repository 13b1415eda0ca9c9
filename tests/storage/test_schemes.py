"""gs:// and az:// go through the same layer as s3://: their fsspec client is made from the
source's storage_options, once per process, and their objects are read through the machine cache.
Only construction is tested: no GCS or Azure server runs on loopback here, so nothing is read."""

from __future__ import annotations

import pytest

from globalloader import storage

AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.mark.parametrize(
    ("url", "options", "client", "attribute", "value"),
    [
        (
            "gs://bucket/dir/shard-0.tar",
            {"token": "anon", "project": "my-project"},
            "GCSFileSystem",
            "project",
            "my-project",
        ),
        (
            "az://container/dir/shard-0.tar",
            {"account_name": "devstoreaccount1", "account_key": AZURITE_KEY},
            "AzureBlobFileSystem",
            "account_name",
            "devstoreaccount1",
        ),
    ],
)
def test_other_object_stores_construct_from_storage_options(
    url: str, options: dict[str, str], client: str, attribute: str, value: str
) -> None:
    store = storage.Store(options)
    fs, path = store.filesystem(url)
    assert any(cls.__name__ == client for cls in type(fs).__mro__)
    assert getattr(fs, attribute) == value and path == url.split("://", 1)[1]
    again, other = store.filesystem(url.replace("shard-0", "shard-1"))
    assert again is fs and other.endswith("shard-1.tar")  # one client per process and options
    assert store.cached(url)  # read through the machine cache like s3://
