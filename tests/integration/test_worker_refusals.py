"""A rollout worker's loop (`RolloutWorker.run`, the CPU engine) on a real Redis and a real gRPC
PolicyServer: a prompt group it cannot run (rollout.prompt_check) or whose scoring raises (a user's
task without `check_fields` whose verifier raises on the fields it got) is dead-lettered alone, with
its reason, counted in Prometheus and the heartbeat, and the worker goes on with the next prompt."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from broker.codec import PromptGroup
from broker.keys import Keys
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.signing import Signer
from broker.streams import PromptQueue, connect, read_deadletter
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
