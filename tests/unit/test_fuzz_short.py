"""The short CI run of bench/fuzz_inputs.py: 10,000 mutated inputs per target, 0 unexpected exceptions
(the long runs' figures are in docs/reliability.md)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fuzz_inputs  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(fuzz_inputs.TARGETS))
def test_ten_thousand_inputs_raise_only_the_documented_errors(target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model's recipe warnings
        assert fuzz_inputs.run(target, 10_000, seed=1) == 0
