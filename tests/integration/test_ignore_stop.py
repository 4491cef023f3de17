"""rollout.ignore_stop (benchmark only): every completion runs to the task's max_new_tokens and each
trajectory says so; off (the default), the stop token ends completions and nothing is flagged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from drive_worker import load, rollout_group  # tests/drive_worker.py

from broker.codec import PromptGroup
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import PolicyPointer
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import Transformer
from tandem import config as run_config
from tandem.services import make_worker, task_and_model

pytestmark = pytest.mark.integration

CFG = run_config.load(
    None,
    ["model.overrides={n_layers: 2, dim: 64, n_experts: 2, expert_ffn_dim: 64, shared_expert_ffn_dim: 64}"],
)


def _policy() -> mf.PackedPolicy:
    _, model_config, recipe = task_and_model(CFG)
    tensors = quantize_params(dict(Transformer(model_config, seed=1).named_parameters()), recipe.plan(model_config))
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    return mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors)


async def _completions(ignore_stop: bool, server: PolicyServer) -> list:
    cfg = dataclasses.replace(CFG, rollout=dataclasses.replace(CFG.rollout, ignore_stop=ignore_stop))
    worker = make_worker(cfg, "w0")
    worker.log = lambda _: None
    assert await load(worker, PolicyPointer(version=1, address=server.address, contract_fingerprint=worker.fingerprint))
    out = []
    for i in range(4):
        p = worker.task.prompt(i)
        group = PromptGroup(
            prompt_id=f"p{i}", group_id=f"g{i}", prompt_tokens=np.asarray(p.tokens, dtype=np.int32), n_samples=4,
            task=p.fields,
        )  # fmt: skip
        out += rollout_group(worker, group)
    return out


async def test_ignore_stop_runs_every_completion_to_max_new_tokens():
    task = task_and_model(CFG)[0]
    max_new, eos = task.max_new_tokens, task.tokenizer.eos_id
    with PolicyServer(PolicyServerConfig(keep_versions=1)) as server:
        server.publish(_policy())
        plain = await _completions(False, server)
        forced = await _completions(True, server)
    # The random-weight policy samples its stop token early in some completions: those end there.
    assert any(len(t.completion_tokens) < max_new and t.completion_tokens[-1] == eos for t in plain)
    assert not any(t.info.get("ignore_stop") for t in plain)
    assert all(len(t.completion_tokens) == max_new and t.info.get("ignore_stop") == 1 for t in forced)
    assert all(len(t.behavior_logprobs) == max_new for t in forced)
