"""megatron-core backend == torch backend on the GPU: same weights -> logits within bf16 noise (plain
and QAT nvfp4_moe), straight-through gradients aligned, effective weights and published bytes equal
bit for bit. Runs on the device (bench/run_megatron_device.sh); skipped without CUDA or megatron-core.

"bf16 noise" is measured, not assumed: the torch backend in fp32 (same bf16-valued weights) is the
reference, and the megatron-vs-torch difference must stay within a small multiple of the torch
backend's own bf16 error against it (mean |Δ log p(target)|)."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_megatron_device.sh)", allow_module_level=True)
pytest.importorskip("megatron.core")

from policy.contract import contract_from_recipe
from policy.manifest import build_manifest
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.qat import apply_qat as torch_apply_qat  # noqa: E402
from policy.qat import bits  # noqa: E402
from policy.recipe import Recipe  # noqa: E402
from trainer import megatron_backend as mb  # noqa: E402

CFG = ModelConfig.preset("tiny", n_layers=3)
DEV = "cuda"


@pytest.fixture(scope="module")
def dist_up():
    import torch.distributed as dist
    from megatron.core import parallel_state

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
    )
    try:
        mb.init_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(dist_up):
    """(torch bf16, torch fp32 reference, megatron bf16), the same bf16-valued weights."""
    ref = Transformer(CFG, seed=11).to(device=DEV, dtype=torch.bfloat16)
    f32 = Transformer(CFG, seed=None).to(device=DEV)
    f32.load_weights({n: p.float() for n, p in ref.named_parameters()})
    gpt = mb.build_gpt_model(CFG, dtype=torch.bfloat16, cpu_init=True).to(DEV)
    mb.load_canonical(gpt, CFG, dict(ref.named_parameters()))
    return ref, f32, gpt


def _tokens(B=4, T=128, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, T), device=DEV, generator=g)


def _target_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    lp = logits.float().log_softmax(-1)[:, :-1]
    return lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _compare(ref, f32, gpt, tokens):
    with torch.no_grad():
        t = _target_logprobs(ref(tokens), tokens)
        r = _target_logprobs(f32(tokens), tokens)
        m = _target_logprobs(mb.logits(gpt, tokens), tokens)
    noise = (t - r).abs().mean().item()
    return noise, (m - r).abs().mean().item(), (m - t).abs().mean().item()


def test_gpt_model_holds_the_canonical_weights_bitwise(models):
    ref, _, gpt = models
    back = mb.canonical_state(gpt, CFG)
    assert all(torch.equal(bits(back[n]), bits(p)) for n, p in ref.named_parameters())


def test_logits_equal_the_torch_backend_within_bf16_noise(models):
    ref, f32, gpt = models
    gpt.eval()
    noise, err_m, diff = _compare(ref, f32, gpt, _tokens())
    print(f"plain: torch-bf16 vs fp32 {noise:.2e}, megatron vs fp32 {err_m:.2e}, megatron vs torch {diff:.2e}")
    assert noise > 0
    assert err_m <= 3 * noise + 1e-4
    assert diff <= 4 * noise + 1e-4


def test_qat_logits_effective_weights_and_published_bytes(models):
    ref, f32, gpt = models
    recipe = Recipe.load("nvfp4_moe")
    t_hook = torch_apply_qat(ref, recipe)
    torch_apply_qat(f32, recipe)
    m_hook = mb.apply_qat(gpt, CFG, recipe)
    try:
        tokens = _tokens(seed=1)
        noise, err_m, diff = _compare(ref, f32, gpt, tokens)
        print(f"qat nvfp4_moe: torch-bf16 vs fp32 {noise:.2e}, megatron vs fp32 {err_m:.2e}, vs torch {diff:.2e}")
        assert err_m <= 3 * noise + 1e-4
        assert diff <= 4 * noise + 1e-4
        t_eff, m_eff = t_hook.effective_weights(ref), m_hook.effective_weights(gpt)
        assert sorted(t_eff) == sorted(m_eff)
        assert all(torch.equal(bits(t_eff[n]), bits(m_eff[n])) for n in t_eff)
        contract = contract_from_recipe(model_config=CFG, recipe=recipe)
        a = build_manifest(version=1, parent_version=None, contract=contract, tensors=t_hook.quantized_params(ref))
        b = build_manifest(version=1, parent_version=None, contract=contract, tensors=m_hook.quantized_params(gpt))
        assert [(t.name, t.sha256) for t in a.manifest.tensors] == [(t.name, t.sha256) for t in b.manifest.tensors]
        assert all(bytes(a.blobs[n]) == bytes(b.blobs[n]) for n in a.blobs)
    finally:
        mb.remove_qat(gpt)
        ref.quant_hook = f32.quant_hook = None


@pytest.mark.parametrize("qat", [False, True])
def test_straight_through_gradients_agree(models, qat):
    """Gradients of megatron (bf16) and torch (bf16) against the torch backend in fp32: megatron's
    error must stay within a small multiple of torch's own bf16 error, measured, per tensor.

    A fixed cosine bound does not hold for the router under nvfp4 QAT: a bf16 rounding of an expert
    input flips some of its nvfp4 codes, and the router's gradient (sum over tokens of
    <dL/dy, y_e>, small: |g| ~ 1e-2) moves with them. Measured on CPU (tiny, 3 layers, 4 x 128 tokens,
    layer 1's router): torch bf16 vs torch fp32 cosine 0.981, megatron bf16 vs torch fp32 0.981,
    megatron fp32 vs torch fp32 1.000000 (hp and dequant). So the 0.987 once seen here is bf16 noise,
    not a backend difference; tests/unit/test_megatron_backend.py checks the fp32 gradients equal."""
    ref, f32, gpt = models
    gpt.train()
    if qat:
        torch_apply_qat(ref, Recipe.load("nvfp4_moe"))
        torch_apply_qat(f32, Recipe.load("nvfp4_moe"))
        mb.apply_qat(gpt, CFG, Recipe.load("nvfp4_moe"))
    try:
        tokens = _tokens(seed=2)
        for lg in (ref(tokens), f32(tokens), mb.logits(gpt, tokens)):
            loss = F.cross_entropy(lg[:, :-1].float().reshape(-1, CFG.vocab_size), tokens[:, 1:].reshape(-1))
            loss.backward()
        grads_t = {n: p.grad for n, p in ref.named_parameters()}
        grads_r = {n: p.grad for n, p in f32.named_parameters()}
        grads_m = mb.from_megatron(CFG, {n: p.grad for n, p in gpt.named_parameters()})
        for name in (
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.mlp.shared_expert.gate_up_proj.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.1.mlp.gate.weight",
            "model.embed_tokens.weight",
        ):

            def cos(a, b, name=name):
                return F.cosine_similarity(a[name].float().flatten(), b[name].float().flatten(), dim=0).item()

            noise, err = 1 - cos(grads_t, grads_r), 1 - cos(grads_m, grads_r)
            print(f"{'qat' if qat else 'plain'} {name}: 1-cos torch-bf16 {noise:.1e}, megatron-bf16 {err:.1e}")
            assert err <= 3 * noise + 2e-3, (name, noise, err)
            assert cos(grads_m, grads_r) > 0.95, name
    finally:
        mb.remove_qat(gpt)
        ref.quant_hook = f32.quant_hook = None
        for m in (ref, f32, gpt):
            m.zero_grad(set_to_none=True)
