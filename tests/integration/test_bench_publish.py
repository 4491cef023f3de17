"""bench/bench_publish.py runs end to end on small inputs: the CUDA run's code path (the QAT cache
refill of a real model, here the tiny preset on the CPU) and the synthetic one, every section passing
(the H200 run happens once, so API drift must show up here first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_publish  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "argv",
    [
        ["--source", "qat", "--preset", "tiny", "--layers", "2", "--versions", "3"],
        ["--source", "synthetic", "--bytes", "3e7", "--versions", "3", "--threads", "2"],
    ],
    ids=["qat-tiny", "synthetic"],
)
def test_bench_publish_runs_every_section(argv, capsys):
    assert bench_publish.main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "skipped" not in out
    assert "framed manifest's checksums equal build_manifest's: True" in out
    assert "quantize -> manifest -> servable" in out and "target >= 8 GB/s" in out
    assert "worker fetch of 8 tensors" in out and "baseline: sha256" in out
    assert ("quantize (the QAT cache refill" in out) == (argv[1] == "qat")
