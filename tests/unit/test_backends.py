"""trainer/backends.py on CPU (the torch backend; megatron's needs CUDA: tests/gpu/test_trainer_gpu.py)
and the activation checkpointing and publish-time finite check it relies on."""

from __future__ import annotations

import pytest
import torch

from policy import qat
from policy.model import ModelConfig
from policy.qat import bits
from policy.recipe import Recipe
from trainer import grpo
from trainer.backends import TorchBackend, make_backend
from trainer.config import TrainerConfig
from trainer.sequences import pack

CFG = ModelConfig.preset("tiny", n_layers=2)


def _batch(seed=0, B=4):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, CFG.vocab_size, (3 + b,), generator=g).tolist() for b in range(B)]
    completions = [torch.randint(0, CFG.vocab_size, (5 + 2 * b,), generator=g).tolist() for b in range(B)]
    return pack(prompts, completions, pad_id=0)  # right-padded, rows of different lengths


def _loss(backend, batch):
    tokens, targets, attn, mask = batch
    logp = backend.token_logprobs(tokens, targets, attention_mask=attn)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = grpo.policy_loss(
        logp,
        logp.detach(),
        logp.detach(),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.28,
        tis_cap=2.0,
        n_tokens=int(mask.sum()),
    )
    return loss


@pytest.mark.slow
def test_update_steps_and_refreshes_the_qat_cache():
    backend = make_backend(TrainerConfig(lr=1e-2), CFG, Recipe.load("nvfp4_moe"), seed=1)
    assert isinstance(backend, TorchBackend)
    backend.apply_qat()
    before = {n: t.clone() for n, t in backend.canonical().items()}
    cached = backend.quantized_params()
    norm = backend.update(_loss(backend, _batch()))
    assert norm > 0
    assert any(not torch.equal(before[n], t) for n, t in backend.canonical().items())
    after = backend.quantized_params()
    assert all(after[n] is not cached[n] for n in cached)  # requantized from the moved master weights
    fresh = qat.quantize_weights(backend.model, backend.recipe)
    n = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert all(
        torch.equal(bits(a), bits(b)) for a, b in zip(after[n].value.parts().values(), fresh[n].parts().values())
    )


def test_checkpoint_state_round_trips_and_names_the_backend():
    a = make_backend(TrainerConfig(), CFG, Recipe.load("bf16"), seed=2)
    a.apply_qat()
    a.update(_loss(a, _batch()))
    ck = a.state_dict()
    assert ck["backend"] == "torch" and set(ck["model"]) == {n for n, _ in a.model.named_parameters()}
    b = make_backend(TrainerConfig(), CFG, Recipe.load("bf16"), seed=3)
    b.load_state_dict(ck)
    assert all(torch.equal(bits(t), bits(b.canonical()[n])) for n, t in a.canonical().items())
    assert b.optimizer.state_dict()["state"][0]["exp_avg"].equal(a.optimizer.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="written by trainer.backend='megatron', this run has 'torch'"):
        b.load_state_dict({**ck, "backend": "megatron"})


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for ckpt in (False, True):
        backend = make_backend(TrainerConfig(activation_checkpointing=ckpt), CFG, Recipe.load("nvfp4_moe"), seed=4)
        backend.apply_qat()
        _loss(backend, _batch(seed=1)).backward()
        grads.append({n: p.grad.clone() for n, p in backend.model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=0, atol=0, msg=n)


def test_publishing_refuses_non_finite_master_weights():
    """The QAT cache quantizes without the per-tensor NaN check (a host sync each on the GPU): the
    backend checks the master weights once per publish instead."""
    backend = make_backend(TrainerConfig(), CFG, Recipe.load("nvfp4_moe"), seed=7)
    backend.apply_qat()
    assert len(backend.quantized_params()) == len(backend.canonical())
    with torch.no_grad():
        backend.model.get_parameter("model.layers.1.mlp.experts.2.down_proj.weight")[0, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"non-finite master weights, not published: model\.layers\.1\.mlp\.experts\.2"
    ):
        backend.quantized_params()
    # The trainer's form: the test queued at the publish, its result read later (the publisher's thread).
    with_nan = backend.finite_check()
    with torch.no_grad():
        backend.model.get_parameter("model.layers.1.mlp.experts.2.down_proj.weight")[0, 0] = 0.0
    fixed = backend.finite_check()
    assert len(backend.quantized_params(check_finite=False)) == len(backend.canonical())
    fixed()  # the weights as they were when each was queued
    with pytest.raises(ValueError, match=r"not published: model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight"):
        with_nan()
