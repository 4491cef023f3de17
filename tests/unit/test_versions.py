"""trainer.versions: older versions for the mismatch split from the packed tensors their publish
produced, and the trainer's use of them (publish -> retain -> at_version; restart)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import yaml

from broker.codec import Trajectory
from broker.keys import Keys
from broker.registry import PolicyRegistry
from broker.streams import connect
from policy import compute, formats, qat
from policy.formats.params import QuantizedParam
from policy.model import ModelConfig, MoE, Transformer
from policy.recipe import Recipe
from tandem import config as run_config
from tandem.services import trainer_parts
from trainer.versions import RetainedVersions, aliasing

CFG = ModelConfig.preset("tiny", n_layers=2, dim=64, n_experts=4, expert_ffn_dim=64, shared_expert_ffn_dim=0)


def _batch(seed: int, rows: int = 3, length: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, CFG.vocab_size, (rows, length), generator=g)
    attn = torch.ones(rows, length, dtype=torch.bool)
    attn[1, -3:] = False  # a right-padded row
    return tokens, tokens.roll(-1, dims=1), attn


def _grouped(model: Transformer, grouped: bool | None) -> Transformer:
    """Force the MoE layers' grouped GEMM (True) or their loop over experts (False)."""
    for mod in model.modules():
        if isinstance(mod, MoE):
            mod.grouped = grouped
    return model


def _qat_logprobs(weights: dict, recipe, tokens, targets, attn, temperature=0.7, cfg=CFG, grouped=None) -> torch.Tensor:
    """The reference: a fresh model holding `weights` under the QAT forward."""
    m = _grouped(Transformer(cfg, seed=None), grouped)
    m.load_weights(weights)
    qat.apply_qat(m, recipe)
    with torch.no_grad():
        return m.token_logprobs(tokens, targets, attention_mask=attn, temperature=temperature)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "mxfp8", "bf16", "int4_qat"])
def test_at_version_is_the_qat_forward_of_that_versions_weights_bitwise(recipe_name, grouped):
    recipe = Recipe.load(recipe_name)
    model = _grouped(Transformer(CFG, seed=3), grouped)
    hook = qat.apply_qat(model, recipe)  # its experts are refilled as stacked groups
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=2)
    _grouped(versions.scratch, grouped)
    v1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    versions.add(1, hook.quantized_params(model), live=list(model.parameters()))
    with torch.no_grad():  # an optimizer step: the master weights move in place, the cache is refilled
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hook.invalidate()
    tokens, targets, attn = _batch(0)
    with torch.no_grad():  # refills the cache first: v1's retained objects must not be written over
        now = model.token_logprobs(tokens, targets, attention_mask=attn, temperature=0.7)
    got = versions.token_logprobs(1, tokens, targets, attention_mask=attn, temperature=0.7)
    want = _qat_logprobs(v1, recipe, tokens, targets, attn, grouped=grouped)
    assert torch.equal(qat.bits(got), qat.bits(want))  # same operands, same code: bit for bit
    assert not torch.equal(now, got)  # the test can fail: the current weights give other log-probs
    assert versions.scratch.quant_hook is None  # the operands live only during the call
    assert all(p.device.type == "meta" for p in versions.scratch.parameters())  # the scratch model holds nothing


def _counting(monkeypatch, module, name: str) -> list:
    """Record every call of module.name (then call it)."""
    calls, fn = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "bf16"])
def test_at_version_takes_the_grouped_gemm_where_the_qat_forward_does_with_operands_built_once(
    recipe_name, monkeypatch
):
    """The retained path runs each MoE projection as one grouped GEMM on one stacked operand built
    from the version's packed parts in one formats.operand call (not one per expert, then a stack):
    the weight operands it builds per call are one per non-expert weight plus one per projection,
    however many chunks the rows come in."""
    recipe = Recipe.load(recipe_name)
    model = _grouped(Transformer(CFG, seed=3), True)
    hook = qat.apply_qat(model, recipe)
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1)
    _grouped(versions.scratch, True)
    versions.add(1, hook.quantized_params(model), live=list(model.parameters()))
    tokens, targets, attn = _batch(1)
    with torch.no_grad():
        model.token_logprobs(tokens, targets, attention_mask=attn)  # the QAT cache filled
    grouped = _counting(monkeypatch, compute, "grouped_matmul")
    stacks = _counting(monkeypatch, qat, "_stack_operands")
    builds = _counting(monkeypatch, formats, "operand")
    with torch.no_grad():
        want = model.token_logprobs(tokens, targets, attention_mask=attn)
    qat_grouped, qat_builds = len(grouped), len(builds)  # activations only: the weights are cached
    got = versions.token_logprobs(1, tokens, targets, attention_mask=attn)
    assert torch.equal(qat.bits(got), qat.bits(want))
    moe_layers = sum(isinstance(m, MoE) for m in model.modules())
    assert qat_grouped == 2 * moe_layers > 0
    assert len(grouped) - qat_grouped == qat_grouped  # the same grouped GEMMs: no loop over experts
    assert stacks == []  # no per-call stack of per-expert operands
    experts = sum(".experts." in n for n, _ in model.named_parameters())
    expected = sum(1 for _ in model.parameters()) - experts + 2 * moe_layers
    assert versions.last_builds == len(builds) - 2 * qat_builds == expected  # + the same activations
    # In chunks (as the trainer's microbatches): layer by layer, so still each operand built once.
    chunks = [torch.tensor([2]), torch.tensor([0, 1])]
    got = versions.token_logprobs(1, tokens, targets, chunks=chunks, attention_mask=attn)
    with torch.no_grad():
        want = torch.cat([model.token_logprobs(tokens[r], targets[r], attention_mask=attn[r]) for r in chunks])
    assert torch.equal(qat.bits(got), qat.bits(want))
    assert versions.last_builds == expected


