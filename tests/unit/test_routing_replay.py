"""Routing replay (loop.routing_replay): the rollout records each completion token's expert ids per
MoE layer, and the trainer's forward routes those tokens to them.

Checked through the public APIs: the CPU engine, the packed engine (on the CPU) and both
continuous-batching backends record the ids of the forward whose logits sampled each token; packed
by trainer.sequences.scatter_routes, the trainer's forward uses exactly those ids for every
completion token (Transformer.token_logprobs(return_routes=True)); a perturbed router flips some
routing without replay but none with it, and the log-prob mismatch with and without replay is
measured (printed) on a model whose trainer weights differ from the rollout's; the gate stays
differentiable; the trainer's trajectory rule refuses missing or wrong ids with one line."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from broker.codec import Trajectory, decode_trajectory, encode_trajectory
from policy import qat
from policy.loop import AsyncConfig
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.batching import ContinuousBatcher, ModelBackend, PackedBackend
from rollout.engine import generate
from rollout.packed_engine import EngineConfig, PackedEngine
from trainer.backends import make_backend
from trainer.config import TrainerConfig
from trainer.sequences import pack, scatter_routes
from trainer.step import GRPOStep
from trainer.validation import TrajectoryRules, check_trajectory
from trainer.versions import RetainedVersions

# 3 layers, layer 1 dense: the routes' layer axis holds MoE layers 0 and 2 only.
CFG = ModelConfig.preset("tiny", n_layers=3, n_experts=8, top_k=2, mlp_only_layers=[1], ffn_dim=128)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
LAYERS, K = 2, 2


def _trainer_view(prompts, gen, n_samples=1):
    """The trainer's packed rows of a Generation and its per-sample routes at the loss mask."""
    comps = gen.completions()
    rows_prompts = [prompts[r // n_samples] for r in range(len(comps))]
    tokens, targets, attn, mask = pack(rows_prompts, comps, 0)
    per_sample = [gen.routes[r, :n].numpy() for r, n in enumerate(gen.lengths.tolist())]
    return tokens, targets, attn, mask, scatter_routes(per_sample, mask, LAYERS, K)


def _perturbed_router(model: Transformer, scale: float, seed: int = 7) -> Transformer:
    """A copy of `model` whose MoE routers' weights carry Gaussian noise (std `scale`)."""
    other = Transformer(CFG, seed=None)
    other.load_weights({n: p.detach().clone() for n, p in model.named_parameters()})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def test_the_trainer_forward_uses_the_rollouts_experts_for_every_completion_token():
    model = Transformer(CFG, seed=1)
    gen = generate(model, PROMPTS, n_samples=2, max_new_tokens=8, seeds=list(range(6)), record_routes=True)
    assert gen.routes.shape == (6, 8, LAYERS, K)
    tokens, targets, attn, mask, routes = _trainer_view(PROMPTS, gen, n_samples=2)
    on = mask > 0
    assert int((routes[on] < 0).sum()) == 0 and bool((routes[~on] == -1).all())  # prompts and padding: not replayed
    logp, used = model.token_logprobs(tokens, targets, attention_mask=attn, routes=routes, return_routes=True)
    assert used.shape == (*tokens.shape, LAYERS, K)
    assert torch.equal(used[on], routes[on])  # every completion token, every MoE layer, every slot
    _, own = model.token_logprobs(
        tokens, targets, attention_mask=attn, routes=routes, return_routes=True, router_own=True
    )
    assert torch.equal(own[on], routes[on])  # the same router picks what it recorded: agreement 1
    # Same weights: the replayed forward is the rollout's forward, log-probs within fp32 rounding.
    behav = torch.cat([gen.logprobs[r, :n] for r, n in enumerate(gen.lengths.tolist())])
    torch.testing.assert_close(logp[on], behav, rtol=1e-5, atol=1e-5)


def test_a_perturbed_router_flips_routing_without_replay_but_not_with_it():
    rollout = Transformer(CFG, seed=1)
    trainer = _perturbed_router(rollout, scale=0.005)
    gen = generate(rollout, PROMPTS, n_samples=4, max_new_tokens=12, seeds=list(range(12)), record_routes=True)
    tokens, targets, attn, mask, routes = _trainer_view(PROMPTS, gen, n_samples=4)
    on = mask > 0
    behav = torch.cat([gen.logprobs[r, :n] for r, n in enumerate(gen.lengths.tolist())]).detach()
    with torch.no_grad():
        free, used_free = trainer.token_logprobs(tokens, targets, attention_mask=attn, return_routes=True)
        replay, used_replay = trainer.token_logprobs(
            tokens, targets, attention_mask=attn, routes=routes, return_routes=True
        )
    flipped = (used_free[on].sort(dim=-1).values != routes[on].sort(dim=-1).values).any(dim=-1)  # [tokens, layers]
    assert int(flipped.sum()) > 0, "the perturbation flipped no routing: the test checks nothing"
    assert torch.equal(used_replay[on], routes[on])
    with torch.no_grad():
        _, own = trainer.token_logprobs(
            tokens, targets, attention_mask=attn, routes=routes, return_routes=True, router_own=True
        )
    assert not torch.equal(own[on], routes[on])  # router_own: the perturbed router's picks, not the replayed ids
    diff_free = (free[on] - behav).abs()
    diff_replay = (replay[on] - behav).abs()
    print(
        f"\nrouter noise 0.005 (a quarter of the init std): {float(flipped.any(dim=-1).double().mean()):.1%} of tokens routed differently in >= 1 "
        f"layer without replay; |logp_rollout - logp_trainer| mean {float(diff_free.mean()):.3e} "
        f"(max {float(diff_free.max()):.3e}) without replay, {float(diff_replay.mean()):.3e} "
        f"(max {float(diff_replay.max()):.3e}) with"
    )
    assert float(diff_replay.mean()) < float(diff_free.mean())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_under_replay_the_gate_stays_differentiable(checkpointing):
    model = Transformer(CFG, seed=1)
    gen = generate(model, PROMPTS, max_new_tokens=6, seeds=[1, 2, 3], record_routes=True)
    tokens, targets, attn, mask, routes = _trainer_view(PROMPTS, gen)
    model.activation_checkpointing = checkpointing  # the layers run again in the backward, replayed too
    logp, used = model.token_logprobs(tokens, targets, attention_mask=attn, routes=routes, return_routes=True)
    assert torch.equal(used[mask > 0], routes[mask > 0])
    (logp * mask).sum().backward()
    gate = dict(model.named_parameters())["model.layers.2.mlp.gate.weight"]
    assert gate.grad is not None and float(gate.grad.abs().max()) > 0


def test_route_ids_are_one_byte_up_to_256_experts():
    from rollout.batching import route_dtype

    assert route_dtype(8) == route_dtype(256) == np.uint8 and route_dtype(257) == np.uint16


def test_bad_forced_routes_are_refused_with_one_line():
    model = Transformer(CFG, seed=1)
    tokens = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"routes shape \(1, 4, 3, 2\) != \(1, 4, 2, 2\)"):
        model.token_logprobs(tokens, tokens, routes=torch.zeros(1, 4, 3, 2, dtype=torch.long))


@functools.cache
def _packed(recipe: str):
    model = Transformer(CFG, seed=1)
    plan = Recipe.load(recipe).plan(model)
    return plan, qat.quantize_weights(model, plan)


def _engine(recipe: str, max_batch: int = 8) -> tuple[Transformer, PackedEngine]:
    plan, packed = _packed(recipe)
    ref = Transformer(CFG, seed=None)
    qat.install_packed(ref, plan, packed)
    ecfg = EngineConfig(max_batch=max_batch, max_seq_len=48, record_routes=True)
    return ref, PackedEngine(CFG, plan, packed, device="cpu", dtype=torch.float32, engine=ecfg)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4_moe"])
def test_the_packed_engine_records_the_reference_engines_routes(recipe):
    ref, eng = _engine(recipe)
    a = generate(ref, PROMPTS, n_samples=2, max_new_tokens=10, temperature=0.0, record_routes=True)
    b = eng.generate(PROMPTS, n_samples=2, max_new_tokens=10, temperature=0.0)
    assert torch.equal(a.tokens, b.tokens) and b.routes is not None and b.routes.shape == (6, 10, LAYERS, K)
    assert torch.equal(a.routes, b.routes)
    assert eng.out_routes.dtype == torch.uint8


def _run(backend, groups):
    b = ContinuousBatcher(backend, max_inflight_groups=2, version=1)
    out, pending = {}, list(groups)
    while pending or not b.idle:
        while pending and b.can_submit():
            key, prompt, seeds = pending.pop(0)
            b.submit(key, prompt, seeds, max_new_tokens=7)
        for r in b.step():
            out[r.key] = r
    return out


@pytest.mark.parametrize("kind", ["cpu", "packed"])
def test_the_batchers_carry_each_samples_routes(kind):
    ref, eng = _engine("int4_qat", max_batch=4)
    groups = [(g, p, [10 * g + i for i in range(3)]) for g, p in enumerate(PROMPTS)]
    if kind == "cpu":
        backend = ModelBackend(ref, slots=4, temperature=1.0, stop=set(), pad_id=0, record_routes=True)
    else:
        backend = PackedBackend(eng, temperature=1.0, stop=set(), pad_id=0, check_every=2)
    out = _run(backend, groups)
    fresh = _engine("int4_qat")[1]  # the packed engine samples with its own counter-based RNG
    for g, prompt, seeds in groups:
        if kind == "cpu":
            alone = generate(ref, [prompt], n_samples=3, max_new_tokens=7, seeds=seeds, record_routes=True)
        else:
            alone = fresh.generate([prompt], n_samples=3, max_new_tokens=7, seeds=seeds)
        r = out[g]
        assert r.tokens == alone.completions()
        for i, routes in enumerate(r.routes):
            assert routes.dtype == np.uint8 and routes.shape == (len(r.tokens[i]), LAYERS, K)
            assert routes.tolist() == alone.routes[i, : len(r.tokens[i])].tolist(), (g, i)


def test_without_replay_or_without_moe_layers_nothing_is_recorded():
    model = Transformer(CFG, seed=1)
    assert generate(model, PROMPTS, max_new_tokens=3, seeds=[1, 2, 3]).routes is None
    out = _run(ModelBackend(model, slots=4, temperature=1.0, stop=set(), pad_id=0), [(0, PROMPTS[0], [1, 2])])
    assert out[0].routes == [None, None]
    dense = Transformer(ModelConfig.preset("tiny-dense", n_layers=2), seed=1)
    backend = ModelBackend(dense, slots=4, temperature=1.0, stop=set(), pad_id=0, record_routes=True)
    assert _run(backend, [(0, PROMPTS[0], [1, 2])])[0].routes == [None, None]


def _trajectories(gen, prompt, *, reward_of=lambda i: float(i % 2)):
    return [
        Trajectory(
            sample_id=f"g0/{i}",
            prompt_id="p0",
            group_id="g0",
            sample_index=i,
            group_size=len(gen.lengths),
            prompt_tokens=np.asarray(prompt, dtype=np.int32),
            completion_tokens=gen.tokens[i, :n].numpy().astype(np.int32),
            behavior_logprobs=gen.logprobs[i, :n].detach().numpy(),
            reward=reward_of(i),
            policy_version=1,
            contract_fingerprint="f" * 16,
            worker_id="w0",
            created_at=0.0,
            routed_experts=gen.routes[i, :n].numpy().astype(np.uint8),
        )  # fmt: skip
        for i, n in enumerate(gen.lengths.tolist())
    ]


def test_the_trainer_step_replays_the_routes_it_decoded():
    """Through the codec and trainer.step: with replay the recompute's mismatch against a rollout
    whose router differs is smaller; the step trains (a finite update)."""
    cfg = TrainerConfig(lr=1e-3, groups_per_step=1, group_size=4, minibatches=1)
    recipe = Recipe.load("bf16")
    rows = {}
    for replay in (False, True):
        backend = make_backend(cfg, CFG, recipe, seed=1)
        rollout = _perturbed_router(backend.model, scale=0.005)
        gen = generate(rollout, [PROMPTS[0]], n_samples=4, max_new_tokens=12, seeds=[1, 2, 3, 4], record_routes=True)
        group = [decode_trajectory(encode_trajectory(t)) for t in _trajectories(gen, PROMPTS[0])]
        versions = RetainedVersions(CFG, recipe.plan(CFG), keep=0)
        step = GRPOStep(
            cfg, backend, versions, pad_id=0, temperature=1.0, device=torch.device("cpu"), max_staleness=0,
            replay_routes=(LAYERS, K) if replay else None,
        )  # fmt: skip
        batch = step.recompute([group], weights_version=1)
        assert (batch.routes is not None) == replay
        rows[replay] = step.optimize(batch, version=1)
        assert np.isfinite(rows[replay]["grad_norm"]) and rows[replay]["grad_norm"] > 0
    off, on = rows[False]["logp_abs_diff"], rows[True]["logp_abs_diff"]
    print(f"\ntrainer.step |prox - behavior| mean: {off:.3e} without replay, {on:.3e} with")
    assert on < off
    # The perturbed router disagrees with the recorded experts somewhere, not everywhere.
    assert "router_agree_frac" not in rows[False]
    assert 0.5 < rows[True]["router_agree_frac"] < 1.0
    assert rows[True]["tokens_routed_as_rollout_frac"] <= rows[True]["router_agree_frac"]


def test_the_trajectory_rule_needs_the_runs_routes():
    model = Transformer(CFG, seed=1)
    gen = generate(model, [PROMPTS[0]], n_samples=2, max_new_tokens=4, seeds=[1, 2], record_routes=True)
    good = _trajectories(gen, PROMPTS[0])[0]
    rules = TrajectoryRules(
        group_size=2, vocab_size=CFG.vocab_size, max_seq_len=CFG.max_seq_len, max_completion_tokens=16,
        max_abs_reward=10.0, routes=(LAYERS, K, CFG.n_experts),
    )  # fmt: skip
    fed = np.asarray(PROMPTS[0], dtype=np.int32)
    assert check_trajectory(good, rules, version=1, fed_prompt=fed) is None

    def with_routes(r):
        fields = {n: getattr(good, n) for n in good.__dataclass_fields__}
        return Trajectory(**(fields | {"routed_experts": r}))

    n = len(good.completion_tokens)
    dup = good.routed_experts.copy()
    dup[0, 1] = dup[0, 1, 0]
    for r, reason in [
        (None, "no routed_experts"),
        (np.zeros((n, 3, K), np.uint8), f"want ({n}, 2, 2)"),
        (np.full((n, LAYERS, K), 8, np.uint8), "expert id 8 (want < n_experts=8)"),
        (dup, "repeat an expert"),
    ]:
        why = check_trajectory(with_routes(r), rules, version=1, fed_prompt=fed)
        assert why is not None and reason in why and "\n" not in why


def test_the_loop_key_is_validated_with_one_line():
    assert AsyncConfig(routing_replay=True).routing_replay is True
    with pytest.raises(ValueError, match=r"routing_replay='yes' \(must be true or false\)"):
        AsyncConfig(routing_replay="yes")


def test_megatron_with_routing_replay_is_refused_with_one_line():
    from tandem.config import RunConfig

    with pytest.raises(ValueError) as e:
        RunConfig(loop=AsyncConfig(routing_replay=True), trainer=TrainerConfig(backend="megatron", device="cuda"))
    assert "loop.routing_replay=true with trainer.backend='megatron'" in str(e.value) and "\n" not in str(e.value)


def test_the_older_versions_forward_replays_the_routes_too():
    """The mismatch split's forward under a retained version (trainer.versions) takes the routes:
    on the same weights it gives the trainer's replayed recompute, token for token."""
    cfg = TrainerConfig(lr=1e-3, groups_per_step=1, group_size=4, minibatches=1)
    recipe = Recipe.load("nvfp4_moe")
    backend = make_backend(cfg, CFG, recipe, seed=1)
    backend.apply_qat()
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1)
    versions.add(1, backend.quantized_params(), live=backend.parameters())
    rollout = _perturbed_router(backend.model, scale=0.005)
    gen = generate(rollout, [PROMPTS[0]], n_samples=4, max_new_tokens=12, seeds=[1, 2, 3, 4], record_routes=True)
    step = GRPOStep(
        cfg, backend, versions, pad_id=0, temperature=1.0, device=torch.device("cpu"), max_staleness=1,
        replay_routes=(LAYERS, K),
    )  # fmt: skip
    batch = step.recompute([_trajectories(gen, PROMPTS[0])], weights_version=None)  # forces version 1's forward
    on = batch.mask > 0
    assert bool(batch.token_known[on].all())
    torch.testing.assert_close(batch.at_version[on], batch.prox[on], rtol=0, atol=1e-5)
