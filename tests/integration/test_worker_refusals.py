"""A rollout worker's loop (`RolloutWorker.run`, the CPU engine) on a real Redis and a real gRPC
PolicyServer: a prompt group it cannot run (rollout.prompt_check) or whose scoring raises (a user's
task without `check_fields` whose verifier raises on the fields it got) is dead-lettered alone, with
its reason, counted in Prometheus and the heartbeat, and the worker goes on with the next prompt. A
group is never started under a version older than its `min_version` (trainer.feeding rule 4): the
worker keeps it, and those behind it, until it can start it under the first version at or above it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from broker.codec import PromptGroup, decode_trajectory
from broker.keys import Keys
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.signing import Signer
from broker.streams import DATA_FIELD, PromptQueue, connect, read_deadletter
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import Transformer
from rollout.tasks import AdditionTask
from rollout.worker import RolloutWorker
from tandem import config as run_config
from tandem.services import task_and_model

pytestmark = pytest.mark.integration

SIGNER = Signer(b"k" * 32)
CFG = run_config.load(
    None,
    [
        "recipe=bf16",
        "model.overrides={n_layers: 1, dim: 32, n_experts: 2, expert_ffn_dim: 32, shared_expert_ffn_dim: 32}",
    ],
)


@dataclasses.dataclass(frozen=True)
class UncheckedTask:
    """A user's task without `check_fields`: its verifier raises KeyError on fields without "answer"."""

    inner: AdditionTask = AdditionTask(digits=1)

    tokenizer = property(lambda self: self.inner.tokenizer)
    max_new_tokens = property(lambda self: self.inner.max_new_tokens)

    def prompt(self, index):
        return self.inner.prompt(index)

    def example(self, rng):
        return self.inner.example(rng)

    def score(self, completion_ids, fields):
        return self.inner.score(completion_ids, fields)


def _group(name: str, **changes) -> PromptGroup:
    p = AdditionTask(digits=1).prompt(0)
    kw = dict(prompt_id=name, group_id=name, prompt_tokens=np.asarray(p.tokens, np.int32), n_samples=2, task=p.fields)
    return PromptGroup(**{**kw, **changes})


async def test_worker_dead_letters_what_it_cannot_run_and_goes_on(redis_url, run_id):
    task = UncheckedTask()
    _, model_config, recipe = task_and_model(CFG)
    cfg = dataclasses.replace(CFG.rollout, metrics_port=0, heartbeat_s=0.2, heartbeat_ttl_s=5.0, read_block_ms=50)
    loop = dataclasses.replace(CFG.loop, max_staleness=4)
    worker = RolloutWorker(
        cfg, run_id=run_id, redis_url=redis_url, worker_id="w0", model_config=model_config, recipe=recipe,
        loop=loop, task=task, group_size=2, signer=SIGNER, log=(logs := []).append,
    )  # fmt: skip
    keys = Keys(run_id=run_id)
    model = Transformer(model_config, seed=0)
    tensors = quantize_params(dict(model.named_parameters()), recipe.plan(model_config))
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    with PolicyServer(PolicyServerConfig()) as server:
        manifest = mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors)
        server.publish(manifest)
        async with connect(redis_url) as r:
            await PolicyRegistry(r, keys, signer=SIGNER).publish(
                PolicyPointer(
                    version=1,
                    address=server.address,
                    contract_fingerprint=worker.fingerprint,
                    content_digest=mf.manifest_digest(manifest.manifest).hex(),
                )
            )
            await PromptQueue(r, keys, signer=SIGNER).add(
                [_group("bad-fields", task={}), _group("bad-n", n_samples=3), _group("good")]
            )
            running = asyncio.create_task(worker.run())
            try:
                deadline = time.monotonic() + 60
                while await r.xlen(keys.trajectories) < 2 or not _refused_in_heartbeat(await _beats(r, keys), 2):
                    assert not running.done(), (running, logs[-5:])
                    assert time.monotonic() < deadline, logs[-10:]
                    await asyncio.sleep(0.1)
                reasons = {d.reason for d in await read_deadletter(r, keys)}
            finally:
                worker.request_stop()
                assert await asyncio.wait_for(running, 30) == 0
    assert reasons == {
        "failed: scoring or packing its samples raised KeyError: 'answer'",
        "invalid: n_samples=3, the run's group size is 2",
    }
    samples = worker.metrics.endpoint.registry.get_sample_value
    assert samples("tandem_rollout_prompts_refused_total", {"why": "failed"}) == 1
    assert samples("tandem_rollout_prompts_refused_total", {"why": "invalid"}) == 1
    assert samples("tandem_rollout_groups_total") == 1
    assert sum("dead-lettered prompt" in ln for ln in logs) == 2


