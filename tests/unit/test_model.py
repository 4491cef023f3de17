"""policy.model: config, canonical names, MoE dispatch, KV-cache decoding, batch-invariant forward,
the layer-by-layer forward over chunks of rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from policy.model import (
    PRESETS,
    KVCache,
    ModelConfig,
    Transformer,
    activation_sites,
    parameter_shapes,
)

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(TINY, seed=1).eval()
    # Sharpen the output distribution so sampling and log-prob checks are not all near-uniform.
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


# ---- config


def test_config_validation_names_every_bad_field():
    with pytest.raises(ValueError) as e:
        ModelConfig(
            vocab_size=0,
            dim=64,
            n_layers=-1,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            n_experts=4,
            top_k=2,
            expert_ffn_dim=32,
            norm_eps=0.0,
        )
    msg = str(e.value)
    assert "vocab_size=0" in msg and "n_layers=-1" in msg and "norm_eps=0.0" in msg
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        ModelConfig.preset("tiny", n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="top_k=9 must be <= n_experts=8"):
        ModelConfig.preset("tiny", top_k=9)
    with pytest.raises(ValueError, match="head_dim=33"):
        ModelConfig.preset("tiny", head_dim=33)
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        ModelConfig.preset("nope")
    with pytest.raises(ValueError, match="n_layer"):
        ModelConfig.preset("tiny", n_layer=3)
    with pytest.raises(TypeError):
        ModelConfig(512, 128)  # keyword-only


def test_config_fingerprint_is_canonical_and_sensitive():
    a = ModelConfig.preset("tiny")
    assert a.fingerprint() == ModelConfig.from_dict(a.to_dict()).fingerprint()
    assert len(a.fingerprint()) == 64 and int(a.fingerprint(), 16) >= 0
    assert a.fingerprint() != ModelConfig.preset("tiny", rope_theta=20000.0).fingerprint()
    # ints and floats given either way canonicalize the same
    assert ModelConfig.preset("tiny", rope_theta=10000).fingerprint() == a.fingerprint()
    with pytest.raises(dataclasses_frozen_error()):
        a.dim = 3


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_presets_sizes_by_hand():
    # tiny: per layer attention 128*128*2 + 64*128*2, norms 2*128 + 2*32, router 8*128,
    # experts 8 * 3*256*128, shared 3*256*128; embeddings + head 2*512*128, final norm 128.
    layer = 2 * 128 * 128 + 2 * 64 * 128 + 2 * 128 + 2 * 32 + 8 * 128 + 8 * 3 * 256 * 128 + 3 * 256 * 128
    assert TINY.num_parameters() == 4 * layer + 2 * 512 * 128 + 128 == 3_872_128
    assert 1_000_000 <= TINY.num_parameters() <= 5_000_000
    q = PRESETS["qwen3-30b-a3b"]
    assert (
        q.n_layers,
        q.dim,
        q.n_heads,
        q.n_kv_heads,
        q.head_dim,
        q.n_experts,
        q.top_k,
        q.expert_ffn_dim,
        q.shared_expert_ffn_dim,
        q.vocab_size,
    ) == (48, 2048, 32, 4, 128, 128, 8, 768, 0, 151936)
    layer = (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096) + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 768 * 2048
    assert q.num_parameters() == 48 * layer + 2 * 151936 * 2048 + 2048 == 30_532_122_624


def test_canonical_names_match_parameter_shapes():
    m = Transformer(TINY)
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == parameter_shapes(TINY)
    assert list(dict(m.named_parameters())) == list(parameter_shapes(TINY))
    names = set(parameter_shapes(TINY))
    for n in (
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.2.mlp.experts.7.gate_up_proj.weight",
        "model.layers.2.mlp.shared_expert.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert n in names
    sites = activation_sites(TINY)
    assert sites["model.layers.1.mlp.experts.5.down_proj.input"] == 256
    assert sites["lm_head.input"] == 128 and "model.embed_tokens.input" not in sites
    assert len(sites) == 4 * (4 + 1 + 8 * 2 + 2) + 1


def test_meta_device_construction_allocates_nothing():
    cfg = ModelConfig.preset("qwen3-30b-a3b", n_layers=2)
    with torch.device("meta"):
        m = Transformer(cfg)
    assert all(p.is_meta for p in m.parameters())
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == parameter_shapes(cfg)


@pytest.mark.slow
def test_meta_device_full_30b():
    cfg = PRESETS["qwen3-30b-a3b"]
    with torch.device("meta"):
        m = Transformer(cfg)
    assert sum(p.numel() for p in m.parameters()) == 30_532_122_624


# ---- forward


def _naive_moe(moe, x):
    """Per-token reference of the MoE block (slow loops, obviously correct)."""
    out = torch.zeros_like(x)
    probs = F.linear(x, moe.gate.weight).softmax(-1)
    for t in range(x.shape[0]):
        w, idx = probs[t].topk(moe.top_k)
        w = w / w.sum()
        for wk, e in zip(w, idx.tolist()):
            ex = moe.experts[e]
            g, u = F.linear(x[t], ex.gate_up_proj.weight).split(ex.ffn_dim)
            out[t] += wk * F.linear(F.silu(g) * u, ex.down_proj.weight)
        s = moe.shared_expert
        g, u = F.linear(x[t], s.gate_up_proj.weight).split(s.ffn_dim)
        out[t] += F.linear(F.silu(g) * u, s.down_proj.weight)
    return out


def test_moe_dispatch_matches_per_token_reference(model):
    from policy.model import _PLAIN

    moe = model.model.layers[0].mlp
    x = torch.randn(37, TINY.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(moe(x, _PLAIN), _naive_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_padding_does_not_change_real_positions(model):
    g = torch.Generator().manual_seed(2)
    row = torch.randint(0, TINY.vocab_size, (1, 11), generator=g)
    with torch.no_grad():
        ref = model(row)
        for side in ("left", "right"):
            pad = torch.zeros(1, 5, dtype=torch.long)
            toks = torch.cat([pad, row], 1) if side == "left" else torch.cat([row, pad], 1)
            mask = torch.cat([pad.bool(), torch.ones_like(row, dtype=torch.bool)], 1)
            if side == "right":
                mask = mask.flip(1)
            out = model(toks, attention_mask=mask)
            real = out[:, 5:] if side == "left" else out[:, :11]
            torch.testing.assert_close(real, ref, rtol=1e-5, atol=5e-5)
            assert torch.isfinite(out).all()


def test_rows_do_not_depend_on_the_batch(model):
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, TINY.vocab_size, (6, 16), generator=g)
    with torch.no_grad():
        batch = model(toks)
        for b in (0, 5):
            torch.testing.assert_close(batch[b : b + 1], model(toks[b : b + 1]), rtol=1e-5, atol=5e-5)


def test_token_logprobs_matches_log_softmax(model):
    toks = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    tgt = toks.roll(-1, dims=1)
    with torch.no_grad():
        lp = model.token_logprobs(toks, tgt, temperature=0.7)
        ref = (model(toks) / 0.7).log_softmax(-1).gather(-1, tgt[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    assert lp.dtype == torch.float32 and lp.shape == (2, 9)


@pytest.mark.parametrize("mode", ["plain", "qat", "exact"])
def test_token_logprobs_by_layer_equals_one_call_per_chunk_bitwise(mode):
    """Layer by layer over chunks of rows (chunks out of order, padded rows, forced routes with
    some -1) gives each chunk exactly what a token_logprobs call of its own gives."""
    from policy import qat
    from policy.recipe import Recipe

    cfg = ModelConfig.preset("tiny", n_layers=3, n_experts=4, top_k=2, mlp_only_layers=[1], ffn_dim=64)
    m = Transformer(cfg, seed=2)
    if mode != "plain":
        qat.apply_qat(m, Recipe.load("nvfp4_moe"), exact=mode == "exact")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (5, 7), generator=g)
    targets = tokens.roll(-1, dims=1)
    attn = torch.ones(5, 7, dtype=torch.bool)
    attn[1, :2] = attn[4, -3:] = False
    first = torch.randint(0, cfg.n_experts, (5, 7, 2), generator=g)
    second = (first + torch.randint(1, cfg.n_experts, (5, 7, 2), generator=g)) % cfg.n_experts  # distinct
    routes = torch.stack([first, second], dim=-1)
    routes[torch.rand(5, 7, 2, generator=g) < 0.3] = -1  # these tokens take the router's own experts
    chunks = [torch.tensor([3, 0]), torch.tensor([4]), torch.tensor([1, 2])]
    got = m.token_logprobs_by_layer(tokens, targets, chunks, attention_mask=attn, temperature=0.7, routes=routes)
    with torch.no_grad():
        want = torch.cat(
            [
                m.token_logprobs(tokens[r], targets[r], attention_mask=attn[r], temperature=0.7, routes=routes[r])
                for r in chunks
            ]
        )
    assert got.shape == (5, 7) and torch.equal(got.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match=r"routes shape \(5, 7, 3, 2\) != \(5, 7, 2, 2\)"):
        m.token_logprobs_by_layer(tokens, targets, chunks, routes=torch.zeros(5, 7, 3, 2, dtype=torch.long))


def test_kv_cache_decoding_equals_full_forward(model):
    """Left-padded prefill + one-token decode steps give the logits of the unpadded full forward."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g) for n in (3, 8, 5)]
    cont = torch.randint(0, TINY.vocab_size, (3, 6), generator=g)
    L = 8
    toks = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.bool)
    for b, p in enumerate(prompts):
        toks[b, L - len(p) :] = p
        mask[b, L - len(p) :] = True
    cache = KVCache(TINY, 3, L + 6)
    with torch.no_grad():
        steps = [model(toks, attention_mask=mask, cache=cache, last_only=True)[:, 0]]
        for t in range(5):
            steps.append(
                model(cont[:, t : t + 1], attention_mask=torch.ones(3, 1, dtype=torch.bool), cache=cache)[:, 0]
            )
        for b, p in enumerate(prompts):
            full = model(torch.cat([p, cont[b, :5]])[None])[0]
            decoded = torch.stack([s[b] for s in steps])
            torch.testing.assert_close(decoded, full[len(p) - 1 :], rtol=1e-5, atol=5e-5)
    assert cache.length == L + 5
    assert cache.next_pos.tolist() == [3 + 5, 8 + 5, 5 + 5]
    with pytest.raises(ValueError, match="KV cache full"):
        model(cont[:, :2], cache=cache)


def test_load_weights_checks_names_and_shapes():
    m = Transformer(TINY, seed=0)
    src = Transformer(TINY, seed=9)
    m.load_weights({n: p.detach() for n, p in src.named_parameters()})
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), src.parameters()))
    with pytest.raises(ValueError, match="missing"):
        m.load_weights({"lm_head.weight": torch.zeros(512, 128)})
    with pytest.raises(ValueError, match="bad shapes"):
        m.load_weights({"lm_head.weight": torch.zeros(3, 3)}, strict=False)
    with pytest.raises(ValueError, match="unknown"):
        m.load_weights({"lm_head.bias": torch.zeros(3)}, strict=False)


def test_init_is_seeded():
    a, b, c = Transformer(TINY, seed=1), Transformer(TINY, seed=1), Transformer(TINY, seed=2)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert math.isclose(a.lm_head.weight.std().item(), 0.02, rel_tol=0.05)
