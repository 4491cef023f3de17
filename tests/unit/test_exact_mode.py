"""Exact mode end to end on the CPU: the rollout's recorded log-probs equal the trainer's recompute
bit for bit (every completion token, counted) for bf16, int4_qat and nvfp4_moe (fp8_block and mxfp8
marked slow), over prompt groups of mixed lengths batched continuously, with and without routing
replay; with exact off they do not (tests/exact_compare.py; tests/gpu/test_exact_gpu.py on CUDA).
Plus `loop.exact`'s config rules."""

from __future__ import annotations

import pytest
from exact_compare import compare  # tests/exact_compare.py (conftest puts tests/ on sys.path)

from policy.loop import AsyncConfig
from tandem.config import from_dict


@pytest.mark.parametrize(
    ("recipe", "temperature"),
    [
        ("bf16", 0.7),
        ("int4_qat", 1.0),
        ("nvfp4_moe", 1.0),
        pytest.param("fp8_block", 1.0, marks=pytest.mark.slow),  # per-K-block scales
        pytest.param("mxfp8", 1.0, marks=pytest.mark.slow),
    ],
)
def test_exact_rollout_logprobs_equal_the_recompute_bitwise(recipe, temperature):
    tokens, equal_prox, equal_retained = compare(recipe, exact=True, temperature=temperature)
    assert tokens >= 60  # 4 prompts x 3 samples, 6 to 12 tokens each unless a stop token came first
    assert equal_prox == tokens and equal_retained == tokens, (tokens, equal_prox, equal_retained)


def test_exact_mode_with_routing_replay():
    tokens, equal_prox, equal_retained = compare("nvfp4_moe", exact=True, temperature=1.0, routes=True)
    assert equal_prox == tokens and equal_retained == tokens, (tokens, equal_prox, equal_retained)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4_moe"])
def test_without_exact_mode_some_token_differs(recipe):
    tokens, equal_prox, equal_retained = compare(recipe, exact=False, temperature=1.0)
    assert equal_prox < tokens and equal_retained < tokens, (tokens, equal_prox, equal_retained)


def test_loop_exact_is_a_bool():
    assert AsyncConfig(exact=True).exact
    with pytest.raises(ValueError, match=r"exact='yes' \(must be true or false\)"):
        AsyncConfig(exact="yes")


@pytest.mark.parametrize(
    ("trainer", "bad"),
    [
        ({"backend": "megatron", "device": "cuda"}, "trainer.backend='megatron'"),
        ({"device": "cuda"}, "trainer.dtype='bfloat16' on cuda"),  # the rollout computes in fp32
    ],
)
def test_loop_exact_refuses_what_it_cannot_match_in_one_line(trainer, bad):
    with pytest.raises(ValueError) as e:
        from_dict({"loop": {"exact": True}, "trainer": trainer})
    msg = str(e.value)
    assert "\n" not in msg and "loop.exact=true" in msg and bad in msg


def test_loop_exact_takes_the_cpu_and_cuda_in_fp32():
    assert from_dict({"loop": {"exact": True}}).loop.exact  # the CPU default
    cuda = {"device": "cuda", "dtype": "float32"}
    assert from_dict({"loop": {"exact": True}, "trainer": cuda, "rollout": {"device": "cuda"}}).loop.exact
