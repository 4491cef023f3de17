"""policy/manifest.py, contract.py, chunks.py, tp_layout.py: building, serializing, verifying manifests; the contract fingerprint; chunk checksums; TP layouts."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash
from mixed_formats import format_for  # tests/mixed_formats.py: conftest.py puts tests/ on sys.path

from policy import formats, tp
from policy import manifest as M
from policy.chunks import (
    ChecksumMismatch,
    checksums,
    chunk_bounds,
    chunk_count,
    first_chunk_indices,
    hash_runs,
    verify_tensor_bytes,
)
from policy.contract import ActivationSite, Contract, FingerprintMismatch, check_fingerprint, contract_from_recipe
from policy.formats.params import QuantizedParam, quantize_param, quantize_params
from policy.model import ModelConfig, Transformer, parameter_shapes
from policy.recipe import Recipe
from policy.tp_layout import check_tp_compatible, rebuild, shard_tensor_bytes, tensor_layout, tp_plan_of

CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=2, top_k=1)  # small: the reference nvfp4 is slow on CPU
RULES = {"keep_bf16": {"first": 0, "last_fraction": 0.0}, "rules": [{"match": ["x"], "format": "nvfp4"}]}


def make_tensors(seed: int = 0) -> dict[str, QuantizedParam]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in parameter_shapes(CFG).items():
        w = torch.randn(*shape, generator=g) if len(shape) == 2 else 1 + 0.1 * torch.randn(1, shape[0], generator=g)
        fmt, kw = format_for(name)
        out[name] = quantize_param(w, fmt, **kw)
    return out


def make_contract(**overrides) -> Contract:
    sites = [
        ActivationSite(name=n[: -len(".weight")] + ".input", format="nvfp4", scope="row")
        for n in parameter_shapes(CFG)
        if ".experts." in n
    ]
    kw = dict(model_config=CFG, recipe_name="mixed", recipe_rules=RULES, activation_sites=sites)
    kw.update(overrides)
    return Contract(**kw)


@pytest.fixture(scope="module")
def tensors():
    return make_tensors()


@pytest.fixture(scope="module")
def packed(tensors):
    return M.build_manifest(
        version=5, parent_version=4, contract=make_contract(), tensors=tensors, created_unix_ns=123, chunk_bytes=4096
    )


def test_manifest_describes_every_tensor(packed, tensors):
    m = packed.manifest
    M.verify_manifest(m)
    assert m.version == 5 and m.parent_version == 4 and m.created_unix_ns == 123
    assert [t.name for t in m.tensors] == sorted(tensors)
    assert m.total_bytes == sum(len(b) for b in packed.blobs.values())
    assert m.contract.quantizer_spec_version == formats.SPEC_VERSION
    assert m.contract.model_config_sha256 == CFG.fingerprint()  # same canonical JSON as the model's own hash
    by_name = {t.name: t for t in m.tensors}
    e = by_name["model.layers.0.mlp.experts.0.gate_up_proj.weight"]
    q = tensors[e.name].value
    assert e.format == "nvfp4" and list(e.shape) == [512, 128] and e.tp_style == tp.COLUMN_GATE_UP
    assert [(p.name, p.dtype, list(p.shape), p.nbytes) for p in e.parts] == [
        ("codes", "uint8", [512, 64], 512 * 64),
        ("block_scales", "float8_e4m3fn", [512, 8], 512 * 8),
        ("global_scale", "float32", [1], 4),
    ]
    assert e.HasField("global_scale") and e.global_scale == float(q.global_scale[0])
    assert len(e.chunk_xxh3) == -(-e.nbytes // 4096) > 1
    assert not by_name["model.layers.0.mlp.gate.weight"].HasField("global_scale")
    assert by_name["model.layers.0.self_attn.q_proj.weight"].format_params_json == '{"group_size":32}'
    sites = m.contract.activation_sites
    assert [s.name for s in sites] == sorted(s.name for s in sites)
    assert {(s.format, s.scope, s.tp_scale_mode) for s in sites} == {("nvfp4", "row", "global")}


def test_serialization_is_deterministic_and_round_trips(packed, tmp_path):
    data = M.manifest_to_bytes(packed.manifest)
    assert data == M.manifest_to_bytes(M.manifest_from_bytes(data))
    M.write_manifest(tmp_path / "m.pb", packed.manifest)
    assert M.read_manifest(tmp_path / "m.pb") == packed.manifest
    with pytest.raises(ValueError, match="not a tandem.v1.Manifest"):
        M.manifest_from_bytes(b"\x0a\xff\xff")


def test_fingerprint_covers_the_contract_and_nothing_else(tensors):
    base = make_contract()
    fp = base.fingerprint()
    a = M.build_manifest(version=1, parent_version=None, contract=base, tensors=tensors)
    other = make_tensors(seed=1)
    b = M.build_manifest(version=9, parent_version=8, contract=base, tensors=other, created_unix_ns=1)
    assert a.manifest.contract_fingerprint == b.manifest.contract_fingerprint == fp
    assert a.manifest.tensors[0].sha256 != b.manifest.tensors[0].sha256

    site0 = base.activation_sites[0]
    changed = {
        "model config": make_contract(model_config=dataclasses.replace(CFG, rope_theta=20_000.0)),
        "recipe name": make_contract(recipe_name="other"),
        "recipe rules": make_contract(recipe_rules={**RULES, "keep_bf16": {"first": 1, "last_fraction": 0.0}}),
        "quantizer spec": make_contract(quantizer_spec_version="tandem-quant-1"),  # the previous one
        "site scope": make_contract(
            activation_sites=[dataclasses.replace(site0, format="mxfp8", scope="block")]
            + list(base.activation_sites[1:])
        ),
        "site mode": make_contract(
            activation_sites=[dataclasses.replace(site0, tp_scale_mode="shard")] + list(base.activation_sites[1:])
        ),
        "site set": make_contract(activation_sites=base.activation_sites[1:]),
        "tp plan": make_contract(tp_plan=tp.TPPlan(rules=((".*", tp.REPLICATED),))),
    }
    fps = {k: c.fingerprint() for k, c in changed.items()}
    assert fp not in fps.values()
    assert len(set(fps.values())) == len(fps)
    # The trainer's TP degree is in the contract only when `shard` scales pin it.
    assert make_contract(trainer_tp_size=2).fingerprint() == fp
    shard_sites = [dataclasses.replace(s, tp_scale_mode="shard") for s in base.activation_sites]
    assert make_contract(activation_sites=shard_sites, trainer_tp_size=2).partition_tp_size == 2
    assert (
        make_contract(activation_sites=shard_sites, trainer_tp_size=2).fingerprint()
        != make_contract(activation_sites=shard_sites, trainer_tp_size=1).fingerprint()
    )
    # Non-nvfp4 sites have block-local scales only: `shard` does not pin the partition for them.
    mx = [
        ActivationSite(name=s.name, format="mxfp8", scope="block", tp_scale_mode="shard") for s in base.activation_sites
    ]
    assert make_contract(activation_sites=mx, trainer_tp_size=2).partition_tp_size == 0


def test_one_hasher_for_model_config_recipe_and_manifest():
    """`tandem plan` (Recipe.fingerprint) and `tandem inspect` (the manifest's recipe_sha256) print
    one hash for one recipe; the model config's likewise."""
    recipe = Recipe.load("nvfp4_moe")
    contract = contract_from_recipe(model_config=CFG, recipe=recipe).to_proto()
    assert contract.recipe_sha256 == recipe.fingerprint()
    assert contract.model_config_sha256 == CFG.fingerprint()
    assert recipe.fingerprint() != Recipe.load("mxfp8").fingerprint()


def test_fingerprint_mismatch_names_both(packed):
    check_fingerprint(packed.manifest, packed.manifest.contract_fingerprint)
    wrong = make_contract(recipe_name="something-else").fingerprint()
    with pytest.raises(FingerprintMismatch) as e:
        check_fingerprint(packed.manifest, wrong)
    assert wrong in str(e.value) and packed.manifest.contract_fingerprint in str(e.value)
    assert e.value.expected == wrong and e.value.got == packed.manifest.contract_fingerprint
    assert "version 5" in str(e.value)


@pytest.mark.parametrize(
    ("tamper", "fragment"),
    [
        (lambda m: setattr(m, "contract_fingerprint", "0" * 64), "contract_fingerprint"),
        (lambda m: setattr(m.contract, "recipe_rules_json", '{"rules":[]}'), "recipe_sha256 does not match"),
        (lambda m: setattr(m.tensors[0].parts[0], "nbytes", 3), "needs"),
        (lambda m: setattr(m.tensors[1], "tp_style", tp.ROW), "but the TP plan says"),
        (lambda m: m.tensors[2].chunk_xxh3.append(1), "chunk checksums"),
        (lambda m: setattr(m.tensors[3].parts[0], "dtype", "object"), "dtype 'object'"),
        (lambda m: setattr(m, "total_bytes", 1), "total_bytes=1"),
        (lambda m: setattr(m, "chunk_bytes", (1 << 20) + 1), "chunk_bytes"),
        (lambda m: m.tensors[0].CopyFrom(m.tensors[1]), "unique and sorted"),
    ],
)
def test_verify_manifest_catches_tampering(packed, tamper, fragment):
    m = type(packed.manifest)()
    m.CopyFrom(packed.manifest)
    tamper(m)
    with pytest.raises(ValueError, match="invalid manifest") as e:
        M.verify_manifest(m)
    assert fragment in str(e.value)


def test_verify_tensor_bytes_detects_one_flipped_bit(packed):
    e = packed.manifest.tensors[0]
    blob = packed.blobs[e.name]
    verify_tensor_bytes(e, blob, packed.manifest.chunk_bytes)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x10
    with pytest.raises(ChecksumMismatch, match=f"tensor {e.name}: xxh3 mismatch in chunk"):
        verify_tensor_bytes(e, bad, packed.manifest.chunk_bytes)
    with pytest.raises(ChecksumMismatch, match="bytes, manifest says"):
        verify_tensor_bytes(e, blob[:-1], packed.manifest.chunk_bytes)


def sha256_by_hand(chunks: list[bytes]) -> bytes:
    """The manifest's tensor sha256, written out: over the domain, the length and each chunk's sha256."""
    head = b"tandem-tensor-sha256-v2\0" + struct.pack("<Q", sum(len(c) for c in chunks))
    return hashlib.sha256(head + b"".join(hashlib.sha256(c).digest() for c in chunks)).digest()


def three_chunk_tensor() -> tuple[M.PackedPolicy, bytes]:
    """A bf16 [1, 2500] tensor (5,000 bytes) in chunks of 2,048: 2,048 + 2,048 + 904 bytes."""
    q = quantize_param(torch.arange(2500.0).reshape(1, 2500) * 0.37, "bf16")
    raw = q.value.parts()["values"].contiguous().view(torch.uint8).numpy().tobytes()
    packed = M.build_manifest(
        version=1, parent_version=None, contract=make_contract(), tensors={"w.weight": q}, chunk_bytes=2048
    )
    return packed, raw


def test_tensor_sha256_is_a_sha256_over_the_chunks_sha256s():
    packed, raw = three_chunk_tensor()
    e = packed.manifest.tensors[0]
    assert len(raw) == e.nbytes == 5000 and len(e.chunk_xxh3) == 3
    want = sha256_by_hand([raw[:2048], raw[2048:4096], raw[4096:]])
    assert e.sha256 == want
    assert want != hashlib.sha256(raw).digest()  # not schema 1's sha256 over the bytes
    assert e.chunk_xxh3 == [xxhash.xxh3_64_intdigest(raw[a : a + 2048]) for a in (0, 2048, 4096)]
    with ThreadPoolExecutor(max_workers=3) as pool:  # a pool hashes runs of chunks: the same digest
        assert checksums(raw, 2048) == checksums(raw, 2048, pool=pool) == (list(e.chunk_xxh3), want)
        verify_tensor_bytes(e, raw, 2048, pool=pool)
    # Runs smaller than the tensor: each chunk still hashed once, in order.
    assert hash_runs(chunk_bounds(5000, 2048), task_bytes=4096) == [(0, 2), (2, 3)]
    # An empty tensor has one empty chunk.
    empty = M.build_manifest(
        version=1, parent_version=None, contract=make_contract(),
        tensors={"e.weight": quantize_param(torch.empty(0, 16), "bf16")}, chunk_bytes=2048,
    ).manifest.tensors[0]  # fmt: skip
    assert empty.nbytes == 0 and empty.chunk_xxh3 == [xxhash.xxh3_64_intdigest(b"")]
    assert (
        empty.sha256
        == sha256_by_hand([b""])
        == hashlib.sha256(b"tandem-tensor-sha256-v2\0" + bytes(8) + hashlib.sha256(b"").digest()).digest()
    )
    verify_tensor_bytes(empty, b"", 2048)


def forged(e, data: bytes, chunk_bytes: int = 2048):
    """`e` re-described for `data` the way a forger can without breaking sha256: nbytes and chunk
    xxh3s (not cryptographic) recomputed, the sha256 kept."""
    f = type(e)()
    f.CopyFrom(e)
    f.nbytes = len(data)
    f.chunk_xxh3[:] = [xxhash.xxh3_64_intdigest(data[a : a + chunk_bytes]) for a in range(0, len(data), chunk_bytes)]
    return f


def test_forged_reordered_and_truncated_tensors_fail_the_sha256():
    packed, raw = three_chunk_tensor()
    e = packed.manifest.tensors[0]
    c0, c1, c2 = raw[:2048], raw[2048:4096], raw[4096:]
    flipped = bytearray(raw)
    flipped[3000] ^= 0x01
    cases = {
        "forged": bytes(flipped),
        "reordered": c1 + c0 + c2,
        "truncated": c0 + c1,
        "extended": raw + c2,
        "last chunk cut short": raw[:-1],
    }
    for what, data in cases.items():
        with pytest.raises(ChecksumMismatch, match="sha256 mismatch"):
            verify_tensor_bytes(forged(e, data), data, 2048)
            pytest.fail(what)


def test_a_manifest_of_another_schema_is_refused_in_one_line(packed, monkeypatch):
    """Schema 2 changed what a tensor's sha256 means: a schema-1 manifest (an older trainer) is refused
    for its schema alone, and so is a schema-2 manifest by code that reads schema 1 (an older
    worker; simulated by its SCHEMA_VERSION), instead of failing every tensor's checksum."""
    assert packed.manifest.schema_version == M.SCHEMA_VERSION == 2
    old = type(packed.manifest)()
    old.CopyFrom(packed.manifest)
    old.schema_version = 1
    with pytest.raises(ValueError) as e:
        M.verify_manifest(old)
    msg = str(e.value)
    assert "schema_version=1" in msg and "reads schema 2" in msg and "\n" not in msg
    assert "fingerprint" not in msg and "sha256 mismatch" not in msg
    monkeypatch.setattr(M, "SCHEMA_VERSION", 1)
    with pytest.raises(ValueError, match="schema_version=2") as e:
        M.verify_manifest(packed.manifest)
    assert "fingerprint" not in str(e.value)  # the contract fingerprint is the same under both schemas
    M.verify_manifest(old)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tp_layouts_cut_bytes_like_the_tp_plan_and_rebuild_exactly(packed, tensors, tp_size):
    m = packed.manifest
    plan = tp_plan_of(m)
    for e in m.tensors:
        q = tensors[e.name]
        for rank in range(tp_size):
            layout = tensor_layout(e, plan, rank, tp_size)
            data = bytearray(shard_tensor_bytes(e, packed.blobs[e.name], layout))
            got = rebuild(e, layout, data)
            want = tp.shard_quantized(q.value, fmt=q.format, kwargs=q.kwargs, cut=layout.cut)
            assert got.shape == want.shape == layout.shape
            for part, t in want.parts().items():
                assert torch.equal(got.parts()[part].view(torch.uint8), t.contiguous().view(torch.uint8)), (
                    e.name,
                    part,
                    rank,
                )
            assert layout.sharded == (tp_size > 1 and e.tp_style != tp.REPLICATED)


def test_first_chunk_indices_follow_manifest_order(packed):
    m = packed.manifest
    first = first_chunk_indices(m)
    names = [t.name for t in m.tensors]
    assert first[names[0]] == 0
    for a, b in zip(m.tensors, m.tensors[1:]):
        assert first[b.name] - first[a.name] == chunk_count(a.nbytes, m.chunk_bytes)


def test_shard_scale_mode_pins_the_partition(tensors):
    sites = [dataclasses.replace(s, tp_scale_mode="shard") for s in make_contract().activation_sites]
    m = M.build_manifest(
        version=1,
        parent_version=None,
        tensors=tensors,
        contract=make_contract(activation_sites=sites, trainer_tp_size=2),
    ).manifest
    assert m.contract.tp_plan.partition_tp_size == 2
    check_tp_compatible(m, 2)
    with pytest.raises(ValueError, match="pins the trainer's partition tp_size=2; this rollout has tp_size=4"):
        check_tp_compatible(m, 4)
    g = M.build_manifest(version=1, parent_version=None, tensors=tensors, contract=make_contract()).manifest
    for tps in (1, 2, 4):
        check_tp_compatible(g, tps)  # global mode: any TP degree


def test_build_manifest_validates_inputs(tensors):
    c = make_contract()
    with pytest.raises(ValueError) as e:
        M.build_manifest(version=0, parent_version=3, contract=c, tensors=tensors, chunk_bytes=2 << 20)
    msg = str(e.value)
    assert "version=0 must be an int >= 1" in msg and "parent_version=3" in msg and "chunk_bytes=2097152" in msg
    with pytest.raises(ValueError, match="expected a QuantizedParam"):
        M.build_manifest(version=1, parent_version=None, contract=c, tensors={"lm_head.weight": torch.zeros(2, 2)})
    # A pinned TP degree must be able to cut every tensor.
    sites = [dataclasses.replace(s, tp_scale_mode="shard") for s in c.activation_sites]
    with pytest.raises(ValueError, match="lm_head.weight .*64 rows, not a whole number of 128-row"):
        M.build_manifest(
            version=1,
            parent_version=None,
            tensors=tensors,
            contract=make_contract(activation_sites=sites, trainer_tp_size=8),
        )
    with pytest.raises(ValueError, match="tp_scale_mode='both'"):
        ActivationSite(name="a.input", format="nvfp4", tp_scale_mode="both")
    with pytest.raises(ValueError, match="cannot put a Tensor into canonical JSON"):
        make_contract(recipe_rules={"x": torch.zeros(1)})


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "int4_qat", "fp8_block"])
def test_manifest_from_a_recipe_plan(recipe_name):
    recipe = Recipe.load(recipe_name)
    model = Transformer(CFG, seed=0)
    contract = contract_from_recipe(model_config=CFG, recipe=recipe)
    plan = recipe.plan(CFG)
    params = quantize_params(dict(model.named_parameters()), plan)
    m = M.build_manifest(version=1, parent_version=None, contract=contract, tensors=params).manifest
    M.verify_manifest(m)
    assert m.contract.recipe_name == recipe_name
    assert "description" not in m.contract.recipe_rules_json  # free text is not part of the contract
    assert {s.name: s.scope for s in m.contract.activation_sites} == plan.activation_scopes()
    by_name = {t.name: t for t in m.tensors}
    for entry in plan.params:
        assert by_name[entry.name].format == entry.format
    # The rollout rebuilds the same contract from its own config and gets the same fingerprint.
    again = contract_from_recipe(model_config=ModelConfig.from_dict(CFG.to_dict()), recipe=Recipe.load(recipe_name))
    assert again.fingerprint() == m.contract_fingerprint


