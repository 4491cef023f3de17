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


def _floor(requirement: str) -> str:
    return requirement.partition(">=")[2].split(",")[0].strip()


def test_the_stubs_accept_the_oldest_grpcio_pyproject_allows():
    import re
    import subprocess
    import sys
    import tomllib

    deps = tomllib.loads((protos.REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    grpc_deps = {d.split(">=")[0]: _floor(d) for d in deps if d.startswith("grpcio")}
    assert grpc_deps == dict.fromkeys(["grpcio", "grpcio-health-checking", "grpcio-reflection"], protos.MIN_GRPCIO)
    for stub in sorted((protos.REPO_ROOT / protos.PROTO_PACKAGE).glob("*_pb2_grpc.py")):
        assert re.findall(r"^GRPC_GENERATED_VERSION = '(.*)'$", stub.read_text(), re.M) == [protos.MIN_GRPCIO]

    def import_under(version: str):
        code = f"import grpc; grpc.__version__ = {version!r}; import tandem.v1.policy_pb2_grpc, tandem.v1.manifest_pb2_grpc"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    assert import_under(protos.MIN_GRPCIO).returncode == 0  # the GPU image's grpcio
    older = import_under("1.83.9")  # below the floor the stubs' own check still refuses
    assert older.returncode == 1 and f"depends on grpcio>={protos.MIN_GRPCIO}" in older.stderr


# The grpcio calls the generated stubs make, each present in grpcio 1.84.0 (tandem.protos.MIN_GRPCIO;
# tests/integration/test_policy_grpc.py and test_grpc_limits.py pass under it). A grpcio-tools that
# writes another call fails here: check the new call against MIN_GRPCIO (or raise it) before adding it.
CHECKED_CALLS = {
    "_registered_method=",
    "channel.unary_stream(",
    "channel.unary_unary(",
    "grpc.experimental.unary_stream(",
    "grpc.experimental.unary_unary(",
    "grpc.method_handlers_generic_handler(",
    "grpc.unary_stream_rpc_method_handler(",
    "grpc.unary_unary_rpc_method_handler(",
    "server.add_generic_rpc_handlers(",
    "server.add_registered_method_handlers(",
}


def test_the_stubs_call_only_what_the_oldest_grpcio_has():
    import re

    calls = set()
    for stub in (protos.REPO_ROOT / protos.PROTO_PACKAGE).glob("*_pb2_grpc.py"):
        body = stub.read_text().split("raise RuntimeError(", 1)[1]  # past the version check itself
        calls |= set(re.findall(r"\bgrpc\.[A-Za-z_.]+\(|\b(?:server|channel)\.[a-z_]+\(|\b_[a-z_]+=", body))
    assert calls == CHECKED_CALLS