async def _beats(r, keys: Keys) -> dict:
    return await Heartbeats(r, keys).live(role="rollout")


def _refused_in_heartbeat(beats: dict, n: int) -> bool:
    return beats.get("w0", {}).get("info", {}).get("refused_prompts") == n


async def _oldest_versions(r, keys: Keys) -> dict[str, int]:
    """group id -> the oldest token version over its samples in the trajectories stream."""
    out: dict[str, int] = {}
    for _, fields in await r.xrange(keys.trajectories):
        t = decode_trajectory(fields[DATA_FIELD])
        out[t.group_id] = min(out.get(t.group_id, t.oldest_version), t.oldest_version)
    return out


async def _wait_for(predicate, running, logs, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert not running.done(), (running, logs[-5:])
        assert time.monotonic() < deadline, logs[-10:]
        await asyncio.sleep(0.1)


async def test_a_group_waits_for_its_min_version(redis_url, run_id):
    _, model_config, recipe = task_and_model(CFG)
    cfg = dataclasses.replace(CFG.rollout, metrics_port=0, heartbeat_s=0.2, heartbeat_ttl_s=5.0, read_block_ms=50)
    worker = RolloutWorker(
        cfg, run_id=run_id, redis_url=redis_url, worker_id="w0", model_config=model_config, recipe=recipe,
        loop=CFG.loop, task=AdditionTask(digits=1), group_size=2, signer=SIGNER, log=(logs := []).append,
    )  # fmt: skip
    keys = Keys(run_id=run_id)
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)

    def build(version: int) -> mf.PackedPolicy:
        model = Transformer(model_config, seed=version)
        tensors = quantize_params(dict(model.named_parameters()), recipe.plan(model_config))
        return mf.build_manifest(version=version, parent_version=None, contract=contract, tensors=tensors)

    with PolicyServer(PolicyServerConfig()) as server:
        async with connect(redis_url) as r:
            registry = PolicyRegistry(r, keys, signer=SIGNER)

            async def announce(version: int) -> None:
                m = build(version)
                server.publish(m)
                digest = mf.manifest_digest(m.manifest).hex()
                await registry.publish(
                    PolicyPointer(
                        version=version, address=server.address, contract_fingerprint=worker.fingerprint,
                        content_digest=digest,
                    )
                )  # fmt: skip

            await announce(1)
            await PromptQueue(r, keys, signer=SIGNER).add(
                [_group("now"), _group("later", min_version=2), _group("after")]
            )
            running = asyncio.create_task(worker.run())
            try:
                await _wait_for(lambda: _has(r, keys, "now"), running, logs)
                await asyncio.sleep(1.0)  # time enough for "later" to start, were it allowed
                assert set(await _oldest_versions(r, keys)) == {"now"}  # "after" waits behind "later"
                await announce(2)
                await _wait_for(lambda: _has(r, keys, "after"), running, logs)
                oldest = await _oldest_versions(r, keys)
            finally:
                worker.request_stop()
                assert await asyncio.wait_for(running, 30) == 0
    assert oldest == {"now": 1, "later": 2, "after": 2}


async def _has(r, keys: Keys, group_id: str) -> bool:
    return group_id in await _oldest_versions(r, keys)
