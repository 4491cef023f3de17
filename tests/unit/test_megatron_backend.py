"""trainer/megatron_backend.py on CPU: a real megatron-core GPTModel (local spec) built under a
single-process gloo group on loopback; the canonical <-> megatron mapping bit for bit, the qkv and
gate/up layouts by hand, TP/EP sharding, the QAT hooks' arithmetic against policy.qat on the
torch model with the reference quantizers, and whole forwards/backwards against the torch backend in
fp32. megatron's forward is written for CUDA in two places, which `cpu_forward` points at the CPU for
the test (torch.cuda.current_device, used to move the rotary table, and the CUDA RNG tracker's fork,
used around attention dropout, here 0); everything else is megatron-core's own code."""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch
import torch.nn.functional as F

from policy.contract import contract_from_recipe
from policy.manifest import build_manifest
from policy.model import ModelConfig, Transformer, parameter_shapes
from policy.qat import apply_qat as torch_apply_qat
from policy.qat import bits
from policy.recipe import Recipe

CFG = ModelConfig.preset("tiny", n_layers=2)
DENSE = ModelConfig.preset("tiny-dense", n_layers=2)  # Qwen3 dense, tied embeddings
MIXED = ModelConfig.preset("tiny", n_layers=3, mlp_only_layers=[1], ffn_dim=256, tie_word_embeddings=True)
GROUP = ModelConfig.preset("tiny", n_heads=4, n_kv_heads=2, head_dim=2, dim=1, n_layers=1)


