"""A manifest that passes verify_manifest but does not match the worker's
contract (a part renamed or dropped, format params {"zzz": 1} or 1, a declared 100 GiB tensor) is
refused before anything is allocated; through a real PolicyServer the worker logs it, counts it,
never fetches that version again, and keeps serving the version it has."""

from __future__ import annotations

import numpy as np
import pytest
from drive_worker import load, rollout_group  # tests/drive_worker.py

from broker.codec import PromptGroup
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import PolicyPointer
from policy import manifest as mf
from policy.chunks import chunk_count
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.manifest_check import ManifestRefused, check_manifest, expected_tensors
from policy.model import Transformer
from tandem import config as run_config
from tandem.services import make_worker, task_and_model
from tandem.v1 import manifest_pb2 as pb

pytestmark = pytest.mark.integration

CFG = run_config.load(
    None, ["model.overrides={n_layers: 2, dim: 64, n_experts: 2, expert_ffn_dim: 64, shared_expert_ffn_dim: 64}"]
)


@pytest.fixture(scope="module")
def contract_and_packed():
    _, model_config, recipe = task_and_model(CFG)
    model = Transformer(model_config, seed=0)
    plan = recipe.plan(model_config)
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    tensors = quantize_params(dict(model.named_parameters()), plan)
    return plan, contract, tensors


def build(contract, tensors, version: int) -> mf.PackedPolicy:
    return mf.build_manifest(version=version, parent_version=None, contract=contract, tensors=tensors)


def nvfp4_entry(m: pb.Manifest) -> pb.TensorEntry:
    return next(t for t in m.tensors if t.format == "nvfp4")


def mutations():
    def rename(m):
        t = nvfp4_entry(m)
        next(p for p in t.parts if p.name == "global_scale").name = "global_scalx"

    def drop(m):
        t = nvfp4_entry(m)
        last = t.parts.pop()
        t.nbytes -= last.nbytes
        t.chunk_xxh3[:] = [0] * chunk_count(t.nbytes, m.chunk_bytes)
        m.total_bytes -= last.nbytes

    def params(value):
        def f(m):
            nvfp4_entry(m).format_params_json = value

        return f

    def huge(m):  # 100 GiB declared, consistent: verify_manifest cannot tell
        t = nvfp4_entry(m)
        m.total_bytes -= t.nbytes
        k = 1 << 16
        rows = (100 << 30) // (k // 2 + k // 16 + 4)
        del t.parts[:]
        offset = 0
        for name, dtype, shape, item in (
            ("codes", "uint8", [rows, k // 2], 1),
            ("block_scales", "float8_e4m3fn", [rows, k // 16], 1),
            ("global_scale", "float32", [1], 4),
        ):
            n = item * (shape[0] * shape[1] if len(shape) == 2 else shape[0])
            t.parts.add(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=n)
            offset += n
        t.shape[:] = [rows, k]
        t.nbytes = offset
        t.chunk_xxh3[:] = [0] * chunk_count(offset, m.chunk_bytes)
        m.total_bytes += offset

    return {
        "part renamed": (rename, "parts"),
        "part dropped": (drop, "parts"),
        "params {zzz: 1}": (params('{"zzz":1}'), "format params {'zzz': 1}"),
        "params 1": (params("1"), "format params 1"),
        "100 GiB tensor": (huge, "max_total_bytes"),
    }


@pytest.mark.parametrize("case", list(mutations()))
def test_consistent_but_foreign_manifests_are_refused(contract_and_packed, case):
    plan, contract, tensors = contract_and_packed
    expected = expected_tensors(plan)
    m = pb.Manifest()
    m.CopyFrom(build(contract, tensors, 1).manifest)
    check_manifest(m, expected, max_total_bytes=64 << 30)  # the real one passes
    mutate, reason = mutations()[case]
    mutate(m)
    mf.verify_manifest(m)  # internally consistent: the old check let it through
    with pytest.raises(ManifestRefused, match="policy version 1 refused") as e:
        check_manifest(m, expected, max_total_bytes=64 << 30)
    assert reason in str(e.value)


async def test_worker_keeps_its_version_and_counts_the_refusal(contract_and_packed):
    _, contract, tensors = contract_and_packed
    logs: list[str] = []
    worker = make_worker(CFG, "w0")
    worker.log = logs.append
    with PolicyServer(PolicyServerConfig()) as server:
        server.publish(build(contract, tensors, 1))
        bad = build(contract, tensors, 2)
        m = pb.Manifest()
        m.CopyFrom(bad.manifest)
        next(p for p in nvfp4_entry(m).parts if p.name == "global_scale").name = "global_scalx"
        server.publish(mf.PackedPolicy(m, bad.blobs))

        def pointer(v: int) -> PolicyPointer:
            return PolicyPointer(version=v, address=server.address, contract_fingerprint=worker.fingerprint)

        assert await load(worker, pointer(1)) and worker.version == 1
        assert not await load(worker, pointer(2))
        assert worker.version == 1 and worker.swap.refused_versions == {2}
        assert any("policy version 2 refused" in ln and "keeping v1" in ln for ln in logs), logs
        n = len(logs)
        assert not await load(worker, pointer(2))  # immutable: not fetched again, not logged again
        assert len(logs) == n
        # The worker still generates with v1.
        p = worker.task.prompt(0)
        prompt = np.asarray(p.tokens, dtype=np.int32)
        group = PromptGroup(prompt_id="p0", group_id="p0", prompt_tokens=prompt, n_samples=2, task=p.fields)
        assert [t.policy_version for t in rollout_group(worker, group)] == [1, 1]