def test_versions_beyond_keep_are_released_and_bytes_are_the_packed_parts():
    recipe = Recipe.load("bf16")  # every parameter one bf16 tensor: 2 bytes per parameter
    model = Transformer(CFG, seed=0)
    hook = qat.apply_qat(model, recipe)
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=2)
    for v in range(1, 6):
        versions.add(v, hook.quantized_params(model))
        assert versions.versions() == list(range(max(1, v - 2), v + 1))
    assert 2 not in versions and 3 in versions
    assert versions.nbytes(5) == 2 * CFG.num_parameters()
    assert versions.nbytes() == 3 * 2 * CFG.num_parameters()
    nv = Recipe.load("nvfp4_moe")
    packed = qat.apply_qat(model, nv).quantized_params(model)
    versions.add(6, packed)
    assert versions.nbytes(6) < versions.nbytes(5)  # 4-bit experts: less than bf16
    assert RetainedVersions(CFG, recipe.plan(CFG), keep=0).keep == 0
    partial = {n: q for n, q in packed.items() if n != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"version 7: no quantized tensor for \['model\.norm\.weight'\] \(of 1\)"):
        versions.add(7, partial)
    with pytest.raises(ValueError, match="keep=-1"):
        RetainedVersions(CFG, recipe.plan(CFG), keep=-1)


def test_parts_aliasing_a_live_parameter_are_cloned():
    recipe = Recipe.load("bf16")
    model = Transformer(CFG, seed=0)
    tensors = qat.apply_qat(model, recipe).quantized_params(model)
    w = torch.randn(1, CFG.dim).to(torch.bfloat16)  # a live bf16 parameter, and a bf16 object holding it as is
    tensors["model.norm.weight"] = QuantizedParam("bf16", {}, formats.bf16.BF16Tensor(w, (1, CFG.dim)))
    assert aliasing(tensors, [w]) == ["model.norm.weight"]  # quantize_param itself always copies
    assert aliasing(tensors, list(model.parameters())) == []
    versions = RetainedVersions(CFG, recipe.plan(CFG), keep=1)
    versions.add(1, tensors, live=[w])
    before = w.clone()
    w.add_(1.0)  # the optimizer writes the parameter in place
    assert torch.equal(versions._packed[1]["model.norm.weight"].values, before)
    versions.add(2, tensors)  # not live: held as is
    assert versions._packed[2]["model.norm.weight"].values is w


# --------------------------------------------------------------------------------------------------
# The trainer: publish retains, recompute uses, a restart forgets.


def _parts(tmp_path, redis_url, run_id, name: str, redis):
    """The trainer's components (trainer.parts), publishing through a real policy server and Redis."""
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "loop": {"max_staleness": 2, "seed": 1},
        "recipe": "nvfp4_moe",
        "model": {"preset": "tiny", "overrides": {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64}},
        "task": {"digits": 1},
        "trainer": {"group_size": 2, "metrics_port": -1, "checkpoint_every": 0, "grpc_port": 0},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    parts = trainer_parts(run_config.load(str(path), []), tmp_path / name)
    parts.backend.apply_qat()
    parts.publishing.start(PolicyRegistry(redis, Keys(run_id=run_id)))
    return parts


async def _publish(parts, version: int) -> None:
    await parts.publishing.publish(version, announced=lambda: None)
    await parts.publishing.idle()  # raises if it failed
    assert version in parts.publishing.server.versions()


