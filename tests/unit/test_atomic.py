"""trainer.atomic on a real full disk (a 256 KiB tmpfs; root only, skipped otherwise) and
broker.outage.outage_in, the rule that finds the Redis outage behind a service's last error."""

from __future__ import annotations

import errno
import subprocess

import pytest
import torch

from broker.outage import RedisOutage, outage_in
from trainer.atomic import stale_temporaries, write_atomically
from trainer.publisher import PublishError


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_write_that_fills_the_disk_keeps_the_old_file_and_leaves_no_temporary(small_disk):
    path = small_disk / "step-000001.pt"
    write_atomically(path, lambda f: torch.save({"step": 1, "w": torch.arange(100)}, f))
    assert torch.load(path, weights_only=True)["step"] == 1
    with pytest.raises(OSError) as e:  # torch.save's writer says RuntimeError("unexpected pos"): the OSError is kept
        write_atomically(path, lambda f: torch.save({"step": 2, "w": torch.zeros(200_000)}, f))
    assert e.value.errno == errno.ENOSPC
    assert torch.load(path, weights_only=True)["step"] == 1  # the old content, whole
    assert stale_temporaries(small_disk) == []


def test_other_errors_of_the_writer_are_raised_as_they_are(tmp_path):
    path = tmp_path / "x.pt"
    with pytest.raises(ZeroDivisionError):
        write_atomically(path, lambda f: 1 / 0)
    assert not path.exists() and stale_temporaries(tmp_path) == []
    (tmp_path / "step-000002.pt.tmp").write_bytes(b"cut short")  # a process killed mid-write
    assert stale_temporaries(tmp_path) == [tmp_path / "step-000002.pt.tmp"]


def _raised(make):
    try:
        make()
    except BaseException as e:  # the test inspects whatever came out
        return e
    raise AssertionError("nothing raised")


def _publish_failed():
    try:
        raise RedisOutage("redis unreachable for 3.0s")
    except RedisOutage as e:
        raise PublishError("publishing policy version 4 failed") from e


def _bug_in_a_finally():
    try:
        raise RedisOutage("redis unreachable for 3.0s")
    finally:
        raise KeyError("a bug while unwinding")


def test_outage_in_finds_the_outage_behind_the_last_error():
    outage = RedisOutage("redis unreachable for 3.0s")
    assert outage_in(outage) is outage
    assert isinstance(outage_in(_raised(_publish_failed)), RedisOutage)  # through __cause__
    in_finally = _raised(_bug_in_a_finally)
    assert outage_in(in_finally) is None and isinstance(outage_in(in_finally, context=True), RedisOutage)
    group = ExceptionGroup("tasks", [ValueError("x"), outage])
    assert outage_in(group) is None and outage_in(group, context=True) is outage
    assert outage_in(ValueError("not Redis"), context=True) is None
    assert outage_in(None) is None
