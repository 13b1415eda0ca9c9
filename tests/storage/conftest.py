"""Real object-store servers on free loopback ports, each behind a fresh fault proxy per test:
moto for S3, `gcp-storage-emulator` for GCS, Azurite for Azure Blob. Every server started is
stopped, whatever the tests did. An emulator that is not installed skips its tests locally (with
the command that installs it) and fails them under CI (CI=true), where .ci/run installs them."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from globalloader import storage
from globalloader.demo.s3 import FaultProxy, MotoServer, new_bucket, options

# gcsfs probes each bucket over gRPC for zonal/HNS support first (read at `import gcsfs`): against
# the emulator every probe waits a minute before falling back.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

# Azurite: where .ci/run installs it (`npm install --prefix tests/.node azurite`), or $AZURITE_BLOB.
AZURITE = os.environ.get("AZURITE_BLOB") or str(
    pathlib.Path(__file__).parents[1] / ".node" / "node_modules" / ".bin" / "azurite-blob"
)
# Azurite's well-known development account (documented by Azure; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
START_DEADLINE = 60.0  # seconds for an emulator to accept connections


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def proxy(moto_server: MotoServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_server.port)
    yield proxy
    proxy.stop()


@pytest.fixture
def s3(proxy: FaultProxy) -> dict[str, Any]:
    """A fresh bucket and the storage_options that reach it through the proxy."""
    return {"bucket": new_bucket(proxy.url), "options": options(proxy.url), "proxy": proxy}


class Emulator:
    """An emulator's process listening on `port` of loopback; `stop()` ends it (and waits)."""

    def __init__(self, name: str, command: list[str], port: int, log: pathlib.Path) -> None:
        self.name, self.port = name, port
        with log.open("wb") as out:  # a file, not a pipe: a chatty server never blocks on it
            self._process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_DEADLINE
        while not _accepts(port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start on port {port}: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)


def _free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return int(free.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _missing(what: str, install: str) -> None:
    """Fail under CI (the emulators are part of its run), else skip naming the install command."""
    message = f"{what} is not installed: {install}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    try:
        import gcp_storage_emulator  # noqa: F401 - only whether it is installed
    except ImportError:
        _missing("gcp-storage-emulator", "pip install -e '.[test]'")
    port = _free_port()
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    server = Emulator("gcp-storage-emulator", [*command, "--in-memory"], port, log)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    if not (os.access(AZURITE, os.X_OK) and shutil.which("node")):
        _missing("Azurite", "npm install --prefix tests/.node azurite (or set AZURITE_BLOB to azurite-blob)")
    port = _free_port()
    folder = tmp_path_factory.mktemp("azurite")
    command = [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(folder)]
    server = Emulator("Azurite", [*command, "--silent", "--skipApiVersionCheck", "--loose"], port, folder / "log")
    yield server
    server.stop()


@pytest.fixture
def gcs(gcs_server: Emulator) -> Iterator[dict[str, Any]]:
    """A fresh GCS bucket and the storage_options that reach it through a fault proxy."""
    proxy = FaultProxy(gcs_server.port)
    opts = {"endpoint_url": proxy.url, "token": "anon", "project": "test"}
    bucket = f"gl-{uuid.uuid4().hex[:12]}"
    storage.Store(opts).filesystem(f"gs://{bucket}")[0].mkdir(bucket)
    # "downloads": the start of the paths of its objects' bodies (the JSON API's are elsewhere)
    yield {
        "root": f"gs://{bucket}",
        "options": opts,
        "proxy": proxy,
        "downloads": f"/download/storage/v1/b/{bucket}/o/",
    }
    proxy.stop()


@pytest.fixture
def azure(azurite_server: Emulator) -> Iterator[dict[str, Any]]:
    """A fresh Azure Blob container and the storage_options that reach it through a fault proxy."""
    proxy = FaultProxy(azurite_server.port)
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint={proxy.url}/{AZURITE_ACCOUNT};"
    )
    opts = {"connection_string": connection}
    container = f"gl-{uuid.uuid4().hex[:12]}"
    storage.Store(opts).filesystem(f"az://{container}")[0].mkdir(container)
    yield {
        "root": f"az://{container}",
        "options": opts,
        "proxy": proxy,
        "downloads": f"/{AZURITE_ACCOUNT}/{container}/",
    }
    proxy.stop()