def _step(parts, seed: int) -> None:
    """What an optimizer step does to the weights (moved in place, the QAT cache invalidated)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in parts.backend.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    parts.backend.qat_hook.invalidate()


def _group(trainer, versions: list[int], tokens: list | None = None) -> list[Trajectory]:
    """Samples of policy versions `versions`; `tokens`: each one's token versions (default all at it)."""
    out = []
    for i, v in enumerate(versions):
        prompt = np.array([1, 5 + i, 7, 9], dtype=np.int32)
        completion = np.array([4, 6 + i, 2], dtype=np.int32)
        out.append(
            Trajectory(
                sample_id=f"g{i}/{v}", prompt_id="g", group_id=f"g{i}", sample_index=0, group_size=2,
                prompt_tokens=prompt, completion_tokens=completion,
                behavior_logprobs=np.full(3, -1.0, np.float32), reward=float(i % 2), policy_version=v,
                contract_fingerprint=trainer.contracts.accepted, worker_id="t", created_at=time.time(),
                token_versions=None if tokens is None else np.array(tokens[i]),
            )
        )  # fmt: skip
    return out


async def test_trainer_publish_retains_packed_versions_and_recompute_uses_them(tmp_path, redis_url, run_id):
    redis = connect(redis_url)
    trainer = _parts(tmp_path, redis_url, run_id, "a", redis)
    step = trainer.step
    try:
        await _publish(trainer, 1)
        v1 = {n: p.detach().clone() for n, p in trainer.backend.canonical().items()}
        _step(trainer, 0)
        await _publish(trainer, 2)
        _step(trainer, 1)  # the weights moved since v2's publish (publish_every > 1): v2 rows need v2's parts
        batch = step.recompute([_group(trainer, [1, 2])], weights_version=None)
        assert batch.known.tolist() == [True, True]
        ref = _qat_logprobs(
            v1,
            trainer.contracts.recipe,
            batch.tokens[:1],
            batch.targets[:1],
            batch.attn[:1],
            step.temperature,
            trainer.backend.model_config,
        )
        on = batch.mask[:1] > 0  # at_version is each completion token's (off the mask: prox)
        assert torch.equal(qat.bits(batch.at_version[:1][on]), qat.bits(ref[on]))
        assert not torch.equal(batch.at_version, batch.prox)
        # A sample spanning v1 and v2 (in-flight updates): each token under its own version, bitwise.
        mixed = step.recompute([_group(trainer, [2, 2], tokens=[[1, 1, 2], [2, 2, 2]])], weights_version=None)
        whole1 = step.recompute([_group(trainer, [1, 2])], weights_version=None)
        whole2 = step.recompute([_group(trainer, [2, 2])], weights_version=None)
        at = (mixed.mask[0] > 0).nonzero().squeeze(-1)
        assert torch.equal(qat.bits(mixed.at_version[0, at[:2]]), qat.bits(whole1.at_version[0, at[:2]]))
        assert torch.equal(qat.bits(mixed.at_version[0, at[2:]]), qat.bits(whole2.at_version[0, at[2:]]))
        assert not torch.equal(whole1.at_version[0, at], whole2.at_version[0, at])  # the pick mattered
        assert mixed.known.tolist() == [True, True] and mixed.versions.tolist() == [1, 2]  # the oldest token's
        await _publish(trainer, 3)
        # v3 is the current weights: its rows are prox itself
        batch = step.recompute([_group(trainer, [3, 1])], weights_version=3)
        assert torch.equal(batch.at_version[0], batch.prox[0]) and not torch.equal(batch.at_version[1], batch.prox[1])
        assert batch.token_known[0].tolist() == (batch.mask[0] > 0).tolist()
        for v in (4, 5):
            _step(trainer, v)
            await _publish(trainer, v)
        assert step.versions.versions() == [3, 4, 5]  # max_staleness 2: v1 and v2 released
        batch = step.recompute([_group(trainer, [2, 3])], weights_version=5)
        assert batch.known.tolist() == [False, True]
        assert step.versions.nbytes() == 3 * step.versions.nbytes(5)
    finally:
        await trainer.publishing.close()

    # A restart: nothing retained is checkpointed, so rows of versions before it are left out.
    again = _parts(tmp_path, redis_url, run_id, "b", redis)
    try:
        again.backend.load_weights(trainer.backend.canonical())
        await _publish(again, 6)
        batch = again.step.recompute([_group(again, [5, 6])], weights_version=6)
        assert batch.known.tolist() == [False, True]
        assert again.step.versions.versions() == [6]
    finally:
        await again.publishing.close()
        await redis.aclose()
