"""The `globalloader` command as a user runs it, through this interpreter (`python -m globalloader`)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import globalloader
from globalloader import cli


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "globalloader", *args], capture_output=True, text=True, check=check, timeout=600
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_demo_compares_loaders_then_jobs_independent_and_shared_as_medians_of_runs():
    out = run("demo", "--images", "48", "--batch-size", "8", "--shared-memory", "64M", "--runs", "3").stdout
    assert out.count("median (min-max) of 3 run(s)") == 2, out
    number = r"\d+\.\d+ \(\d+\.\d+-\d+\.\d+\)"
    assert re.search(rf"globalloader\s+{number}", out) and re.search(rf"torch DataLoader\s+{number}", out)
    assert re.search(
        r"globalloader / torch DataLoader: \d+\.\d\dx samples/s \(median of 3 paired runs; "
        r"min \d+\.\d\dx, max \d+\.\d\dx\)",
        out,
    ), out
    assert re.search(r"decodes\s+\d+ \(\d+-\d+\)\s+\d+ \(\d+-\d+\)", out), out
    assert re.search(r"all jobs done in \d+\.\d\dx the time \(median of 3 paired runs; min \d+\.\d\dx, max", out)


def test_version_is_one_fact_everywhere():
    from importlib.metadata import version

    assert run("--version").stdout.strip() == f"globalloader {globalloader.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", globalloader.__version__)
    assert version("globalloader") == globalloader.__version__  # the installed metadata reads the same source


def test_help_shows_every_default_and_the_environment():
    serve = run("serve", "--help").stdout
    assert "(default: 2G)" in serve and "GLOBALLOADER_SOCKET" in serve and "GLOBALLOADER_CACHE_DIR" in serve
    assert "server.sock" in serve and "one per core" in serve
    demo = " ".join(run("demo", "--help").stdout.split())
    for shown in (
        "worker processes per loader (and per job) (default: 2)",
        "samples per batch of the first act (default: 64)",
        "(default: 1000)",
        "(default: 256M)",
        "(default: 3)",
    ):
        assert shown in demo, shown
    for command in ("stop", "status"):
        assert "GLOBALLOADER_SOCKET" in run(command, "--help").stdout
    assert "GLOBALLOADER_CACHE_DIR" in run("--help").stdout


def test_every_option_has_help_and_its_default_is_shown_or_explained():
    parser = cli._parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps its sub-commands here
    for name, sub in {"": parser, **commands}.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if not action.option_strings or action.dest in ("help", "version"):
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            if action.default is not None and not isinstance(action.default, bool):
                assert f"(default: {action.default})" in text, f"{name} {action.option_strings[0]}"
            else:
                assert "default" in action.help or isinstance(action.default, bool), f"{name} {action.option_strings}"


def test_bad_arguments_are_one_clear_line():
    result = run("serve", "--memory", "lots", check=False)
    assert result.returncode != 0
    assert result.stderr.strip() == "globalloader: --memory: cannot read 'lots' as a size (examples: 512M, 4G)"
    runs = run("demo", "--runs", "0", "--no-shared", check=False)
    assert runs.returncode == 1 and runs.stderr.strip() == "globalloader: demo: runs must be an int >= 1, got 0"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--workers", "0"], "--workers must be >= 1, got 0"),
        (["--idle-exit", "-3"], "--idle-exit must be a number of seconds >= 0 (0: never), got -3.0"),
        (["--idle-exit", "nan"], "--idle-exit must be a number of seconds >= 0 (0: never), got nan"),
    ],
)
def test_serve_refuses_bad_numbers_before_starting(tmp_path, option, message):
    socket = tmp_path / "s.sock"
    result = run("serve", "--socket", str(socket), *option, check=False)
    assert result.returncode == 1 and result.stderr.strip() == f"globalloader: {message}"
    assert not socket.exists()


def test_stop_without_a_server_says_so(tmp_path):
    assert "no server runs" in run("stop", "--socket", str(tmp_path / "none.sock")).stdout


def image_folder(root, n: int = 12) -> dict[str, bytes]:
    images = {}
    for i in range(n):
        key = f"{'cat' if i % 2 else 'dog'}/img{i:02d}"
        images[key] = bytes([i]) * (100 + 37 * i)
        (root / f"{key}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (root / f"{key}.jpg").write_bytes(images[key])
    return images


def test_convert_an_image_folder_to_tar_then_parquet_then_tar(tmp_path):
    images = image_folder(tmp_path / "images")
    shards = tmp_path / "shards"
    result = run("convert", str(tmp_path / "images"), str(shards), "--workers", "2", "--maxcount", "5")
    assert (
        result.stdout.strip()
        == f"12 samples (image folder) from {tmp_path / 'images'}: 3 shards in {shards}/shard-%06d.tar"
    )
    read = list(globalloader.Dataset(globalloader.TarShards(str(shards / "*.tar"))).iterator())
    assert [r["__key__"] for r in read] == sorted(images)
    assert all(r["image"] == images[r["__key__"]] for r in read)
    assert cli.main(["convert", str(shards), str(tmp_path / "pq" / "part-%03d.parquet"), "--format", "parquet"]) == 0
    rows = list(globalloader.Dataset(globalloader.Parquet(str(tmp_path / "pq" / "*.parquet"))).iterator())
    assert [(r["image"], r["label"]) for r in rows] == [(r["image"], r["label"]) for r in read]
    assert cli.main(["convert", str(tmp_path / "pq"), str(tmp_path / "again"), "--maxsize", "1KB"]) == 0
    again = list(globalloader.Dataset(globalloader.TarShards(str(tmp_path / "again" / "*.tar"))).iterator())
    assert [(r["image"], r["label"]) for r in again] == [(r["image"], r["label"]) for r in read]
    # the same call again finds every shard finished and writes nothing
    before = {p.name: p.stat().st_mtime_ns for p in shards.iterdir()}
    assert cli.main(["convert", str(tmp_path / "images"), str(shards), "--maxcount", "5"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in shards.iterdir()} == before


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{missing}", "{out}"], "{missing}: no dataset globalloader can read is there"),
        (["{images}", "{out}/one.tar"], "needs a number field such as %06d"),
        (["{images}", "{out}", "--maxsize", "big"], "--maxsize must be a byte count such as 20GB"),
        (["{images}", "{out}", "--storage-options", "{{"], "convert: --storage-options is not JSON"),
    ],
)
def test_convert_refuses_with_one_clear_line(tmp_path, capsys, arguments, message):
    image_folder(tmp_path / "images", 2)
    paths = {"missing": tmp_path / "missing", "out": tmp_path / "out", "images": tmp_path / "images"}
    assert cli.main(["convert", *(a.format(**paths) for a in arguments)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("globalloader: ") and "\n" not in err and message.format(**paths) in err, err
    assert not (tmp_path / "out").exists()