@pytest.fixture(scope="module")
def mb():
    """The backend module with torch.distributed (gloo, one process) and megatron's parallel state up."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from broker.local_redis import free_port
    from trainer import megatron_backend

    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        megatron_backend.init_parallel()
        yield megatron_backend
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture
def cpu_forward(mb, monkeypatch):
    from megatron.core import tensor_parallel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())


@pytest.fixture(scope="module")
def models(mb):
    """(torch Transformer, megatron GPTModel) of CFG in bf16 holding the same weights."""
    ref = Transformer(CFG, seed=3).to(torch.bfloat16)
    gpt = mb.build_gpt_model(CFG, dtype=torch.bfloat16, cpu_init=True)
    mb.load_canonical(gpt, CFG, dict(ref.named_parameters()))
    return ref, gpt


def _canonical(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in parameter_shapes(CFG).items()}


def test_trainer_config_backend_and_device_fields():
    from trainer.config import TrainerConfig

    assert (TrainerConfig().backend, TrainerConfig().device) == ("torch", "cpu")
    TrainerConfig(backend="megatron", device="cuda")
    with pytest.raises(ValueError, match="backend='megatron' needs device='cuda'"):
        TrainerConfig(backend="megatron")
    with pytest.raises(ValueError, match="backend='jax'"):
        TrainerConfig(backend="jax")
    with pytest.raises(ValueError, match="device='gpu'"):
        TrainerConfig(device="gpu")


# ---- layouts by hand


def test_qkv_layout_is_megatrons_per_group_interleave(mb):
    # 4 query heads, 2 groups, head_dim 2, D = 1: rows labelled by their canonical origin.
    q = torch.arange(100, 108.0)[:, None]  # heads 0..3, two rows each
    k = torch.arange(200, 204.0)[:, None]  # kv heads 0, 1
    v = torch.arange(300, 304.0)[:, None]
    fused = mb.fuse_qkv(q, k, v, GROUP)
    expected = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert fused[:, 0].tolist() == expected
    back = mb.split_qkv(fused, GROUP)
    assert [t[:, 0].tolist() for t in back] == [q[:, 0].tolist(), k[:, 0].tolist(), v[:, 0].tolist()]


def test_fc1_is_gate_up_and_tp_takes_a_slice_of_each_half(mb):
    full = _canonical(0)
    state = mb.to_megatron(CFG, full)
    name = "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    assert state[name] is full["model.layers.1.mlp.experts.5.gate_up_proj.weight"]
    F_ = CFG.expert_ffn_dim
    w = state[name]
    for rank in range(2):
        local = mb.shard(CFG, state, tp_rank=rank, tp=2)[name]
        half = F_ // 2
        gate = w[rank * half : (rank + 1) * half]
        up = w[F_ + rank * half : F_ + (rank + 1) * half]
        assert torch.equal(bits(local), bits(torch.cat((gate, up))))


def test_ep_places_experts_by_rank(mb):
    state = mb.to_megatron(CFG, _canonical(1))
    local = mb.shard(CFG, state, ep_rank=1, ep=4)  # 8 experts: rank 1 holds experts 2, 3
    a = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    assert torch.equal(local[a], state["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"])
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in local
    assert torch.equal(local["output_layer.weight"], state["output_layer.weight"])


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_shard_unshard_round_trip_bitwise(mb, tp, ep):
    full = mb.to_megatron(CFG, _canonical(2))
    local = {(t, e): mb.shard(CFG, full, tp_rank=t, tp=tp, ep_rank=e, ep=ep) for t in range(tp) for e in range(ep)}
    if tp > 1:
        qkv = local[(1, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape[0] == full["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] // tp
    back = mb.unshard(CFG, local, tp=tp, ep=ep)
    assert sorted(back) == sorted(full)
    assert all(torch.equal(bits(back[n]), bits(full[n])) for n in full)


def test_names_map_both_ways(mb):
    shapes = mb.megatron_shapes(CFG)
    for name in parameter_shapes(CFG):
        mname = mb.megatron_name(name)
        assert mname in shapes
        if "_proj.weight" not in name or ".self_attn." not in name or "o_proj" in name:
            assert mb.canonical_name(mname) == name
            assert mb.canonical_name("module.module." + mname) == name
    with pytest.raises(ValueError, match="no canonical name"):
        mb.canonical_name("decoder.layers.0.self_attention.linear_qkv.weight")
    with pytest.raises(ValueError, match="missing"):
        mb.to_megatron(CFG, {"lm_head.weight": torch.zeros(1)})


# ---- a real GPTModel


def test_gpt_model_has_exactly_the_mapped_parameters(mb, models):
    _, gpt = models
    got = {n: tuple(p.shape) for n, p in gpt.named_parameters()}
    assert got == mb.megatron_shapes(CFG)
    assert all(p.dtype == torch.bfloat16 for p in gpt.parameters())
    cfg = gpt.config
    assert cfg.moe_router_pre_softmax is False and cfg.qk_layernorm and cfg.num_query_groups == CFG.n_kv_heads
    assert gpt.decoder.layers[0].mlp.shared_experts is not None


def test_canonical_round_trip_through_gpt_model_bitwise(mb, models):
    ref, gpt = models
    back = mb.canonical_state(gpt, CFG)
    expected = dict(ref.named_parameters())
    assert list(back) == list(expected)
    assert all(torch.equal(bits(back[n]), bits(expected[n])) for n in expected)
    fresh = mb.build_gpt_model(CFG, dtype=torch.bfloat16, cpu_init=True)
    mb.load_canonical(fresh, CFG, back)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fresh.parameters(), gpt.parameters()))


# ---- QAT


def _sites(i: int = 0) -> dict[str, str]:
    """megatron module path -> canonical site, for one layer's linears."""
    p = f"model.layers.{i}"
    return {
        f"decoder.layers.{i}.self_attention.linear_proj": f"{p}.self_attn.o_proj",
        f"decoder.layers.{i}.mlp.router": f"{p}.mlp.gate",
        f"decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc1": f"{p}.mlp.experts.3.gate_up_proj",
        f"decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc2": f"{p}.mlp.experts.3.down_proj",
        f"decoder.layers.{i}.mlp.shared_experts.linear_fc1": f"{p}.mlp.shared_expert.gate_up_proj",
        "output_layer": "lm_head",
    }


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "int4_qat", "mxfp8"])
def test_qat_effective_weights_and_published_bytes_equal_the_torch_backend(mb, models, recipe_name):
    ref, gpt = models
    recipe = Recipe.load(recipe_name)
    t_hook = torch_apply_qat(ref, recipe)
    m_hook = mb.apply_qat(gpt, CFG, recipe)
    try:
        t_eff, m_eff = t_hook.effective_weights(ref), m_hook.effective_weights(gpt)
        assert sorted(m_eff) == sorted(t_eff)
        assert all(torch.equal(bits(m_eff[n]), bits(t_eff[n])) for n in t_eff)
        # the fused qkv the forward uses is the fusion of the canonical effective weights
        w = gpt.decoder.layers[0].self_attention.linear_qkv.weight
        fused = m_hook.effective("model.layers.0.self_attn.qkv_proj.weight", w)
        want = mb.fuse_qkv(*(t_eff[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"), CFG)
        assert torch.equal(bits(fused), bits(want))
        if recipe_name != "mxfp8":  # experts only: the effective expert weight is not the master
            e = "model.layers.0.mlp.experts.0.down_proj.weight"
            assert not torch.equal(m_eff[e], dict(ref.named_parameters())[e])
        contract = contract_from_recipe(model_config=CFG, recipe=recipe)
        a = build_manifest(version=1, parent_version=None, contract=contract, tensors=t_hook.quantized_params(ref))
        b = build_manifest(version=1, parent_version=None, contract=contract, tensors=m_hook.quantized_params(gpt))
        assert sorted(a.blobs) == sorted(b.blobs)
        assert all(bytes(a.blobs[n]) == bytes(b.blobs[n]) for n in a.blobs)
        assert [t.sha256 for t in a.manifest.tensors] == [t.sha256 for t in b.manifest.tensors]
    finally:
        mb.remove_qat(gpt)
        ref.quant_hook = None


def _module(gpt, path):
    return dict(gpt.named_modules())[path]


def _call(mod, x):
    out = mod.gating(x) if hasattr(mod, "topk") else mod(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("backward", ["hp", "dequant"])
def test_qat_linears_compute_what_policy_qat_computes(mb, models, backward):
    ref, gpt = models
    recipe = Recipe.load("nvfp4_moe")
    t_hook = torch_apply_qat(ref, recipe, backward)
    mb.apply_qat(gpt, CFG, recipe, backward)
    t_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(5)
    try:
        for path, site in _sites().items():
            mod = _module(gpt, path)
            K = mod.weight.shape[1]
            x = torch.randn(6, K, generator=g).to(torch.bfloat16)
            xm, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
            ym = _call(mod, xm)
            yt = t_hook.linear(site, xt, t_params[site + ".weight"])
            assert torch.equal(bits(ym), bits(yt)), site
            gy = torch.randn(ym.shape, generator=g).to(torch.bfloat16)
            ym.backward(gy)
            yt.backward(gy)
            assert torch.equal(bits(xm.grad), bits(xt.grad)), site
            assert torch.equal(bits(mod.weight.grad), bits(t_params[site + ".weight"].grad)), site
            mod.weight.grad = None
            t_params[site + ".weight"].grad = None
        # an nvfp4 expert site really fake-quantizes (weights and inputs): the plain matmul differs
        mod = _module(gpt, "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2")
        x = torch.randn(6, mod.weight.shape[1], generator=g).to(torch.bfloat16)
        assert not torch.equal(_call(mod, x), F.linear(x, mod.weight))
        # the fused qkv: fake-quantized input, fused effective weight, same straight-through grads
        att = gpt.decoder.layers[0].self_attention.linear_qkv
        x = torch.randn(6, CFG.dim, generator=g).to(torch.bfloat16).requires_grad_()
        y = _call(att, x)
        w_hat = mb.fuse_qkv(
            *(
                t_hook.effective(
                    f"model.layers.0.self_attn.{p}.weight", t_params[f"model.layers.0.self_attn.{p}.weight"]
                )
                for p in ("q_proj", "k_proj", "v_proj")
            ),
            CFG,
        )
        assert torch.equal(bits(y), bits(F.linear(x, w_hat)))
        gy = torch.randn(y.shape, generator=g).to(torch.bfloat16)
        y.backward(gy)
        w_used = att.weight if backward == "hp" else w_hat
        torch.testing.assert_close(x.grad, gy.matmul(w_used), rtol=0, atol=0)
        torch.testing.assert_close(att.weight.grad, gy.t().matmul(x.detach()), rtol=1e-2, atol=1e-2)
        att.weight.grad = None
        # norms and the embedding read their (bf16: unchanged) effective values through the hook
        norm = gpt.decoder.layers[0].self_attention.q_layernorm
        h = torch.randn(4, CFG.head_dim, generator=g).to(torch.bfloat16)
        assert torch.equal(bits(norm(h)), bits(F.rms_norm(h, norm.normalized_shape, norm.weight, norm.eps)))
        ids = torch.tensor([[1, 7, 511]])
        emb = gpt.embedding.word_embeddings
        assert torch.equal(bits(emb(ids)), bits(t_params["model.embed_tokens.weight"][ids]))
    finally:
        mb.remove_qat(gpt)
        ref.quant_hook = None
    assert "forward" not in mod.__dict__ and "_tandem_qat" not in _module(gpt, "decoder.layers.0.mlp.router").__dict__


def test_qat_cache_refreshes_after_an_optimizer_step(mb, models):
    _, gpt = models
    opt = torch.optim.SGD(gpt.parameters(), lr=1.0)
    hook = mb.apply_qat(gpt, CFG, Recipe.load("int4_qat"), optimizer=opt)
    saved = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    try:
        name = "model.layers.0.mlp.experts.2.gate_up_proj.weight"
        w = gpt.decoder.layers[0].mlp.experts.local_experts[2].linear_fc1.weight
        before = hook.effective(name, w)
        assert hook.effective(name, w) is before  # cached
        qkv = gpt.decoder.layers[0].self_attention.linear_qkv.weight
        fused = hook.effective("model.layers.0.self_attn.qkv_proj.weight", qkv)
        for p in gpt.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        after = hook.effective(name, w)
        assert after is not before and not torch.equal(after, before)
        assert hook.effective("model.layers.0.self_attn.qkv_proj.weight", qkv) is not fused
    finally:
        mb.remove_qat(gpt)
        with torch.no_grad():
            for n, p in gpt.named_parameters():
                p.copy_(saved[n])
                p.grad = None


def test_qat_refuses_a_recipe_that_splits_the_fused_qkv(mb, models):
    _, gpt = models
    recipe = Recipe.from_dict(
        {"name": "q_only", "rules": [{"match": "model.layers.*.self_attn.q_proj.input", "format": "mxfp8"}]}
    )
    with pytest.raises(ValueError, match="q/k/v inputs differently"):
        mb.apply_qat(gpt, CFG, recipe)
    assert "forward" not in gpt.decoder.layers[0].self_attention.linear_qkv.__dict__


# ---- whole forwards and backwards on CPU (fp32: differences are accumulation order only)


@pytest.fixture(scope="module")
def pairs32(mb):
    """cfg -> (torch Transformer, megatron GPTModel) in fp32 with the same weights, built once."""
    built = {}

    def get(cfg):
        if cfg not in built:
            ref = Transformer(cfg, seed=7)
            gpt = mb.build_gpt_model(cfg, dtype=torch.float32, cpu_init=True)
            mb.load_canonical(gpt, cfg, dict(ref.named_parameters()))
            built[cfg] = (ref, gpt)
        return built[cfg]

    return get


@pytest.mark.parametrize("cfg", [DENSE, MIXED], ids=["dense-tied", "mixed-tied"])
def test_dense_mixed_and_tied_models_map_bitwise(mb, pairs32, cfg):
    ref, gpt = pairs32(cfg)
    names = {n for n, _ in gpt.named_parameters()}
    assert names == set(mb.megatron_shapes(cfg))
    assert "output_layer.weight" not in names and "decoder.layers.1.mlp.linear_fc1.weight" in names
    back = mb.canonical_state(gpt, cfg)
    assert all(torch.equal(bits(back[n]), bits(p)) for n, p in ref.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cfg", "recipe_name", "backward"),
    [
        (CFG, None, None),
        (CFG, "nvfp4_moe", "hp"),
        (CFG, "nvfp4_moe", "dequant"),
        (CFG, "int4_qat", "hp"),
        (DENSE, None, None),
        (DENSE, "mxfp8", "hp"),  # attention weights and inputs in MXFP8 (no experts in a dense model)
        (MIXED, "nvfp4_moe", "hp"),
    ],
    ids=["moe", "moe-nvfp4-hp", "moe-nvfp4-dequant", "moe-int4-hp", "dense-tied", "dense-tied-mxfp8", "mixed-nvfp4"],
)
def test_forward_and_backward_equal_the_torch_backend_in_fp32(mb, pairs32, cpu_forward, cfg, recipe_name, backward):
    ref, gpt = pairs32(cfg)
    if recipe_name is not None:
        torch_apply_qat(ref, Recipe.load(recipe_name), backward)
        mb.apply_qat(gpt, cfg, Recipe.load(recipe_name), backward)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    try:
        lt, lm = ref(tokens), mb.logits(gpt, tokens)
        assert lm.shape == lt.shape
        torch.testing.assert_close(lm, lt, rtol=0, atol=2e-5)
        for lg in (lt, lm):
            F.cross_entropy(lg[:, :-1].reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        grads_m = mb.from_megatron(cfg, {n: p.grad for n, p in gpt.named_parameters()})
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads_m[n], p.grad, rtol=1e-3, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    finally:
        mb.remove_qat(gpt)
        ref.quant_hook = None
        ref.zero_grad(set_to_none=True)
        gpt.zero_grad(set_to_none=True)


def test_a_wrong_qkv_layout_is_visible_in_the_logits(mb, pairs32, cpu_forward):
    """The forward comparison can fail: loading q/k/v concatenated instead of interleaved per group."""
    ref, _ = pairs32(CFG)
    p = dict(ref.named_parameters())
    wrong = mb.build_gpt_model(CFG, dtype=torch.float32, cpu_init=True)
    mb.load_canonical(wrong, CFG, p)
    with torch.no_grad():
        for i in range(CFG.n_layers):
            a = f"model.layers.{i}.self_attn."
            qkv = torch.cat([p[a + "q_proj.weight"], p[a + "k_proj.weight"], p[a + "v_proj.weight"]])
            wrong.decoder.layers[i].self_attention.linear_qkv.weight.copy_(qkv)
    tokens = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (mb.logits(wrong, tokens) - ref(tokens)).abs().max() > 1e-3


@pytest.mark.parametrize("cfg", [CFG, MIXED], ids=["moe", "mixed-tied"])
def test_retained_versions_take_the_megatron_hooks_packed_tensors(mb, pairs32, cfg):
    """What the trainer service does at a publish with trainer.backend=megatron: the hook's quantized
    params (canonical names, every parameter) are retained, and at_version computed from them is
    the torch QAT forward of the same weights bit for bit (it runs policy.model's forward on CPU)."""
    from trainer.versions import RetainedVersions

    ref, gpt = pairs32(cfg)
    recipe = Recipe.load("nvfp4_moe")
    m_hook = mb.apply_qat(gpt, cfg, recipe)
    try:
        versions = RetainedVersions(cfg, recipe.plan(cfg), keep=1)
        versions.add(1, m_hook.quantized_params(gpt), live=list(gpt.parameters()))
        tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
        got = versions.token_logprobs(1, tokens, tokens.roll(-1, 1))
        torch_apply_qat(ref, recipe)
        with torch.no_grad():
            want = ref.token_logprobs(tokens, tokens.roll(-1, 1))
        assert torch.equal(bits(got), bits(want))
    finally:
        mb.remove_qat(gpt)
        ref.quant_hook = None


@pytest.mark.parametrize(("recipe", "backward"), [(None, "hp"), ("nvfp4_moe", "hp"), ("int4_qat", "dequant")])
def test_grouped_experts_equal_megatrons_loop(mb, models, recipe, backward):
    """SequentialMLP's grouped forward (one grouped GEMM per projection, the QAT group's stacked
    operands) against megatron's loop over experts: outputs and gradients, an expert without tokens."""
    ref, gpt = models
    if recipe is not None:
        mb.apply_qat(gpt, CFG, Recipe.load(recipe), backward)
    mod = _module(gpt, "decoder.layers.0.mlp.experts")
    counts = torch.tensor([3, 0, 5, 1, 7, 2, 4, 2])[: len(mod.local_experts)]
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(int(counts.sum()), CFG.dim, generator=g).to(torch.bfloat16)
    probs = torch.rand(hidden.shape[0], generator=g)
    weights = [p for e in mod.local_experts for p in (e.linear_fc1.weight, e.linear_fc2.weight)]
    runs = []
    try:
        for grouped in (False, True):
            mod.tandem_grouped = grouped
            x = hidden.clone().requires_grad_()
            y, _ = mod(x, counts, probs)
            y.float().square().sum().backward()
            runs.append((y.detach().float(), x.grad.float(), [w.grad for w in weights]))
            for w in weights:
                w.grad = None
    finally:
        mod.tandem_grouped = None
        mb.remove_qat(gpt)
    (y0, gx0, gw0), (y1, gx1, gw1) = runs
    torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx1, gx0, rtol=5e-2, atol=5e-2)
    for a, b in zip(gw1, gw0):
        if b is None:  # the expert without tokens: zeros
            assert not a.any()
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
