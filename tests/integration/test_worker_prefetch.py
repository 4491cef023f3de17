"""The worker fetches a newer version in the background while its groups decode: the
swap waits for both the drain and the fetch, a newer pointer supersedes a fetch in progress, a
failed fetch keeps the current version (groups start again) and is retried, the "live" line and the
metrics split the swap, a version's bytes are counted when its fetch ends. Real gRPC PolicyServer
on loopback, the CPU engine (no Redis: the loop's public methods are driven directly:
tests/drive_worker.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

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
        worker.fetching.close()
    assert not any("fetch process" in ln for ln in logs)  # the child, when there is one, never died


async def _prefetch_scenario(worker, logs: list[str], free_port) -> None:

    with PolicyServer(PolicyServerConfig(keep_versions=4)) as server:
        for v in (1, 2, 3):
            server.publish(build(v))

        def pointer(v: int, address: str = server.address) -> PolicyPointer:
            return PolicyPointer(version=v, address=address, contract_fingerprint=worker.fingerprint)

        assert await load(worker, pointer(1)) and worker.version == 1
        v1_bytes = metric(worker, "tandem_rollout_policy_fetch_bytes_total")
        assert v1_bytes > 0
        p = worker.task.prompt(0)
        prompt = np.asarray(p.tokens, dtype=np.int32)
        group = PromptGroup(prompt_id="p0", group_id="g0", prompt_tokens=prompt, n_samples=2, task=p.fields)
        worker.submit(group)
        assert worker.step() == []  # started: the group is in flight under v1

        # v2 announced: fetched in the background, no group starts, the started one keeps decoding.
        assert not await worker.offer(pointer(2))
        assert worker.swap.pending.pointer.version == 2 and worker.batcher.draining
        # v3 before v2 went live: v2's fetch is dropped, v3's runs.
        assert not await worker.offer(pointer(3))
        assert worker.swap.pending.pointer.version == 3 and "v3 announced while" in logs[-1] and "v2" in logs[-1]
        await worker.wait_fetch(120)
        assert worker.swap.fetched
        # A version's bytes are counted when its fetch ends (a fetched version may never go live).
        assert metric(worker, "tandem_rollout_policy_fetch_bytes_total") > v1_bytes
        assert not await worker.offer(pointer(3))  # fetched, but a group is in flight
        assert worker.version == 1
        finished = []
        while not finished:
            finished = worker.step()
        # every token of the group from the version that started it
        assert [t.policy_version for t in finished[0].trajectories] == [1, 1]
        assert await worker.offer(pointer(3)) and worker.version == 3
        live = [ln for ln in logs if "policy v3 live" in ln]
        assert len(live) == 1 and "receive" in live[0] and "drain_wait" in live[0] and "3 stream(s)" in live[0]
        assert not any("policy v2 live" in ln for ln in logs)
        assert e2e_report.LIVE.search(live[0]) and e2e_report.SPLIT.search(live[0])  # the report reads it
        assert metric(worker, "tandem_rollout_policy_swap_part_seconds", part="receive") > 0
        assert metric(worker, "tandem_rollout_policy_version") == 3
        # The CPU model and backend are kept across versions: what they generate under v3 is what
        # a worker that loaded v3 first generates.
        fresh = make_worker(CFG, "w1")
        fresh.log = lambda _: None
        assert await load(fresh, pointer(3))
        for a, b in zip(rollout_group(worker, group), rollout_group(fresh, group)):
            assert a.policy_version == b.policy_version == 3
            assert np.array_equal(a.completion_tokens, b.completion_tokens)
            assert np.array_equal(a.behavior_logprobs, b.behavior_logprobs)

        # A failed fetch (nothing listens at the pointer's address): v3 stays, groups start again,
        # the fetch is retried on a later call (after a short wait), not at once in a tight loop.
        failures = metric(worker, "tandem_rollout_policy_fetch_failures_total")
        worker.swap.retry_s = 60.0  # long enough that the retry below cannot be due yet, however loaded the box
        dead = pointer(4, f"127.0.0.1:{free_port()}")
        worker.submit(group)
        worker.step()
        assert not await worker.offer(dead)
        await worker.wait_fetch(120)
        assert not await worker.offer(dead)
        assert worker.version == 3 and not worker.batcher.draining
        assert metric(worker, "tandem_rollout_policy_fetch_failures_total") == failures + 1
        assert any("fetching v4" in ln and "failed, will retry" in ln for ln in logs)
        assert not await worker.offer(dead) and worker.swap.pending is None  # waits before retrying
        worker.swap.retry_s = 0.0  # the retry is due

        # A newest pointer that is not for this worker's contract: the fetch of an older one is
        # dropped too and groups start again under v3 (the worker only ever moves to the newest).
        server.publish(build(5))
        assert not await worker.offer(pointer(5))
        assert worker.swap.pending is not None and worker.batcher.draining
        foreign = PolicyPointer(version=6, address=server.address, contract_fingerprint="0" * 64)
        assert not await worker.offer(foreign)
        assert worker.swap.pending is None and not worker.batcher.draining and worker.version == 3
        assert any("refusing v6" in ln for ln in logs)
        while not worker.step():
            pass


def metric(worker, name: str, **labels) -> float | None:
    return worker.metrics.endpoint.registry.get_sample_value(name, labels)


async def test_in_flight_updates_install_between_decode_steps_and_samples_continue_under_the_new_version():
    """loop.inflight_updates: groups keep starting while v2 is fetched; once fetched it is live at the next
    offer with a group in flight, whose samples carry both versions (the KV kept: tokens_on_stale_kv)."""
    cfg = dataclasses.replace(
        CFG,
        loop=dataclasses.replace(CFG.loop, inflight_updates=True),
        task=dataclasses.replace(CFG.task, digits=9),  # up to 11 tokens: samples outlast the swap
        rollout=dataclasses.replace(CFG.rollout, max_inflight_groups=2, max_batch=4),
    )
    logs: list[str] = []
    worker = make_worker(cfg, "w0")
    worker.log = logs.append
    with PolicyServer(PolicyServerConfig(keep_versions=4)) as server:
        for v in (1, 2):
            server.publish(build(v))

        def pointer(v: int) -> PolicyPointer:
            return PolicyPointer(version=v, address=server.address, contract_fingerprint=worker.fingerprint)

        assert await load(worker, pointer(1))
        p = worker.task.prompt(0)
        prompt = np.asarray(p.tokens, dtype=np.int32)
        a = PromptGroup(prompt_id="p0", group_id="a", prompt_tokens=prompt, n_samples=2, task=p.fields)
        b = PromptGroup(prompt_id="p0", group_id="b", prompt_tokens=prompt, n_samples=2, task=p.fields)
        worker.submit(a)
        assert worker.step() == []  # a: one token per sample under v1, the next one's logits computed
        assert not await worker.offer(pointer(2))
        assert worker.swap.pending.pointer.version == 2 and not worker.batcher.draining  # no drain
        worker.submit(b)  # groups keep starting while fetching
        done = {f.group.group_id: f.trajectories for f in worker.step()}  # b starts under v1
        await worker.wait_fetch(120)
        assert await worker.offer(pointer(2)) and worker.version == 2  # groups in flight: installed anyway
        while len(done) < 2:
            done.update({f.group.group_id: f.trajectories for f in worker.step()})
        # At the swap a's samples had 2 tokens, b's 1; on the CPU the next one's logits were computed.
        for key, old in (("a", 3), ("b", 2)):
            for t in done[key]:
                n = len(t.completion_tokens)
                assert t.token_versions.tolist() == [1] * min(n, old) + [2] * max(0, n - old), key
                assert t.policy_version == t.token_versions[-1] and t.oldest_version == 1
                assert t.info["tokens_on_stale_kv"] == max(0, n - old)
        assert any(len(t.completion_tokens) > 3 for t in done["a"]), "no sample of a spans the swap"
        stale = sum(t.info["tokens_on_stale_kv"] for g in done.values() for t in g)
        assert metric(worker, "tandem_rollout_tokens_on_stale_kv_total") == stale > 0
        assert metric(worker, "tandem_rollout_inflight_swaps_total") == 1
        assert metric(worker, "tandem_rollout_policy_swap_part_seconds", part="drain_wait") < 1.0
