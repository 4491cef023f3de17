"""A rogue policy server behind a genuine signed pointer (plaintext gRPC: whoever answers at the
pointer's address serves the bytes). The pointer, signed with the run's secret, names the manifest's
digest; a `tandem rollout` process (fetching in its child processes) must refuse, with one line each
and without exiting: (a) another content under the version's number (the digest differs: that
source is not asked for that version again), (b) NaN embeddings and (c) an infinite nvfp4 global
scale (authentic digests of bad content: refused at fetch, never fetched again), (d) finite weights
whose logits overflow (refused while generating; its group starts again under the next version).
Meanwhile it generates with the version it has, and it goes live with the next genuine version."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import yaml
from drive_worker import load  # tests/drive_worker.py

from broker.codec import PromptGroup
from broker.keys import Keys
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.signing import load_signer, write_secret_file
from broker.streams import PromptQueue, TrajectoryStream, connect, run_async
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import Transformer
from tandem import config as run_config
from tandem.services import make_worker, rollout_recipe, task_and_model
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

MODEL = {"n_layers": 2, "dim": 64, "n_experts": 2, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64}


class RogueServer(PolicyServer):
    """A real PolicyServer that counts the GetManifest requests it answers, by version, and serves
    the versions in `other_bytes` with one byte of every chunk flipped (each chunk's own xxh3
    recomputed: only the manifest's checksums can tell)."""

    def __init__(self, config: PolicyServerConfig):
        super().__init__(config)
        self.asked: dict[int, int] = {}
        self.other_bytes: set[int] = set()

    async def _get_manifest(self, request: bytes, context) -> bytes:
        v = policy_pb2.GetManifestRequest.FromString(request).version
        self.asked[v] = self.asked.get(v, 0) + 1
        return await super()._get_manifest(request, context)

    async def _fetch_messages(self, request: bytes, context):
        alter = policy_pb2.FetchTensorsRequest.FromString(request).version in self.other_bytes
        async for msg in super()._fetch_messages(request, context):
            if alter:
                chunk = policy_pb2.TensorChunk.FromString(msg)
                chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
                chunk.xxh3 = xxhash.xxh3_64_intdigest(chunk.data)
                msg = chunk.SerializeToString()
            yield msg


def write_config(tmp: Path, run_id: str, redis_url: str) -> Path:
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "run_secret_file": str(write_secret_file(tmp / "run.secret")),
        "loop": {"max_staleness": 1},
        "model": {"overrides": MODEL},
        "trainer": {"group_size": 2},  # the groups add_group makes
        "rollout": {
            "fetch_process": True,  # the fetch children: errors cross the process boundary
            "fetch_processes": 2,
            "heartbeat_s": 0.3,
            "heartbeat_ttl_s": 10.0,
            "read_block_ms": 100,
            "metrics_port": -1,
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def versions(cfg: run_config.RunConfig):
    """build(version, seed, edit): a PackedPolicy of the worker's contract from seed's weights,
    `edit(name, quantized)` returning the quantized object to publish instead (or it as it is)."""
    _, model_config, recipe = task_and_model(cfg)
    recipe = rollout_recipe(cfg, recipe)
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    plan = recipe.plan(model_config)

    def build(version: int, seed: int, edit=lambda name, q: q) -> mf.PackedPolicy:
        tensors = quantize_params(dict(Transformer(model_config, seed=seed).named_parameters()), plan)
        tensors = {n: dataclasses.replace(q, value=edit(n, q.value)) for n, q in tensors.items()}
        return mf.build_manifest(version=version, parent_version=None, contract=contract, tensors=tensors)

    return build, contract.fingerprint()


def nan_embeddings(name, q):
    return dataclasses.replace(q, values=torch.full_like(q.values, float("nan"))) if "embed_tokens" in name else q


def inf_global_scale(name, q):
    if not hasattr(q, "global_scale") or "experts.0.gate_up" not in name:
        return q
    return dataclasses.replace(q, global_scale=torch.full_like(q.global_scale, float("inf")))


def huge_lm_head(name, q):  # finite (passes every value check), but the logits overflow to Inf
    return dataclasses.replace(q, values=torch.full_like(q.values, 1e38)) if name == "lm_head.weight" else q


@pytest.mark.slow
def test_a_rogue_server_never_goes_live_and_never_ends_the_worker(tmp_path, redis_url, run_id):
    # Not an `async def` test: those are capped at 60 s, and a loaded box may take that long to start
    # a worker process; every wait below has its own bound.
    run_async(scenario(tmp_path, redis_url, run_id))


async def scenario(tmp_path: Path, redis_url: str, run_id: str) -> None:
    path = write_config(tmp_path, run_id, redis_url)
    cfg = run_config.load(path)
    build, fingerprint = versions(cfg)
    keys, signer = Keys(run_id=run_id), load_signer(cfg.run_secret_file)
    log = tmp_path / "w0.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as sink:  # the child has its own copy of the descriptor
        worker = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "rollout", "--config", str(path), "--worker-id", "w0"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    genuine, rogue = PolicyServer(PolicyServerConfig()), RogueServer(PolicyServerConfig())
    r = connect(redis_url)
    registry, beats = PolicyRegistry(r, keys, signer=signer), Heartbeats(r, keys)
    prompts = PromptQueue(r, keys, signer=signer)
    out = TrajectoryStream(r, keys, consumer="t", signer=signer)
    await out.setup()
    task = task_and_model(cfg)[0]

    async def point(server: PolicyServer, packed: mf.PackedPolicy) -> None:
        server.publish(packed)
        m = packed.manifest
        digest = mf.manifest_digest(m).hex()
        await registry.publish(
            PolicyPointer(
                version=m.version, address=server.address, contract_fingerprint=fingerprint, content_digest=digest
            )
        )

    async def until(what: str, ok) -> dict:
        deadline = time.monotonic() + 120
        while True:
            info = (await beats.live("rollout")).get("w0", {}).get("info", {})
            if ok(info):
                return info
            assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"waiting for {what}: {info}\n{log.read_text()[-3000:]}"
            await asyncio.sleep(0.1)

    async def add_group(group_id: str) -> None:
        p = task.prompt(0)
        tokens = np.asarray(p.tokens, dtype=np.int32)
        await prompts.add(
            [PromptGroup(prompt_id=group_id, group_id=group_id, prompt_tokens=tokens, n_samples=2, task=p.fields)]
        )

    async def versions_of(group_id: str) -> list[int]:
        """The policy versions of the group's 2 trajectories, once both arrived."""
        got, deadline = [], time.monotonic() + 120
        while len(got) < 2:
            assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no trajectories of {group_id}:\n{log.read_text()[-3000:]}"
            recs = await out.read(block_ms=200)
            got += [rec.trajectory.policy_version for rec in recs if rec.trajectory.group_id == group_id]
        return got

    try:
        genuine.start()
        rogue.start()
        await point(genuine, build(1, seed=0))
        await until("v1 live", lambda i: i.get("version") == 1)

        # (a) Another content under v2's number: the pointer names the genuine v2's digest.
        real_v2 = build(2, seed=1)
        rogue.publish(build(2, seed=2))
        await registry.publish(
            PolicyPointer(version=2, address=rogue.address, contract_fingerprint=fingerprint,
                          content_digest=mf.manifest_digest(real_v2.manifest).hex())
        )  # fmt: skip
        await until("v2's digest mismatch", lambda i: i.get("distrusted_sources") == 1)
        assert rogue.stats()["fetch_streams"] == 0  # refused at its manifest: no tensor asked for
        await add_group("a")
        assert await versions_of("a") == [1, 1]  # still serving v1 (v2 is within max_staleness)

        # (b), (c): authentic digests of content no quantizer produces: refused at fetch.
        await point(rogue, build(3, seed=3, edit=nan_embeddings))
        await until("v3 refused", lambda i: i.get("refused_versions") == 1)
        await point(rogue, build(4, seed=4, edit=inf_global_scale))
        info = await until("v4 refused", lambda i: i.get("refused_versions") == 2)
        assert info["version"] == 1

        # (d) Finite weights whose logits overflow: live, then refused at its first group, which is
        # kept and generated under the next genuine version.
        await point(rogue, build(5, seed=5, edit=huge_lm_head))
        await until("v5 live", lambda i: i.get("version") == 5)
        await add_group("d")
        await until("v5 refused while generating", lambda i: i.get("refused_versions") == 3 and i["version"] is None)
        streams = rogue.stats()["fetch_streams"]
        await point(genuine, build(6, seed=6))
        assert await versions_of("d") == [6, 6]

        await asyncio.sleep(1.5)  # several pointer polls: nothing refused is asked for again
        assert rogue.asked == {2: 1, 3: 1, 4: 1, 5: 1}, rogue.asked
        assert rogue.stats()["fetch_streams"] == streams  # no tensor of theirs asked for again either
        assert worker.poll() is None
        text = log.read_text()
        assert text.count("refusing v2 from") == 1 and "digest" in text
        assert text.count("policy version 3 refused: tensor model.embed_tokens.weight: values:") == 1
        assert (
            text.count(
                "policy version 4 refused: tensor model.layers.0.mlp.experts.0.gate_up_proj.weight: global_scale"
            )
            == 1
        )
        assert text.count("v5 refused while generating") == 1
        assert "Traceback" not in text
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        await r.aclose()
        genuine.stop()
        rogue.stop()


async def test_the_in_process_fetch_refuses_the_same_way(tmp_path, redis_url, run_id):
    """The CPU worker's default path (the fetch in a thread of the worker): a digest mismatch, or bytes
    that fail the authenticated manifest, leave that (version, source) untried from then on, a new
    pointer naming another source is fetched, and content refused at fetch is never fetched again."""
    cfg = run_config.load(write_config(tmp_path, run_id, redis_url), ["rollout.fetch_process=false"])
    build, fingerprint = versions(cfg)
    worker = make_worker(cfg, "w0")
    logs: list[str] = []
    worker.log = logs.append
    with PolicyServer(PolicyServerConfig()) as genuine, RogueServer(PolicyServerConfig()) as rogue:
        v1, v2, fake_v2, nan_v3 = build(1, seed=0), build(2, seed=1), build(2, seed=2), build(3, 3, nan_embeddings)
        v4 = build(4, seed=4)  # served by both: the rogue's bytes are not the manifest's
        for server, packed in (
            (genuine, v1),
            (genuine, v2),
            (rogue, fake_v2),
            (rogue, nan_v3),
            (genuine, v4),
            (rogue, v4),
        ):
            server.publish(packed)
        rogue.other_bytes.add(4)

        def pointer(server, packed) -> PolicyPointer:
            m = packed.manifest
            return PolicyPointer(
                version=m.version, address=server.address, contract_fingerprint=fingerprint,
                content_digest=mf.manifest_digest(m).hex(),
            )  # fmt: skip

        assert await load(worker, pointer(genuine, v1)) and worker.version == 1
        at_rogue = dataclasses.replace(pointer(genuine, v2), address=rogue.address)
        assert not await load(worker, at_rogue) and worker.version == 1
        assert not await load(worker, at_rogue)  # not asked again
        assert rogue.asked == {2: 1} and rogue.stats()["fetch_streams"] == 0
        assert worker.metrics.endpoint.registry.get_sample_value("tandem_rollout_policy_sources_distrusted_total") == 1
        assert await load(worker, pointer(genuine, v2)) and worker.version == 2  # v2 from its genuine source
        assert not await load(worker, pointer(rogue, nan_v3)) and worker.swap.refused_versions == {3}
        assert not await load(worker, pointer(rogue, nan_v3))
        assert rogue.asked == {2: 1, 3: 1} and worker.version == 2
        streams = rogue.stats()["fetch_streams"]
        assert not await load(worker, pointer(rogue, v4)) and worker.version == 2
        assert rogue.stats()["fetch_streams"] > streams  # the client's own re-fetches of the bad chunk
        streams = rogue.stats()["fetch_streams"]
        assert not await load(worker, pointer(rogue, v4))
        assert rogue.asked[4] == 1 and rogue.stats()["fetch_streams"] == streams
        assert worker.metrics.endpoint.registry.get_sample_value("tandem_rollout_policy_sources_distrusted_total") == 2
        assert await load(worker, pointer(genuine, v4)) and worker.version == 4
    refusals = [ln for ln in logs if "refus" in ln]
    assert len(refusals) == 3 and "ChecksumMismatch" in refusals[-1], logs
