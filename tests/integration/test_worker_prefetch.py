"""The worker fetches a newer version in the background while its groups decode (issue 18): the
swap waits for both the drain and the fetch, a newer pointer supersedes a fetch in progress, a
failed fetch keeps the current version (groups start again) and is retried, the "live" line and the
metrics split the swap. Real gRPC PolicyServer on loopback, the CPU engine (no Redis: the loop's
methods are driven directly)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

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

_spec = importlib.util.spec_from_file_location("e2e_report", Path(__file__).parents[2] / "bench" / "e2e_report.py")
e2e_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e_report)

CFG = run_config.load(
    None,
    [
        "model.overrides={n_layers: 2, dim: 64, n_experts: 2, expert_ffn_dim: 64, shared_expert_ffn_dim: 64}",
        "rollout.fetch_streams=3",
    ],
)


def build(version: int) -> mf.PackedPolicy:
    _, model_config, recipe = task_and_model(CFG)
    model = Transformer(model_config, seed=version)
    tensors = quantize_params(dict(model.named_parameters()), recipe.plan(model_config))
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    return mf.build_manifest(version=version, parent_version=None, contract=contract, tensors=tensors)


@pytest.mark.parametrize("fetch_process", [False, True], ids=["in-process", "child-process"])
async def test_prefetch_while_draining_supersede_and_retry(free_port, fetch_process):
    logs: list[str] = []
    worker = make_worker(
        dataclasses.replace(CFG, rollout=dataclasses.replace(CFG.rollout, fetch_process=fetch_process)), "w0"
    )
    worker.log = logs.append
    try:
        await _prefetch_scenario(worker, logs, free_port)
    finally:
        if worker.fetcher is not None:
            worker.fetcher.close()
    assert not any("fetch process" in ln for ln in logs)  # the child, when there is one, never died


async def _prefetch_scenario(worker, logs: list[str], free_port) -> None:

    with PolicyServer(PolicyServerConfig(keep_versions=4)) as server:
        for v in (1, 2, 3):
            server.publish(build(v))

        def pointer(v: int, address: str = server.address) -> PolicyPointer:
            return PolicyPointer(version=v, address=address, contract_fingerprint=worker.fingerprint)

        assert await worker._try_load(pointer(1)) and worker.version == 1
        p = worker.task.prompt(0)
        prompt = np.asarray(p.tokens, dtype=np.int32)
        group = PromptGroup(prompt_id="p0", group_id="g0", prompt_tokens=prompt, n_samples=2, task=p.fields)
        worker._submit(group)
        assert worker.batcher.step() == []  # started: the group is in flight under v1

        # v2 announced: fetched in the background, no group starts, the started one keeps decoding.
        assert not await worker._swap_when_drained(pointer(2))
        assert worker._prefetch.pointer.version == 2 and worker.batcher.draining
        # v3 before v2 went live: v2's fetch is dropped, v3's runs.
        assert not await worker._swap_when_drained(pointer(3))
        assert worker._prefetch.pointer.version == 3 and "v3 announced while" in logs[-1] and "v2" in logs[-1]
        await asyncio.wait({worker._prefetch.task})
        assert not await worker._swap_when_drained(pointer(3))  # fetched, but a group is in flight
        assert worker.version == 1
        results = []
        while not results:
            results = worker.batcher.step()
        assert results[0].version == 1  # every token of the group from the version that started it
        worker.inflight.clear()
        assert await worker._swap_when_drained(pointer(3)) and worker.version == 3
        live = [ln for ln in logs if "policy v3 live" in ln]
        assert len(live) == 1 and "receive" in live[0] and "drain_wait" in live[0] and "3 stream(s)" in live[0]
        assert not any("policy v2 live" in ln for ln in logs)
        assert e2e_report.LIVE.search(live[0]) and e2e_report.SPLIT.search(live[0])  # the report reads it
        assert worker.metrics.swap_part.labels("receive")._value.get() > 0
        # The CPU model and backend are kept across versions: what they generate under v3 is what
        # a worker that loaded v3 first generates.
        fresh = make_worker(CFG, "w1")
        fresh.log = lambda _: None
        assert await fresh._try_load(pointer(3))
        for a, b in zip(worker._rollout_group(group), fresh._rollout_group(group)):
            assert a.policy_version == b.policy_version == 3
            assert np.array_equal(a.completion_tokens, b.completion_tokens)
            assert np.array_equal(a.behavior_logprobs, b.behavior_logprobs)

        # A failed fetch (nothing listens at the pointer's address): v3 stays, groups start again,
        # the fetch is retried on a later call (after a short wait), not at once in a tight loop.
        failures = worker.metrics.fetch_failures._value.get()
        worker.retry_s = 60.0  # long enough that the retry below cannot be due yet, however loaded the box
        dead = pointer(4, f"127.0.0.1:{free_port()}")
        worker._submit(group)
        worker.batcher.step()
        assert not await worker._swap_when_drained(dead)
        await asyncio.wait({worker._prefetch.task})
        assert not await worker._swap_when_drained(dead)
        assert worker.version == 3 and not worker.batcher.draining
        assert worker.metrics.fetch_failures._value.get() == failures + 1
        assert any("fetching v4" in ln and "failed, will retry" in ln for ln in logs)
        assert not await worker._swap_when_drained(dead) and worker._prefetch is None  # waits before retrying
        worker._retry_at = 0.0  # the retry is due

        # A newest pointer that is not for this worker's contract: the fetch of an older one is
        # dropped too and groups start again under v3 (the worker only ever moves to the newest).
        server.publish(build(5))
        assert not await worker._swap_when_drained(pointer(5))
        assert worker._prefetch is not None and worker.batcher.draining
        foreign = PolicyPointer(version=6, address=server.address, contract_fingerprint="0" * 64)
        assert not await worker._swap_when_drained(foreign)
        assert worker._prefetch is None and not worker.batcher.draining and worker.version == 3
        assert any("refusing v6" in ln for ln in logs)
        while not worker.batcher.step():
            pass
        worker.inflight.clear()