def test_tandem_inspect_prints_a_manifest_file(packed, tmp_path, capsys):
    from tandem.cli import main

    path = tmp_path / "manifest.pb"
    M.write_manifest(path, packed.manifest)
    assert main(["inspect", str(path), "--tensors", "3"]) == 0
    out = capsys.readouterr().out
    assert "policy version 5 (parent 4)" in out
    assert f"contract fingerprint  {packed.manifest.contract_fingerprint}" in out
    assert "8 x nvfp4/row/global" in out and "partition tp_size: any" in out
    assert packed.manifest.tensors[0].name in out and f"{len(packed.manifest.tensors) - 3} more" in out
    assert main(["inspect", str(path), "--json"]) == 0
    assert '"recipe_name": "mixed"' in capsys.readouterr().out
    path.write_bytes(b"\x0a\xff")
    assert main(["inspect", str(path)]) == 2
    assert "not a tandem.v1.Manifest" in capsys.readouterr().err


def test_parallel_packing_equals_serial_and_published_bytes_are_immutable(tensors):
    """build_manifest packs and hashes tensors in a thread pool: the manifest must not depend on the
    thread count, and a blob must be a copy (a bf16 part is the caller's tensor itself) that nobody
    can write through."""
    kw = dict(version=5, parent_version=4, contract=make_contract(), created_unix_ns=123, chunk_bytes=4096)
    serial = M.build_manifest(tensors=tensors, threads=1, **kw)
    parallel = M.build_manifest(tensors=tensors, threads=4, **kw)
    assert M.manifest_to_bytes(serial.manifest) == M.manifest_to_bytes(parallel.manifest)
    assert all(bytes(serial.blobs[n]) == bytes(parallel.blobs[n]) for n in tensors)

    w = torch.randn(4, 64)
    packed = M.build_manifest(tensors={"w.weight": quantize_param(w, "bf16")}, **kw)
    before = bytes(packed.blobs["w.weight"])
    w.add_(1.0)  # the trainer's next optimizer step
    assert bytes(packed.blobs["w.weight"]) == before
    verify_tensor_bytes(packed.manifest.tensors[0], packed.blobs["w.weight"], 4096)
    with pytest.raises(TypeError):
        packed.blobs["w.weight"][0] = 1
