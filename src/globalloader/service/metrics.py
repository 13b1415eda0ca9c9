"""The server's status as Prometheus metrics (`/metrics` of `globalloader status --web`).

A custom `prometheus_client` collector: each scrape asks the server for its status and turns it
into metric families, so the numbers are the server's own at that moment and nothing is kept in
between. Names and labels are stable (the table is in docs/observe.md); per-job metrics carry
`job_name` and `pid` (not `job`, which Prometheus itself sets to the scrape job), and `job_id`,
the server's number for the job, which makes every series unique by construction: two Loaders
of one process (train and val) have the same pid and often the same name, and Prometheus
refuses a whole scrape with a duplicate series. Counters come from the server's running
totals, so `rate()` gives per-second figures and a server restart shows as a counter reset,
which Prometheus handles. A server that does not answer gives
`globalloader_server_up 0` and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from globalloader._extras import require
from globalloader.errors import GlobalLoaderError

JOB_LABELS = ("job_name", "pid", "job_id")

# (name, help, where in the status): counters get `_total` from prometheus_client.
SERVER_GAUGES = (
    ("globalloader_server_uptime_seconds", "Seconds since the server started", ("uptime_s",)),
    ("globalloader_decode_workers", "Decode worker processes of the server", ("workers",)),
    ("globalloader_pool_capacity_bytes", "Size of the shared memory pool", ("pool", "capacity")),
    ("globalloader_pool_used_bytes", "Bytes of the pool holding samples", ("pool", "used")),
    ("globalloader_pool_samples", "Samples in the pool", ("pool", "samples")),
    ("globalloader_pool_referenced_samples", "Samples in the pool some job holds", ("pool", "referenced")),
    ("globalloader_pool_cached_samples", "Samples in the pool no job holds (kept for reuse)", ("pool", "cached")),
    ("globalloader_jobs", "Jobs connected to the server", ()),
)
SERVER_COUNTERS = (
    ("globalloader_requests", "Samples the jobs asked for", ("requests",)),
    ("globalloader_decodes", "Samples the decode workers loaded", ("decodes",)),
    ("globalloader_decodes_saved", "Samples served without a decode of their own", ("decodes_saved",)),
    ("globalloader_decode_seconds", "Seconds decode workers spent loading, summed over workers", ("decode_s",)),
    ("globalloader_decode_worker_restarts", "Decode workers replaced after they died", ("worker_restarts",)),
    (
        "globalloader_decode_space_requests",
        "Loads whose decode worker had to ask the server for pool space (a round trip while it waits)",
        ("space_requests",),
    ),
    ("globalloader_pool_hits", "Requests served from samples already in the pool", ("pool", "hits")),
    ("globalloader_pool_evictions", "Samples evicted from the pool to make room", ("pool", "evictions")),
)
JOB_GAUGES = (
    ("globalloader_job_samples_per_second", "Samples the job consumed per second, last few seconds", "samples_per_s"),
    ("globalloader_job_wait_share", "Share of its loop's time the job waited for data, last few seconds", "wait_share"),
    ("globalloader_job_followed_share", "Share of the job's samples another job had loaded first", "followed_share"),
    ("globalloader_job_consumed_samples", "Samples the job consumed this epoch", "consumed"),
    ("globalloader_job_set_samples", "Samples in the job's set this epoch", "size"),
    ("globalloader_job_epoch", "The job's epoch", "epoch"),
)
JOB_COUNTERS = (
    ("globalloader_job_loop_wait_seconds", "Seconds the job's loop waited for data", "loop_wait_s"),
    ("globalloader_job_loop_busy_seconds", "Seconds the job's loop spent in its own body", "loop_busy_s"),
)
# The object-storage cache, when the server's status has a "cache" section: these fields are
# counters; any other number in it is exported as a gauge `globalloader_cache_<field>`.
CACHE_COUNTERS = {
    "downloaded_bytes": ("globalloader_cache_downloaded_bytes", "Bytes the cache downloaded from storage"),
    "hits": ("globalloader_cache_hits", "Reads the cache served without a download"),
    "misses": ("globalloader_cache_misses", "Reads the cache had to download"),
}


def _field(status: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = status
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class StatusCollector:
    """Collects one status from `fetch` per scrape (a callable that may raise GlobalLoaderError)."""

    def __init__(self, fetch: Callable[[], dict[str, Any]]) -> None:
        self._fetch = fetch

    def describe(self) -> list[Any]:
        return []  # the families depend on the status: nothing is described up front

    def collect(self) -> Iterator[Any]:
        core = require("prometheus_client.core", "service")
        try:
            status = self._fetch()
        except GlobalLoaderError:
            status = None
        yield core.GaugeMetricFamily(
            "globalloader_server_up", "1 when the server answered this scrape", value=0 if status is None else 1
        )
        if status is None:
            return
        status = {**status, "pool": {"hits": 0, "evictions": 0, **status.get("pool", {})}}  # counted from the first
        jobs = status.get("jobs", [])
        for kind, specs in ((core.GaugeMetricFamily, SERVER_GAUGES), (core.CounterMetricFamily, SERVER_COUNTERS)):
            for name, help_text, path in specs:
                value = float(len(jobs)) if not path else _field(status, path)  # no path: the job count
                if value is not None:
                    yield kind(name, help_text, value=value)
        for kind, job_specs in ((core.GaugeMetricFamily, JOB_GAUGES), (core.CounterMetricFamily, JOB_COUNTERS)):
            for name, help_text, key in job_specs:
                family = kind(name, help_text, labels=JOB_LABELS)
                for job in jobs:
                    value = _field(job, (key,))
                    if value is not None:
                        family.add_metric([str(job["name"]), str(job["pid"]), str(job["id"])], value)
                yield family
        yield from self._cache(core, status.get("cache"))

    @staticmethod
    def _cache(core: Any, cache: Any) -> Iterator[Any]:
        if not isinstance(cache, dict):
            return
        for key in sorted(cache):
            value = _field(cache, (key,))
            if value is None:
                continue
            if key in CACHE_COUNTERS:
                name, help_text = CACHE_COUNTERS[key]
                yield core.CounterMetricFamily(name, help_text, value=value)
            else:
                name = "globalloader_cache_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                yield core.GaugeMetricFamily(name, f"The object-storage cache's {key!r}", value=value)


def exposition(fetch: Callable[[], dict[str, Any]]) -> tuple[bytes, str]:
    """(body, content type) of one scrape in the Prometheus text format."""
    client = require("prometheus_client", "service")
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(fetch))
    return client.generate_latest(registry), client.CONTENT_TYPE_LATEST
