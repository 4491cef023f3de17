"""rollout.packed_engine and rollout.sampling on the CPU (reference matmuls, torch sampler, no graphs).

The engine must compute what policy.model.generate computes from the same published tensors
(greedy tokens equal, log-probs within fp32 rounding), keep a row's samples a function of its seed
alone, stop rows on stop ids like the reference, and refuse what does not fit with one clear
message. The sampler's hash is checked against a plain-Python lowbias32, its draws against the
softmax they sample from."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout import sampling
from rollout.config import RolloutConfig
from rollout.engine import generate
from rollout.packed_engine import EngineConfig, PackedEngine, resolve_device

CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=4)  # small: the CPU suite stays fast
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, seed=1)


@functools.cache
def _packed(recipe: str):
    model = Transformer(CFG, seed=1)
    plan = Recipe.load(recipe).plan(model)
    return plan, qat.quantize_weights(model, plan)


def _pair(model, recipe: str, **ecfg):
    plan, packed = _packed(recipe)
    ref = Transformer(CFG, seed=None)
    qat.install_packed(ref, plan, packed)
    eng = PackedEngine(
        CFG, plan, packed, device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=8, max_seq_len=64, **ecfg)
    )
    return ref, eng


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4_moe", "int4_qat"])
def test_greedy_matches_reference_generate(model, recipe):
    ref, eng = _pair(model, recipe)
    a = generate(ref, PROMPTS, max_new_tokens=12, temperature=0.0)
    b = eng.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)


def test_stop_ids_match_reference(model):
    ref, eng = _pair(model, "nvfp4_moe")
    free = eng.generate(PROMPTS, max_new_tokens=12, temperature=0.0)
    eos = int(free.tokens[1, 3])  # row 1 stops at its 4th token (other rows wherever they meet it)
    a = generate(ref, PROMPTS, max_new_tokens=12, temperature=0.0, eos_id=eos, pad_id=0)
    b = eng.generate(PROMPTS, max_new_tokens=12, temperature=0.0, eos_id=eos, pad_id=0)
    assert b.lengths[1] <= 4 and bool(b.stopped[1])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths) and torch.equal(a.stopped, b.stopped)


def test_row_depends_only_on_its_seed_and_results_are_not_aliased(model):
    _, eng = _pair(model, "int4_qat")
    full = eng.generate(PROMPTS, max_new_tokens=10, temperature=1.0, seeds=[5, 6, 7])
    kept = full.tokens.clone()
    alone = eng.generate(PROMPTS[1:2], max_new_tokens=10, temperature=1.0, seeds=[6])
    swapped = eng.generate([PROMPTS[2], PROMPTS[1]], max_new_tokens=10, temperature=1.0, seeds=[7, 6])
    assert torch.equal(full.tokens, kept)  # the first result is a copy, not a view of engine buffers
    assert torch.equal(alone.tokens[0], full.tokens[1])
    assert torch.equal(swapped.tokens[1], full.tokens[1]) and torch.equal(swapped.tokens[0], full.tokens[2])
    other = eng.generate(PROMPTS[1:2], max_new_tokens=10, temperature=1.0, seeds=[8])
    assert not torch.equal(other.tokens[0], full.tokens[1])


def test_n_samples_share_the_prompt_and_match_reference(model):
    ref, eng = _pair(model, "int4_qat")  # no activation quantization: recompute equal up to fp32 order
    seeds = [11, 12, 13, 21, 22, 23]
    a = generate(ref, PROMPTS[:2], n_samples=3, max_new_tokens=8, temperature=1.0, seeds=seeds)
    b = eng.generate(PROMPTS[:2], n_samples=3, max_new_tokens=8, temperature=1.0, seeds=seeds)
    c = eng.generate([PROMPTS[0]] * 3 + [PROMPTS[1]] * 3, max_new_tokens=8, temperature=1.0, seeds=seeds)
    assert torch.equal(b.tokens, c.tokens)  # prefilled once per prompt == once per row
    torch.testing.assert_close(b.logprobs, c.logprobs, rtol=0, atol=1e-5)  # prefill batch shapes differ
    assert a.tokens.shape == b.tokens.shape and torch.equal(a.lengths, b.lengths)
    # The engines draw different noise (per-row torch generators vs the counter hash): compare the
    # behavior log-probs of the engine's own tokens with the reference model's recompute instead.
    for r in range(6):
        p = PROMPTS[r // 3]
        seq = torch.tensor([p + b.tokens[r].tolist()])
        with torch.no_grad():
            lp = ref.token_logprobs(seq[:, :-1], seq[:, 1:])[0, len(p) - 1 :]
        assert (b.logprobs[r] - lp).abs().max() < 1e-4


@pytest.mark.parametrize("recipe", ["int4_qat", "nvfp4_moe"])
def test_behavior_logprobs_are_the_recompute(model, recipe):
    ref, eng = _pair(model, recipe)
    g = eng.generate(PROMPTS[:1], max_new_tokens=10, temperature=0.8, seeds=[3])
    seq = torch.tensor([PROMPTS[0] + g.tokens[0].tolist()])
    lp = ref.token_logprobs(seq[:, :-1], seq[:, 1:], temperature=0.8)[0, len(PROMPTS[0]) - 1 :]
    d = (g.logprobs[0] - lp).abs()
    # Same operands; only fp32 summation order differs, except that under nvfp4 activations a
    # last-bit difference can move one element across an E2M1 rounding boundary (still small).
    assert d.median() < 1e-5 and d.max() < (1e-5 if recipe == "int4_qat" else 5e-3), d


def test_top_k_samples_only_the_k_most_likely(model):
    ref, eng = _pair(model, "bf16", top_k=3)
    g = eng.generate([PROMPTS[0]] * 8, max_new_tokens=1, temperature=1.0, seeds=list(range(8)))
    logits = ref(torch.tensor([PROMPTS[0]]))[0, -1]
    assert set(g.tokens[:, 0].tolist()) <= set(logits.topk(3).indices.tolist())
    assert (g.logprobs[:, 0] > math.log(1 / 3) - 3).all()  # renormalized over 3 tokens, not the vocab


def test_errors_are_clear(model):
    _, eng = _pair(model, "bf16")
    with pytest.raises(ValueError, match="KV capacity"):
        eng.generate([[1] * 60], max_new_tokens=10)
    with pytest.raises(ValueError, match="max_batch"):
        eng.generate([[1]] * 9, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_batch"):
        eng.generate([[1]] * 3, n_samples=3, max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="vocab_size"):
        eng.generate([[CFG.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="EngineConfig"):
        EngineConfig(top_p=0.0)
    eng.embed[7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        eng.generate([[7, 8]], max_new_tokens=3, temperature=1.0, seeds=[0])


def test_device_config():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="expected 'cpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="device="):
        RolloutConfig(device="gpu0")
    assert RolloutConfig(device="cuda:1").device == "cuda:1"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_is_lowbias32_of_seed_step_and_token():
    seed, step = (123456789 << 32) | 987654321, 17
    k = _lowbias32(987654321 ^ _lowbias32(123456789 ^ 0x9E3779B9))
    key = _lowbias32(k ^ step)
    assert sampling.row_key(torch.tensor([seed]), step).item() == key
    u = sampling.hash_uniform(torch.tensor([key]), 5)[0]
    for v in range(5):
        r = _lowbias32((_lowbias32(v ^ key) + key) & 0xFFFFFFFF)
        assert u[v].item() == ((r >> 9) + 0.5) / 2**23


def test_sampler_draws_from_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 40_000
    logits = probs.log().expand(n, -1)
    tok, lp = sampling.sample_reference(logits, torch.arange(n), 0, 1.0)
    freq = torch.bincount(tok, minlength=5).float() / n
    sd = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() < 5 * sd).all(), freq
    torch.testing.assert_close(lp, probs.log()[tok], rtol=0, atol=1e-6)
    tok2, _ = sampling.sample_reference(logits, torch.arange(n), 1, 1.0)
    assert (tok2 != tok).float().mean() > 0.3  # a new step draws new noise


def test_top_p_keeps_the_smallest_nucleus():
    z = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    keep = sampling.truncation_mask(z, top_k=0, top_p=0.8)
    assert keep.tolist() == [[True, True, False, False]]
    assert sampling.truncation_mask(z, top_k=0, top_p=0.01).tolist() == [[True, False, False, False]]
    assert sampling.truncation_mask(z, top_k=3, top_p=1.0).tolist() == [[True, True, True, False]]
    tok, lp = sampling.sample_reference(z.expand(1000, -1), torch.arange(1000), 0, 1.0, top_p=0.8)
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp[tok == 0][0], torch.tensor(math.log(0.5 / 0.8)), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "preset,overrides,recipe",
    [
        ("tiny-dense", {"n_layers": 2}, "int4_qat"),  # dense SwiGLU MLPs, tied LM head
        ("tiny", {"n_layers": 2, "n_experts": 4, "mlp_only_layers": (0,), "ffn_dim": 256}, "nvfp4_moe"),
    ],
)
def test_dense_and_mixed_layers_match_reference_generate(preset, overrides, recipe):
    cfg = ModelConfig.preset(preset, **overrides)
    model = Transformer(cfg, seed=2)
    plan = Recipe.load(recipe).plan(model)
    packed = qat.quantize_weights(model, plan)
    ref = Transformer(cfg, seed=None)
    qat.install_packed(ref, plan, packed)
    eng = PackedEngine(cfg, plan, packed, device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=4))
    a = generate(ref, PROMPTS, max_new_tokens=8, temperature=0.0)
    b = eng.generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4_moe"])
def test_update_in_place_equals_a_fresh_engine(recipe):
    plan = Recipe.load(recipe).plan(CFG)
    a = qat.quantize_weights(Transformer(CFG, seed=1), plan)
    b = qat.quantize_weights(Transformer(CFG, seed=2), plan)
    ecfg = EngineConfig(max_batch=8, max_seq_len=64)
    fresh = PackedEngine(CFG, plan, b, device="cpu", dtype=torch.float32, engine=ecfg)
    want = fresh.generate(PROMPTS, n_samples=2, max_new_tokens=10, temperature=1.0, seeds=list(range(6)))
    eng = PackedEngine(CFG, plan, dict(a), device="cpu", dtype=torch.float32, engine=ecfg)
    before = eng.generate(PROMPTS, n_samples=2, max_new_tokens=10, temperature=1.0, seeds=list(range(6)))
    assert not torch.equal(before.logprobs, want.logprobs)  # the versions differ
    kv, head = eng.k_cache[0], eng.embed
    assert eng.update(b)
    assert eng.k_cache[0] is kv and eng.embed is head  # in place: the same buffers
    got = eng.generate(PROMPTS, n_samples=2, max_new_tokens=10, temperature=1.0, seeds=list(range(6)))
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


def test_update_refuses_another_layout():
    plan = Recipe.load("nvfp4_moe").plan(CFG)
    a = qat.quantize_weights(Transformer(CFG, seed=1), plan)
    eng = PackedEngine(CFG, plan, dict(a), device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=2))
    other = qat.quantize_weights(Transformer(CFG, seed=1), Recipe.load("int4_qat").plan(CFG))  # other formats
    ref = eng.generate(PROMPTS[:1], max_new_tokens=4, temperature=0.0).logprobs
    assert not eng.update(other)
    assert torch.equal(eng.generate(PROMPTS[:1], max_new_tokens=4, temperature=0.0).logprobs, ref)  # unchanged
