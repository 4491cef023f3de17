"""The trainer's QAT on a GPU: the CUDA quantizers give the CPU reference's published bytes, the
cache refreshes once per optimizer step under bf16 autocast, and publishing from the QAT cache
equals a fresh quantization. Runs on the device machine only (bench/run_device.sh)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from policy import manifest as mf
from policy import qat  # noqa: E402
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.recipe import Recipe  # noqa: E402

CFG = ModelConfig.preset("tiny", n_layers=2)


def _manifest(model: Transformer, recipe: Recipe, tensors) -> dict[str, bytes]:
    contract = contract_from_recipe(model_config=CFG, recipe=recipe)
    packed = mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors)
    return {t.name: t.sha256 for t in packed.manifest.tensors}


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "int4_qat", "mxfp8", "fp8_block"])
def test_gpu_qat_publishes_the_cpu_reference_bytes_and_refreshes_per_step(recipe_name):
    recipe = Recipe.load(recipe_name)
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    hook = qat.apply_qat(model, recipe, optimizer=opt)
    tokens = torch.randint(0, CFG.vocab_size, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp = model.token_logprobs(tokens[:, :-1], tokens[:, 1:])
    assert torch.isfinite(logp).all()
    cached = hook.quantized_params(model)
    cpu_master = {n: p.detach().cpu() for n, p in model.named_parameters()}
    reference = quantize_params(cpu_master, recipe.plan(CFG))  # the CPU reference quantizers
    assert _manifest(model, recipe, cached) == _manifest(model, recipe, reference)

    (-logp.mean()).backward()
    opt.step()  # fused: no version bump; the step post-hook must invalidate
    after = hook.quantized_params(model)
    assert any(after[n] is not cached[n] for n in cached)
    moved = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert _manifest(model, recipe, after) == _manifest(model, recipe, quantize_params(moved, recipe.plan(CFG)))


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "int4_qat"])
def test_a_qat_step_on_the_step_thread_equals_one_on_the_main_thread(recipe_name):
    """The trainer's steps run on a thread of their own (trainer.step_thread): there, the QAT forward
    (the CUDA quantizers, Triton kernels) gives the main thread's log-probs bit for bit, and the
    optimizer step the same weights (to the backward's atomics)."""
    import asyncio

    from trainer.step_thread import StepThread

    recipe = Recipe.load(recipe_name)

    def step():
        with torch.device("cuda"):
            model = Transformer(CFG, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        qat.apply_qat(model, recipe, optimizer=opt)
        gen = torch.Generator("cuda").manual_seed(0)
        tokens = torch.randint(0, CFG.vocab_size, (4, 32), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp = model.token_logprobs(tokens[:, :-1], tokens[:, 1:])
        (-logp.mean()).backward()
        opt.step()
        return logp.detach(), {n: p.detach().clone() for n, p in model.named_parameters()}

    async def on_the_step_thread():
        steps = StepThread(torch.device("cuda"))
        try:
            return await steps.run(step)
        finally:
            steps.close()

    logp, weights = step()
    logp_t, weights_t = asyncio.run(on_the_step_thread())
    assert torch.equal(logp, logp_t)
    for name, w in weights.items():
        torch.testing.assert_close(weights_t[name], w, msg=name)


# ---- the trainer's backends (trainer/backends.py) on the GPU: torch and megatron-core


@pytest.fixture(scope="module")
def backends():
    """(torch, megatron) backends of CFG, nvfp4_moe QAT installed, the same seed (so the same weights)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from trainer.backends import make_backend
    from trainer.config import TrainerConfig

    recipe = Recipe.load("nvfp4_moe")
    made = [
        make_backend(TrainerConfig(device="cuda", backend=b, lr=1e-3), CFG, recipe, seed=5)
        for b in ("torch", "megatron")
    ]
    for b in made:
        b.apply_qat()
    yield made
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _padded_batch(seed: int = 0):
    from trainer.sequences import pack

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, CFG.vocab_size, (4 + 3 * b,), generator=g).tolist() for b in range(4)]
    completions = [torch.randint(0, CFG.vocab_size, (20 - 2 * b,), generator=g).tolist() for b in range(4)]
    return [t.cuda() for t in pack(prompts, completions, pad_id=0)]  # right-padded, ragged rows


def _published(backend) -> dict[str, bytes]:
    contract = contract_from_recipe(model_config=CFG, recipe=backend.recipe)
    packed = mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=backend.quantized_params())
    return {n: bytes(b) for n, b in packed.blobs.items()}


def test_backends_same_weights_publish_the_same_bytes_and_agree_on_logprobs(backends):
    tb, mg = backends
    a, b = tb.canonical(), mg.canonical()
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert _published(tb) == _published(mg)  # bit for bit, through the same contract code
    tokens, targets, attn, mask = _padded_batch()
    with torch.no_grad(), tb.autocast():
        lt = tb.token_logprobs(tokens, targets, attention_mask=attn)
        lm = mg.token_logprobs(tokens, targets, attention_mask=attn)
    with torch.no_grad():
        l32 = tb.model.token_logprobs(tokens, targets, attention_mask=attn)  # fp32 reference, same QAT
    m = mask.bool()
    noise, err = (lt - l32)[m].abs().mean().item(), (lm - l32)[m].abs().mean().item()
    print(f"trainer log-probs vs fp32: torch-bf16 {noise:.2e}, megatron-bf16 {err:.2e}")
    assert err <= 3 * noise + 1e-4
    left = torch.flip(attn, dims=[1])  # left padding: megatron's RoPE positions would be wrong
    with pytest.raises(ValueError, match="right-padded"):
        mg.token_logprobs(tokens, targets, attention_mask=left)


def test_backends_grpo_update_refreshes_qat_and_checkpoints_round_trip(backends):
    from trainer import grpo
    from trainer.backends import make_backend
    from trainer.config import TrainerConfig

    tokens, targets, attn, mask = _padded_batch(seed=1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], device="cuda")
    moved = []
    for backend in backends:
        before = {n: t.clone() for n, t in backend.canonical().items()}
        cached = backend.quantized_params()
        with backend.autocast():
            logp = backend.token_logprobs(tokens, targets, attention_mask=attn)
        loss, _ = grpo.policy_loss(
            logp, logp.detach(), logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0,
            n_tokens=int(mask.sum()),
        )  # fmt: skip
        assert backend.update(loss) > 0
        after = backend.canonical()
        moved.append({n: (after[n] - before[n]).float() for n in after})
        fresh = quantize_params(after, backend.recipe.plan(CFG))
        now = backend.quantized_params()
        assert any(now[n] is not cached[n] for n in cached)  # the cache was invalidated by the update
        assert _manifest(None, backend.recipe, now) == _manifest(None, backend.recipe, fresh)
    # the same loss on the same weights moves both the same way (AdamW's first step: ~lr * sign(g))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert F.cosine_similarity(moved[0][name].flatten(), moved[1][name].flatten(), dim=0) > 0.9
    # checkpoint: canonical weights + optimizer state, restored bit for bit into a fresh backend
    mg = backends[1]
    ck = mg.state_dict()
    again = make_backend(TrainerConfig(device="cuda", backend="megatron"), CFG, mg.recipe, seed=9)
    again.load_state_dict(ck)
    assert all(torch.equal(t, again.canonical()[n]) for n, t in mg.canonical().items())
    with pytest.raises(ValueError, match="written by trainer.backend='megatron'"):
        backends[0].load_state_dict(ck)


def test_activation_checkpointing_on_the_gpu_gives_the_same_gradients(backends):
    from trainer.backends import make_backend
    from trainer.config import TrainerConfig

    tokens, targets, attn, mask = _padded_batch(seed=2)
    for name in ("torch", "megatron"):
        grads = []
        for ckpt in (False, True):
            b = make_backend(
                TrainerConfig(device="cuda", backend=name, activation_checkpointing=ckpt), CFG, Recipe.load("nvfp4_moe"),
                seed=3,
            )  # fmt: skip
            b.apply_qat()
            with b.autocast():
                (b.token_logprobs(tokens, targets, attention_mask=attn) * mask).sum().backward()
            grads.append({n: p.grad.clone() for n, p in b.module.named_parameters() if p.grad is not None})
            del b
        assert grads[0].keys() == grads[1].keys()
        for n, g in grads[0].items():
            torch.testing.assert_close(grads[1][n], g, rtol=1e-2, atol=1e-5, msg=f"{name} {n}")


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "fp8_block"])
def test_retained_version_on_the_gpu_is_that_versions_qat_forward(recipe_name):
    """trainer.versions on CUDA under bf16 autocast (as the trainer runs it): a version held as the
    packed tensors of its publish gives the QAT forward of its weights after the weights moved and
    the cache was refilled, from a scratch model on the meta device. Same code, same device, same
    shapes: equal bit for bit (the CPU test asserts the same)."""
    from trainer.versions import RetainedVersions

    recipe = Recipe.load(recipe_name)
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    hook = qat.apply_qat(model, recipe)
    tokens = torch.randint(0, CFG.vocab_size, (3, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    targets, attn = tokens.roll(-1, 1), torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = model.token_logprobs(tokens, targets, attention_mask=attn)
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1)
    versions.add(1, hook.quantized_params(model), live=list(model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hook.invalidate()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        moved = model.token_logprobs(tokens, targets, attention_mask=attn)  # refills the cache
        got = versions.token_logprobs(1, tokens, targets, attention_mask=attn)
    assert got.device.type == "cuda" and not torch.equal(moved, want)
    assert torch.equal(qat.bits(got), qat.bits(want))
