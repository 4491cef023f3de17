"""Regenerate the protobuf and gRPC modules in tandem/v1/ from protos/tandem/v1/*.proto.

    python -m tandem.protos            # writes tandem/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m tandem.protos --out DIR  # writes DIR/tandem/v1/... (used by the staleness test)

protoc runs with `-Iprotos`, so a file's import path is `tandem/v1/x.proto` and the
generated code imports `tandem.v1.x_pb2`: the package path mirrors the proto path and
nothing needs rewriting. The generated files are committed; tests/unit/test_protos_fresh.py
fails when they are stale.

grpcio-tools writes its own version into each *_pb2_grpc.py as the oldest grpcio it accepts
(a RuntimeError at import below it), not what the stubs use; `generate` sets it to MIN_GRPCIO,
pyproject.toml's floor, the oldest grpcio the stubs' calls were checked against.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE = Path("tandem") / "v1"
MIN_GRPCIO = "1.84.0"  # the GPU image's grpcio; tests/unit/test_protos_fresh.py lists the calls checked
_VERSION_LINE = re.compile(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.MULTILINE)


def proto_files() -> list[Path]:
    """The .proto files, relative to PROTO_ROOT, sorted so runs are reproducible."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into out_dir; return the generated files (relative to out_dir)."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency, imported only when generating

    files = proto_files()
    if not files:
        raise ValueError(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE}")
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    argv = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(f) for f in files],
    ]
    rc = protoc.main(argv)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(argv)}")
    generated = []
    for f in files:
        stem = f.with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            path = Path(str(stem) + suffix)
            if not (out_dir / path).is_file():
                raise RuntimeError(f"protoc did not write {out_dir / path}")
            generated.append(path)
            if suffix == "_pb2_grpc.py":
                _relax_version_check(out_dir / path)
    return generated


def _relax_version_check(path: Path) -> None:
    """Set the stub's GRPC_GENERATED_VERSION (the oldest grpcio it imports under) to MIN_GRPCIO."""
    text, n = _VERSION_LINE.subn(f"GRPC_GENERATED_VERSION = '{MIN_GRPCIO}'", path.read_text())
    if n != 1:
        raise RuntimeError(f"{path}: {n} GRPC_GENERATED_VERSION lines (want 1): grpcio-tools changed its stubs")
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.protos", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(args.out / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
