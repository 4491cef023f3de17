"""Exact mode end to end on the CPU: the rollout's recorded log-probs equal the trainer's recompute
bit for bit (every completion token, counted) for bf16, int4_qat and nvfp4_moe (fp8_block and mxfp8
marked slow), over prompt groups of mixed lengths batched continuously, with and without routing
replay; with exact off they do not. Plus `loop.exact`'s config rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker.codec import Trajectory
from policy import qat
from policy.loop import AsyncConfig
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.batching import ContinuousBatcher, CpuBackend
from tandem.config import from_dict
from trainer.backends import make_backend
from trainer.config import TrainerConfig
from trainer.step import GRPOStep
from trainer.versions import RetainedVersions

CFG = ModelConfig.preset("tiny", n_layers=2)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]
N = 3  # samples per prompt


def _rollout(model: Transformer, temperature: float, routes: bool) -> list[list[Trajectory]]:
    """The worker's CPU path: groups batched continuously (rows join and leave, the KV cache is rebuilt)."""
    backend = CpuBackend(model, slots=5, temperature=temperature, stop={3}, pad_id=0, record_routes=routes)
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


def _compare(recipe_name: str, *, exact: bool, temperature: float, routes: bool = False) -> tuple[int, int, int]:
    """-> (completion tokens, of which equal bitwise to the recompute under the current weights,
    of which equal to the recompute from the retained version). Also checks the training forward."""
    recipe = Recipe.load(recipe_name)
    cfg = TrainerConfig(groups_per_step=len(PROMPTS), group_size=N, minibatches=1, microbatch_tokens=40)
    backend = make_backend(cfg, CFG, recipe, seed=1, exact=exact)
    backend.apply_qat()
    tensors = backend.quantized_params()
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1, exact=exact)
    versions.add(1, tensors)
    model = Transformer(CFG, seed=None)
    qat.install_packed(model, recipe.plan(CFG), {n: q.value for n, q in tensors.items()}, exact=exact)
    groups = _rollout(model, temperature, routes)
    replay = (len(model.moe_layers()), CFG.top_k) if routes else None
    step = GRPOStep(
        cfg, backend, versions, pad_id=0, temperature=temperature, device=torch.device("cpu"), max_staleness=1,
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
    tokens, equal_prox, equal_retained = _compare(recipe, exact=True, temperature=temperature)
    assert tokens >= 60  # 4 prompts x 3 samples, 6 to 12 tokens each unless a stop token came first
    assert equal_prox == tokens and equal_retained == tokens, (tokens, equal_prox, equal_retained)


def test_exact_mode_with_routing_replay():
    tokens, equal_prox, equal_retained = _compare("nvfp4_moe", exact=True, temperature=1.0, routes=True)
    assert equal_prox == tokens and equal_retained == tokens, (tokens, equal_prox, equal_retained)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4_moe"])
def test_without_exact_mode_some_token_differs(recipe):
    tokens, equal_prox, equal_retained = _compare(recipe, exact=False, temperature=1.0)
    assert equal_prox < tokens and equal_retained < tokens, (tokens, equal_prox, equal_retained)


def test_loop_exact_is_a_bool():
    assert AsyncConfig(exact=True).exact
    with pytest.raises(ValueError, match=r"exact='yes' \(must be true or false\)"):
        AsyncConfig(exact="yes")


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [("rollout", "device", "cuda"), ("trainer", "device", "cuda"), ("trainer", "backend", "megatron")],
)
def test_loop_exact_refuses_the_gpu_paths_in_one_line(section, key, value):
    d = {"loop": {"exact": True}, section: {key: value}}
    if key == "backend":
        d["trainer"]["device"] = "cuda"
    with pytest.raises(ValueError) as e:
        from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg and "loop.exact=true" in msg and f"{section}.{key}={value!r}" in msg
    assert from_dict({"loop": {"exact": True}}).loop.exact  # the CPU default is fine
