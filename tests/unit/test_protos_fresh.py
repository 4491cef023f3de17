"""The committed generated code in tandem/v1/ matches `python -m tandem.protos` (fails when stale)."""

from __future__ import annotations

from pathlib import Path

from tandem import protos


def test_generated_code_is_fresh(tmp_path: Path):
    generated = protos.generate(tmp_path)
    assert generated, "protoc generated nothing"
    committed_dir = protos.REPO_ROOT / protos.PROTO_PACKAGE
    stale = []
    for rel in generated:
        committed = protos.REPO_ROOT / rel
        if not committed.is_file():
            stale.append(f"{rel} is missing")
        elif committed.read_bytes() != (tmp_path / rel).read_bytes():
            stale.append(f"{rel} differs")
    # Generated files whose .proto is gone are stale too.
    leftovers = sorted(
        p.relative_to(protos.REPO_ROOT)
        for p in committed_dir.glob("*_pb2*.py*")
        if p.relative_to(protos.REPO_ROOT) not in set(generated)
    )
    stale += [f"{p} has no .proto" for p in leftovers]
    assert not stale, "generated protobuf code is stale; run `python -m tandem.protos`: " + "; ".join(stale)


def test_generated_modules_import_without_rewriting():
    from tandem.v1 import manifest_pb2, policy_pb2, policy_pb2_grpc

    assert policy_pb2.DESCRIPTOR.package == "tandem.v1"
    assert policy_pb2.DESCRIPTOR.dependencies[0] is manifest_pb2.DESCRIPTOR
    service = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"]
    assert [m.name for m in service.methods] == ["GetManifest", "FetchTensors", "WatchVersions"]
    assert service.methods_by_name["FetchTensors"].server_streaming
    assert hasattr(policy_pb2_grpc, "PolicyServiceStub")
