"""The grouped-GEMM MoE and the batched expert quantizer on a GPU: the Triton stacked quantizer gives
the CPU reference's bytes per expert (edge cases included), the grouped forward/backward under bf16
autocast agrees with the loop over experts within bf16 noise (plain and QAT, both straight-through
modes, experts without tokens), and neither the grouped MoE nor the QAT group refill syncs with the
host. Runs on the device machine only (bench/run_trainer_device.sh)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_trainer_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

from policy import formats, kernels  # noqa: E402
from policy.model import ModelConfig, MoE, QuantHook, Transformer  # noqa: E402
from policy.qat import apply_qat, bits  # noqa: E402
from policy.recipe import Recipe  # noqa: E402

# tiny's widths but 16 experts, 64 tokens per test batch: some experts get none at 2 x 4 tokens
CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=16, top_k=4)


def _experts(e: int, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(e, m, k, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0  # an all-zero expert
    x[2] *= 1e-38  # a tiny amax: subnormal scales
    x[3] *= 1e30
    if e > 4:
        x[4, :, :32] = 0.0  # zero blocks inside a non-zero tensor
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("fmt", "kw"),
    [("nvfp4", {"scope": "tensor"}), ("nvfp4", {"scope": "row"}), ("int4", {"group_size": 32}), ("mxfp8", {}),
     ("fp8_block", {"block": (128, 128)}), ("bf16", {})],
)  # fmt: skip
@pytest.mark.parametrize(("m", "k"), [(256, 2048), (2048, 768), (5, 64)])
@pytest.mark.parametrize("layout", ["stacked", "separate"])
def test_quantize_stacked_cuda_equals_the_cpu_reference(fmt, kw, dtype, m, k, layout):
    """`separate`: each expert its own allocation, as QAT's parameters (nvfp4 and int4 read them
    where they are, through a table of addresses)."""
    if fmt == "fp8_block" and k % 128:
        pytest.skip("K not a multiple of the block")
    x = _experts(8, m, k, dtype)
    xs = x if layout == "stacked" else [t.clone() for t in x]
    flat, qs = kernels.quantize_stacked(fmt, xs, check_finite=False, **kw)
    for e, q in enumerate(qs):
        ref = formats.get(fmt).quantize(x[e].cpu(), **kw)
        for part, t in ref.parts().items():
            got = q.parts()[part]
            assert got.is_cuda and got.dtype == t.dtype
            assert torch.equal(bits(got.cpu()), bits(t)), (fmt, kw, e, part)
        assert torch.equal(bits(formats.operand(q).values.cpu()), bits(formats.operand(ref).values))


@pytest.mark.parametrize(("fmt", "layout"), [("nvfp4", "stacked"), ("nvfp4", "separate"), ("int4", "separate")])
def test_quantize_stacked_cuda_flags_non_finite(fmt, layout):
    x = _experts(4, 64, 128, torch.bfloat16)
    x[2, 5, 7] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.quantize_stacked(fmt, x if layout == "stacked" else [t.clone() for t in x])


def test_quantize_stacked_cuda_reads_a_list_in_place_or_stacks_it():
    """A list of non-contiguous tensors (transposed views) is stacked first: the same bytes."""
    x = _experts(4, 128, 256, torch.float32)
    views = [t.t().contiguous().t() for t in x]  # same values, column-major
    assert not views[0].is_contiguous()
    for fmt, kw in (("nvfp4", {"scope": "tensor"}), ("int4", {"group_size": 32})):
        a, _ = kernels.quantize_stacked(fmt, views, **kw)
        b, _ = kernels.quantize_stacked(fmt, [t.clone() for t in x], **kw)
        for part, t in b.parts().items():
            assert torch.equal(bits(a.parts()[part]), bits(t)), (fmt, part)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(a.detach().flatten().float(), b.detach().flatten().float(), dim=0)
    )


def _moe_run(moe: MoE, hook, x: torch.Tensor, grouped: bool):
    moe.grouped = grouped
    moe.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = moe(xi, hook)
    y.float().square().mean().backward()
    return y.float(), xi.grad, {n: p.grad for n, p in moe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("recipe", "backward"), [(None, "hp"), ("nvfp4_moe", "hp"), ("nvfp4_moe", "dequant"), ("int4_qat", "hp")]
)
@pytest.mark.parametrize("n_tokens", [4, 64])
def test_grouped_moe_layer_matches_the_loop_on_cuda(recipe, backward, n_tokens):
    """One MoE layer on the same input (so the same routing) both ways: output, input gradient and
    every parameter's gradient agree within bf16 noise (the grouped GEMM sums in another order and,
    with nvfp4 scales, rounds its accumulator to bf16 once more; a flipped bit can move an nvfp4
    activation code); experts without tokens get zero gradients."""
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    hook = apply_qat(model, Recipe.load(recipe), backward) if recipe is not None else QuantHook()
    moe = model.model.layers[0].mlp  # layer 0: nvfp4 under nvfp4_moe (layer 1 is kept bf16)
    g = torch.Generator("cuda").manual_seed(3)
    x = torch.randn(2, n_tokens, CFG.dim, device="cuda", generator=g)
    y0, gx0, gw0 = _moe_run(moe, hook, x, grouped=False)
    y1, gx1, gw1 = _moe_run(moe, hook, x, grouped=True)
    assert _cos(y1, y0) > 0.999 and _cos(gx1, gx0) > 0.999
    assert set(gw0) <= set(gw1)
    assert all(not gw1[n].any() for n in set(gw1) - set(gw0))
    for n, ref in gw0.items():
        if ref.abs().max() > 0:
            assert _cos(gw1[n], ref) > 0.99, n


@pytest.mark.parametrize("recipe", [None, "nvfp4_moe", "int4_qat"])
def test_grouped_model_matches_the_loop_on_cuda(recipe):
    """The whole model both ways: logits within bf16 noise. (Gradients are compared per layer above:
    through several layers a bf16 difference can flip a token's top-k choice downstream.)"""
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    if recipe is not None:
        apply_qat(model, Recipe.load(recipe))
    tokens = torch.randint(0, CFG.vocab_size, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    out = []
    for grouped in (False, True):
        for m in model.modules():
            if isinstance(m, MoE):
                m.grouped = grouped
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out.append(model(tokens).float())
    assert (out[1] - out[0]).abs().max().item() <= 0.05 * out[0].abs().max().item()


def test_grouped_moe_and_refill_do_not_sync():
    """Forward and backward of the grouped MoE with an nvfp4 QAT refill inside: no host sync."""
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    hook = apply_qat(model, Recipe.load("nvfp4_moe"))
    moe = model.model.layers[0].mlp
    x = torch.randn(2, 64, CFG.dim, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = moe(x, hook)
        y.float().square().mean().backward()

    step()  # compiles the kernels
    hook.invalidate()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # refills the expert groups, routes, grouped GEMMs, grouped backward
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(g.stacked is not None for n, g in hook._groups.items() if n.startswith("model.layers.0."))


@pytest.mark.parametrize("recipe", [None, "nvfp4_moe", "bf16"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_teacher_forced_logprobs_equal_the_kv_cache_decode_on_cuda(recipe, grouped):
    """The warm start's teacher-forced forward and generate's prefill + KV-cache decode agree under
    bf16 autocast on the GPU, with Qwen3-30B-A3B's routing (128 experts, top-8: most experts get no
    token in a decode step of 16 rows) on both MoE paths. (The H200 warm start reached loss 0.73 yet
    never generated <eos>: this is the first thing that must hold.)"""
    from rollout.engine import forced_logprobs
    from trainer.sequences import pack

    cfg = ModelConfig.preset("tiny", n_layers=3, n_experts=128, top_k=8, expert_ffn_dim=128, shared_expert_ffn_dim=0)
    with torch.device("cuda"):
        m = Transformer(cfg, seed=2).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # sharp log-probs: a wrong expert output shows
    for mod in m.modules():
        if isinstance(mod, MoE):
            mod.grouped = grouped
    if recipe is not None:
        apply_qat(m, Recipe.load(recipe))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(5, 20, (16,), generator=g)]
    answers = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 8, (16,), generator=g)]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        decoded = forced_logprobs(m, prompts, answers)
        tokens, targets, attn, mask = (t.cuda() for t in pack(prompts, answers, 0))
        with torch.no_grad():
            lp = m.token_logprobs(tokens, targets, attention_mask=attn).cpu()
    mask = mask.cpu()
    diffs = torch.cat([(decoded[b, : len(a)] - lp[b][mask[b] > 0]).abs() for b, a in enumerate(answers)])
    assert diffs.max().item() < 0.5 and diffs.mean().item() < 0.05, (diffs.max().item(), diffs.mean().item())
