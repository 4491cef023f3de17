"""`rollout.device=cuda` end to end, minus Redis: a trainer-side manifest served by a real gRPC
PolicyServer on loopback, fetched and verified by the worker, which builds its PackedEngine from the
packed bytes (version 1), copies version 2 into that engine in place (received into the same
page-locked host slab), and rolls out a prompt group. Device machine only (bench/run_device.sh)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("redis")  # the worker module imports the Redis streams client
pytest.importorskip("grpc_health")

from drive_worker import load, rollout_group  # noqa: E402  (tests/drive_worker.py)

from broker.codec import PromptGroup  # noqa: E402
from broker.policy_server import PolicyServer, PolicyServerConfig  # noqa: E402
from broker.registry import PolicyPointer  # noqa: E402
from policy import manifest as mf
from policy import qat  # noqa: E402
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import Transformer  # noqa: E402
from tandem import config, services  # noqa: E402


def test_worker_serves_a_published_version_from_packed_bytes_on_cuda():
    cfg = config.load("configs/demo.yaml", ["rollout.device=cuda", "rollout.max_batch=4"])
    task, model_config, recipe = services.task_and_model(cfg)
    worker = services.make_worker(cfg, "gpu-worker")
    assert worker.model is None  # no CPU copy of the model on the CUDA path
    model = Transformer(model_config, seed=0)
    plan = recipe.plan(model_config)
    tensors = quantize_params(dict(model.named_parameters()), plan)
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    packed = mf.build_manifest(version=2, parent_version=1, contract=contract, tensors=tensors)
    logs: list[str] = []
    worker.log = logs.append
    other = Transformer(model_config, seed=1)
    v1 = quantize_params(dict(other.named_parameters()), plan)
    with PolicyServer(PolicyServerConfig(port=0)) as server:
        server.publish(mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=v1))
        pointer = PolicyPointer(version=1, address=server.address, contract_fingerprint=worker.fingerprint)
        assert asyncio.run(load(worker, pointer)), logs
        first = worker.engine
        assert worker.fetching.buffers.pinned and worker.fetching.buffers.allocations == 1
        server.publish(packed)  # version 2: the model's weights, checked against its QAT recompute below
        pointer = PolicyPointer(version=2, address=server.address, contract_fingerprint=worker.fingerprint)
        assert asyncio.run(load(worker, pointer)), logs
    eng = worker.engine
    assert eng is first and worker.fetching.buffers.allocations == 1  # copied into the live engine, same host slab
    assert "(in place," in logs[-1] and "h2d" in logs[-1], logs[-1]
    assert worker.version == 2 and eng is not None and eng.device.type == "cuda"
    assert any(L.experts.kernel is not None for L in eng.layers)  # the routed experts stay packed
    p = task.prompt(0)
    group = PromptGroup(
        prompt_id="p0", group_id="g0", prompt_tokens=np.asarray(p.tokens, dtype=np.int32), n_samples=8, task=p.fields
    )
    trajs = rollout_group(worker, group)  # 8 samples in chunks of max_batch=4
    assert len(trajs) == 8
    assert all(t.policy_version == 2 and t.contract_fingerprint == worker.fingerprint for t in trajs)
    again = rollout_group(worker, group)
    for a, b in zip(trajs, again):  # per-sample seeds: the same group gives the same samples
        assert np.array_equal(a.completion_tokens, b.completion_tokens)
    # Behavior log-probs against the trainer's QAT recompute (CPU, fp32) of the same sequences.
    qat.apply_qat(model, plan)
    diffs = []
    with torch.no_grad():
        for t in trajs:
            seq = torch.tensor([list(t.prompt_tokens) + list(t.completion_tokens)])
            lp = model.token_logprobs(seq[:, :-1], seq[:, 1:], temperature=cfg.loop.temperature)
            diffs.append((lp[0, len(t.prompt_tokens) - 1 :] - torch.from_numpy(t.behavior_logprobs)).abs())
    d = torch.cat(diffs)
    assert d.median().item() < 0.05 and d.max().item() < 1.0, d


def test_in_flight_updates_on_cuda_install_between_decode_chunks():
    """loop.inflight_updates on the CUDA worker: v2 copied into the live engine with a group in flight,
    whose samples continue under it (their tokens' versions where the engine sampled anew)."""
    cfg = config.load(
        "configs/demo.yaml",
        ["rollout.device=cuda", "rollout.max_batch=4", "loop.inflight_updates=true", "task.digits=9"],
    )
    _, model_config, recipe = services.task_and_model(cfg)
    worker = services.make_worker(cfg, "gpu-worker")
    logs: list[str] = []
    worker.log = logs.append
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    plan = recipe.plan(model_config)

    def build(v: int):
        tensors = quantize_params(dict(Transformer(model_config, seed=v).named_parameters()), plan)
        return mf.build_manifest(version=v, parent_version=None, contract=contract, tensors=tensors)

    async def scenario(server):
        def pointer(v):
            return PolicyPointer(version=v, address=server.address, contract_fingerprint=worker.fingerprint)

        assert await load(worker, pointer(1)), logs
        p = worker.task.prompt(0)
        group = PromptGroup(
            prompt_id="p0", group_id="g0", prompt_tokens=np.asarray(p.tokens, dtype=np.int32), n_samples=4,
            task=p.fields,
        )  # fmt: skip
        worker.submit(group)
        assert worker.step() == []  # admission samples token 0, one step decodes 8: 9 tokens per row
        assert not await worker.offer(pointer(2)) and not worker.batcher.draining
        await worker.wait_fetch(120)
        first = worker.engine
        assert await worker.offer(pointer(2)) and worker.engine is first  # in place, the group in flight
        finished = []
        while not finished:
            finished = worker.step()
        return finished[0].trajectories

    with PolicyServer(PolicyServerConfig(port=0)) as server:
        for v in (1, 2):
            server.publish(build(v))
        trajs = asyncio.run(scenario(server))
    assert "continued in flight" in next(ln for ln in logs if "policy v2 live" in ln)
    for t in trajs:
        n = len(t.completion_tokens)
        assert t.token_versions.tolist() == [1] * min(n, 9) + [2] * max(0, n - 9)
        assert t.policy_version == t.token_versions[-1] and t.info["tokens_on_stale_kv"] == max(0, n - 9)
    assert any(len(t.completion_tokens) > 9 for t in trajs), [len(t.completion_tokens) for t in trajs]


def test_a_high_priority_decode_stream_generates_the_same_samples():
    """rollout.decode_priority=high moves a step's kernels and reads to another stream: the same
    kernels, seeds and order, so the same tokens and log-probs, bit for bit."""
    runs = {}
    for priority in ("normal", "high"):
        cfg = config.load(
            "configs/demo.yaml", ["rollout.device=cuda", "rollout.max_batch=4", f"rollout.decode_priority={priority}"]
        )
        task, model_config, recipe = services.task_and_model(cfg)
        worker = services.make_worker(cfg, f"gpu-{priority}")
        tensors = quantize_params(dict(Transformer(model_config, seed=0).named_parameters()), recipe.plan(model_config))
        contract = contract_from_recipe(model_config=model_config, recipe=recipe)
        logs: list[str] = []
        worker.log = logs.append
        with PolicyServer(PolicyServerConfig(port=0)) as server:
            server.publish(mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors))
            pointer = PolicyPointer(version=1, address=server.address, contract_fingerprint=worker.fingerprint)
            assert asyncio.run(load(worker, pointer)), logs
        p = task.prompt(0)
        group = PromptGroup(
            prompt_id="p0",
            group_id="g0",
            prompt_tokens=np.asarray(p.tokens, dtype=np.int32),
            n_samples=8,
            task=p.fields,
        )
        runs[priority] = rollout_group(worker, group)
        worker.fetching.close()
    for a, b in zip(runs["normal"], runs["high"], strict=True):
        assert np.array_equal(a.completion_tokens, b.completion_tokens)
        assert np.array_equal(a.behavior_logprobs, b.behavior_logprobs)
