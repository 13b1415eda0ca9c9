"""The demo's third act on a real local S3 server: three jobs, without and with the machine cache."""

from __future__ import annotations

import pytest

from globalloader.demo.remote import JOBS, act_three


@pytest.mark.slow
@pytest.mark.integration
def test_three_jobs_download_the_shards_once_with_the_machine_cache(capsys: pytest.CaptureFixture[str]) -> None:
    result = act_three(images=120, workers=1, runs=1)
    assert result is not None
    dataset = result["dataset_bytes"]
    without, with_cache = result["without the cache"], result["with the machine cache"]
    assert without["samples"] == with_cache["samples"] == [120] * JOBS
    assert without["bytes"] >= JOBS * dataset  # each job downloads every shard at least once
    assert with_cache["bytes"] <= 1.02 * dataset  # one download for the machine
    shown = capsys.readouterr().out
    assert "act 3: 3 jobs at once" in shown and "with the machine cache" in shown
