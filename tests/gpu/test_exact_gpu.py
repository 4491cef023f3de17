"""Exact mode on CUDA (loop.exact with rollout.device and trainer.device cuda, trainer.dtype float32):
the worker's model engine on the GPU, batched continuously, records log-probs equal bit for bit to the
trainer's recompute under the current weights, under the retained version and to its training
forward, for bf16, int4_qat and nvfp4_moe, with and without routing replay; with exact off some
token differs. The comparison is tests/exact_compare.py's, which tests/unit/test_exact_mode.py runs
on the CPU. Device machine only (bench/run_device.sh)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

from exact_compare import compare  # noqa: E402  (tests/ is on PYTHONPATH in bench/run_device.sh)


@pytest.mark.parametrize(("recipe", "temperature"), [("bf16", 0.7), ("int4_qat", 1.0), ("nvfp4_moe", 1.0)])
def test_exact_rollout_logprobs_equal_the_recompute_bitwise_on_cuda(recipe, temperature):
    tokens, equal_prox, equal_retained = compare(recipe, exact=True, temperature=temperature, device="cuda")
    assert tokens >= 60
    assert equal_prox == tokens and equal_retained == tokens, (tokens, equal_prox, equal_retained)


def test_exact_mode_with_routing_replay_on_cuda():
    tokens, equal_prox, equal_retained = compare("nvfp4_moe", exact=True, temperature=1.0, routes=True, device="cuda")
    assert equal_prox == tokens and equal_retained == tokens, (tokens, equal_prox, equal_retained)


def test_without_exact_mode_some_token_differs_on_cuda():
    tokens, equal_prox, equal_retained = compare("nvfp4_moe", exact=False, temperature=1.0, device="cuda")
    assert equal_prox < tokens, (tokens, equal_prox, equal_retained)
