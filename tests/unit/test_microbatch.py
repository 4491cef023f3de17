"""trainer.microbatch_tokens: chunking the recompute and accumulating an update's gradient over
chunks gives the gradient of one forward per minibatch (up to float summation order)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from broker.codec import Trajectory
from policy.model import ModelConfig
from policy.recipe import Recipe
from trainer.backends import make_backend
from trainer.config import TrainerConfig
from trainer.step import GRPOStep
from trainer.versions import RetainedVersions

CFG = ModelConfig.preset("tiny", n_layers=2)


def _groups(n_groups=2, group_size=4, seed=0, version=0):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(3, CFG.vocab_size, (4,), generator=g).numpy().astype(np.int32)
        group = []
        for i in range(group_size):
            n = 3 + i
            group.append(Trajectory(
                sample_id=f"g{gi}-{i}", prompt_id=f"p{gi}", group_id=f"g{gi}", sample_index=i,
                group_size=group_size, prompt_tokens=prompt,
                completion_tokens=torch.randint(3, CFG.vocab_size, (n,), generator=g).numpy().astype(np.int32),
                behavior_logprobs=np.full(n, -3.0, dtype=np.float32), reward=float(i % 2), policy_version=version,
                contract_fingerprint="f" * 16, worker_id="w0", created_at=0.0,
            ))  # fmt: skip
        groups.append(group)
    return groups


def _step(microbatch_tokens: int):
    cfg = TrainerConfig(lr=1e-2, groups_per_step=2, group_size=4, minibatches=1, microbatch_tokens=microbatch_tokens)
    recipe = Recipe.load("bf16")
    backend = make_backend(cfg, CFG, recipe, seed=1)
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=0)
    step = GRPOStep(cfg, backend, versions, pad_id=0, temperature=1.0, device=torch.device("cpu"), max_staleness=0)
    batch = step.recompute(_groups(), weights_version=0)
    row = step.optimize(batch, version=0)
    return row, batch.prox, [p.grad.clone() for p in backend.parameters()]  # the one update's gradient


def test_chunked_update_equals_one_forward_per_minibatch():
    whole_row, whole_prox, whole = _step(0)
    chunked_row, chunked_prox, chunked = _step(12)  # rows of ~10 padded tokens: one row per chunk
    torch.testing.assert_close(chunked_prox, whole_prox, rtol=1e-5, atol=1e-5)
    assert abs(whole_row["grad_norm"] - chunked_row["grad_norm"]) < 1e-5 * max(1.0, whole_row["grad_norm"])
    assert len(whole) == len(chunked) and any(float(g.abs().max()) > 0 for g in whole)
    for g_chunked, g_whole in zip(chunked, whole):
        torch.testing.assert_close(g_chunked, g_whole, rtol=1e-4, atol=1e-7)
    assert abs(whole_row["clip_frac"] - chunked_row["clip_frac"]) < 1e-6


def test_microbatch_tokens_is_checked():
    import pytest

    with pytest.raises(ValueError, match="microbatch_tokens=-1"):
        TrainerConfig(microbatch_tokens=-1)


def test_mismatch_split_rows_recomputes_the_sampled_rows_only():
    # Samples of version 1, weights moved since (weights_version None): the split's quantization
    # part comes from v1's retained packed tensors, for rows 0 and 4 of 8 only.
    cfg = TrainerConfig(groups_per_step=2, group_size=4, minibatches=1, mismatch_split_rows=2)
    recipe = Recipe.load("bf16")
    backend = make_backend(cfg, CFG, recipe, seed=1)
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1)
    backend.apply_qat()
    versions.add(1, backend.quantized_params())
    groups = _groups(version=1)
    full = GRPOStep(
        dataclasses.replace(cfg, mismatch_split_rows=0), backend, versions, pad_id=0, temperature=1.0,
        device=torch.device("cpu"), max_staleness=1,
    ).recompute(groups, weights_version=None)  # fmt: skip
    part = GRPOStep(
        cfg, backend, versions, pad_id=0, temperature=1.0, device=torch.device("cpu"), max_staleness=1
    ).recompute(groups, weights_version=None)
    assert full.known.tolist() == [True] * 8
    assert part.known.tolist() == [i in (0, 4) for i in range(8)]
    for i in (0, 4):
        torch.testing.assert_close(part.at_version[i], full.at_version[i], rtol=1e-5, atol=1e-5)  # batch of 2 vs 8
