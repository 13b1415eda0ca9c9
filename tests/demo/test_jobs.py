"""globalloader.demo.jobs at a tiny size: real job processes, a real server, real shared memory."""

from __future__ import annotations

import os

import pytest

from globalloader.demo.jobs import JobSpec, overlapping_sets, run_jobs
from globalloader.errors import ArgumentError
from globalloader.synthetic import make_jpeg_folder

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("jpeg"), n=40, progress=False)


@pytest.mark.integration  # job processes, and in shared mode a server
def test_shared_jobs_decode_each_sample_once_and_independent_ones_once_per_job(root):
    specs = [JobSpec("all", range(40)), JobSpec("tail", range(10, 40), sleep=0.01)]
    shared = run_jobs(root, specs, "shared", workers=1, batch_size=8, memory="16M", progress=False)
    independent = run_jobs(root, specs, "independent", workers=1, batch_size=8, progress=False)
    assert f"gl-pool-{shared['server']['pid']}" not in os.listdir("/dev/shm"), "the run's server left its pool"
    for result in (shared, independent):
        assert [(j["name"], j["samples"]) for j in result["jobs"]] == [("all", 40), ("tail", 30)]
        assert all(j["exact_once"] for j in result["jobs"]), result["jobs"]
        assert result["samples"] == 70 and result["union"] == 40
        assert result["wall_s"] >= max(j["seconds"] for j in result["jobs"])
    assert independent["decodes"] == 70  # each job decodes its own set
    assert [j["decodes"] for j in independent["jobs"]] == [40, 30]
    assert shared["decodes"] <= 40 < independent["decodes"]
    assert shared["decodes_per_union"] == shared["decodes"] / 40
    assert shared["server"]["requests"] == 70
    assert shared["server"]["decodes_saved"] == 70 - shared["decodes"]
    assert shared["workers"] == {"per_job": 0, "server": 2, "total": 2}
    assert independent["workers"] == {"per_job": 1, "total": 2}
    assert all(0.0 <= j["followed_share"] <= 1.0 for j in shared["jobs"])


@pytest.mark.integration  # job processes, and in shared mode a server
def test_a_job_with_two_epochs_sees_its_set_once_per_epoch(root):
    result = run_jobs(
        root,
        [JobSpec("twice", range(0, 40, 3), epochs=2)],
        "shared",
        workers=1,
        batch_size=8,
        memory="16M",
        progress=False,
    )
    (job,) = result["jobs"]
    assert job["samples"] == 2 * 14 and job["exact_once"]
    assert result["decodes"] <= 2 * 14 and result["server"]["requests"] == 2 * 14


@pytest.mark.integration  # job processes, and in shared mode a server
def test_a_background_job_stops_once_the_foreground_jobs_are_done(root):
    specs = [JobSpec("slow", range(16), sleep=0.05), JobSpec("keeps-training", range(40), epochs=50, background=True)]
    result = run_jobs(root, specs, "independent", workers=1, batch_size=8, progress=False)
    slow, background = result["jobs"]
    assert slow["samples"] == 16 and slow["exact_once"]
    assert 0 < background["samples"] < 50 * 40, "the background job ran all its epochs"
    assert background["exact_once"], "a full epoch missed a sample, or the last one repeated one"
    assert background["epochs_done"] == background["samples"] / 40


def test_overlapping_sets_are_half_common_half_own_and_cover_the_dataset():
    sets = overlapping_sets(30, 2)
    assert [len(s) for s in sets] == [20, 20]
    assert set(sets[0]) & set(sets[1]) == set(range(10))
    assert set(sets[0]) | set(sets[1]) == set(range(30))
    four = overlapping_sets(50, 4)
    assert set().union(*four) == set(range(50)) and set.intersection(*map(set, four)) == set(range(10))
    with pytest.raises(ArgumentError, match="k >= 2"):
        overlapping_sets(10, 1)


def test_bad_arguments_name_what_is_wrong(root):
    with pytest.raises(ArgumentError, match="mode"):
        run_jobs(root, [JobSpec("a", range(4))], "magic")
    with pytest.raises(ArgumentError, match="distinct names"):
        run_jobs(root, [JobSpec("a", range(4)), JobSpec("a", range(4))], "independent")
    with pytest.raises(ArgumentError, match="indices"):
        JobSpec("empty", [])


def test_the_exact_once_check_catches_a_missing_or_repeated_sample():
    from globalloader.demo.jobs import _exact_once

    want = ["a", "b", "c"]
    assert _exact_once([["c", "a", "b"], ["b", "c", "a"]], want, background=False)
    assert not _exact_once([["c", "a", "a"]], want, background=False)
    assert not _exact_once([["c", "a"]], want, background=False)
    assert _exact_once([["c", "a", "b"], ["b"]], want, background=True)  # stopped mid-epoch
    assert not _exact_once([["c", "a"], ["b", "c", "a"]], want, background=True)  # only the last may be short
    assert not _exact_once([["c", "a", "b"], ["b", "b"]], want, background=True)
