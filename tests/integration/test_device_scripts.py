"""bench/run_device.sh as far as a CPU machine runs it (tests and benchmarks skipped): wheels installed
to a side folder on PYTHONPATH stay visible, and it says which optional packages the GPU tests find."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc_health
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # the script imports torch and megatron-core
REPO = Path(__file__).resolve().parents[2]


def test_run_device_keeps_a_side_folder_on_pythonpath_and_lists_optional_packages(tmp_path):
    # A real package installed to a side folder (as `pip install --target` leaves it) shadows the
    # environment's copy: the script must import it from there.
    side = tmp_path / "site"
    site_packages = Path(grpc_health.__file__).parents[1]
    shutil.copytree(Path(grpc_health.__file__).parent, side / "grpc_health")
    for info in site_packages.glob("grpcio_health_checking-*.dist-info"):
        shutil.copytree(info, side / info.name)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this interpreter
        "PYTHONPATH": str(side),
        "OUT": str(tmp_path / "out"),
        "SKIP_TESTS": "1",
        "SKIP_BENCH": "1",
    }
    res = subprocess.run(
        ["bash", "bench/run_device.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    report = (tmp_path / "out" / "packages.txt").read_text()
    assert report in res.stdout
    assert re.search(rf"^optional package grpc_health: found, [0-9.]+ in {re.escape(str(side))}$", report, re.M), report
    wanted = set()
    for test in (REPO / "tests" / "gpu").glob("*.py"):
        wanted |= set(re.findall(r'importorskip\("([^"]+)"\)', test.read_text()))
    listed = set(re.findall(r"^optional package (\S+): (?:found|missing)", report, re.M))
    assert "triton" in wanted and listed == wanted
