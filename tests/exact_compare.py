"""Exact mode's proof, shared by tests/unit/test_exact_mode.py (CPU) and tests/gpu/test_exact_gpu.py
(CUDA): a rollout through the worker's model engine, batched continuously, against the trainer's
recompute under the current weights, under the retained version, and its training forward."""

from __future__ import annotations

import numpy as np
import torch

from broker.codec import Trajectory
from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.batching import ContinuousBatcher, ModelBackend
from trainer.backends import make_backend
from trainer.config import TrainerConfig
from trainer.step import GRPOStep
from trainer.versions import RetainedVersions

CFG = ModelConfig.preset("tiny", n_layers=2)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
N = 3  # samples per prompt


def rollout(model: Transformer, temperature: float, routes: bool) -> list[list[Trajectory]]:
    """The worker's model engine: groups batched continuously (rows join and leave, the KV cache is rebuilt)."""
    backend = ModelBackend(model, slots=5, temperature=temperature, stop={3}, pad_id=0, record_routes=routes)
    batcher = ContinuousBatcher(backend, max_inflight_groups=2, version=1)
    results, pending = [], list(enumerate(PROMPTS))
    while pending or not batcher.idle:
        while pending and batcher.can_submit():
            g, prompt = pending.pop(0)
            batcher.submit(g, prompt, [100 * g + i for i in range(N)], max_new_tokens=[6, 9, 12])
        results += batcher.step()
    return [
        [
            Trajectory(
                sample_id=f"g{r.key}-{i}", prompt_id=f"p{r.key}", group_id=f"g{r.key}", sample_index=i,
                group_size=N, prompt_tokens=np.array(PROMPTS[r.key], dtype=np.int32),
                completion_tokens=np.array(r.tokens[i], dtype=np.int32),
                behavior_logprobs=np.array(r.logprobs[i], dtype=np.float32), reward=float(i % 2),
                policy_version=1, contract_fingerprint="f" * 16, worker_id="w0", created_at=0.0,
                routed_experts=r.routes[i] if routes else None,
            )
            for i in range(N)
        ]
        for r in sorted(results, key=lambda r: r.key)
    ]  # fmt: skip


def compare(
    recipe_name: str, *, exact: bool, temperature: float, routes: bool = False, device: str = "cpu"
) -> tuple[int, int, int]:
    """-> (completion tokens, of which equal bitwise to the recompute under the current weights,
    of which equal to the recompute from the retained version). Also checks the training forward.
    Rollout and trainer both on `device` (on CUDA the trainer in fp32, as exact mode needs)."""
    recipe = Recipe.load(recipe_name)
    cfg = TrainerConfig(
        groups_per_step=len(PROMPTS), group_size=N, minibatches=1, microbatch_tokens=40, device=device, dtype="float32"
    )
    backend = make_backend(cfg, CFG, recipe, seed=1, exact=exact)
    backend.apply_qat()
    tensors = backend.quantized_params()
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1, exact=exact)
    versions.add(1, tensors)
    with torch.device(device):
        model = Transformer(CFG, seed=None)
    qat.install_packed(model, recipe.plan(CFG), {n: q.value for n, q in tensors.items()}, exact=exact)
    groups = rollout(model, temperature, routes)
    replay = (len(model.moe_layers()), CFG.top_k) if routes else None
    step = GRPOStep(
        cfg, backend, versions, pad_id=0, temperature=temperature, device=torch.device(device), max_staleness=1,
        replay_routes=replay,
    )  # fmt: skip
    current = step.recompute(groups, weights_version=1)  # prox: the QAT forward of the master weights
    retained = step.recompute(groups, weights_version=None)  # at_version: version 1's packed tensors
    on = current.mask > 0
    behav = current.behav[on]
    train = backend.token_logprobs(
        current.tokens, current.targets, attention_mask=current.attn, temperature=temperature, routes=current.routes
    )  # the training forward, autograd on
    assert train.requires_grad
    if exact:
        assert torch.equal(train.detach()[on], current.prox[on])
    return int(on.sum()), int((current.prox[on] == behav).sum()), int((retained.at_version[on] == behav).sum())
