"""The one-node Ray the module's tests share: a cluster of its own (whatever other Ray jobs run on
the machine), its workers keeping out of user caches, the module's functions sent by value."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
import ray.cloudpickle

from helpers import stop_ray


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    ray.cloudpickle.register_pickle_by_value(request.module)  # actors and chains defined in the test module
    cache = tmp_path_factory.mktemp("ray-cache")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
        runtime_env={"env_vars": {"GLOBALLOADER_CACHE_DIR": str(cache)}},
    )
    yield
    stop_ray()
