"""`tandem inspect TARGET`: print the manifest of a published policy.

TARGET is a manifest file (serialized tandem.v1.Manifest, e.g. written by
policy.manifest.write_manifest) or the host:port of a running policy server. The manifest is
verified (internal consistency, contract fingerprint) before anything is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="manifest file, or host:port of a policy server")
    parser.add_argument("--version", type=int, default=None, help="version to ask the server for (default: latest)")
    parser.add_argument(
        "--tensors", type=int, default=20, metavar="N", help="list the first N tensors (0: none, -1: all; default 20)"
    )
    parser.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline of the server call, seconds")
    parser.add_argument("--tls-ca", default=None, help="CA certificate: connect with TLS")
    parser.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="client private key (mTLS)")
    parser.add_argument(
        "--run-secret-file",
        default="",
        help="the run's secret (a tandem run's run.secret; default $TANDEM_RUN_SECRET): sends the run token "
        "that a trainer with a run secret requires",
    )


def load(args: argparse.Namespace):
    from policy.manifest import read_manifest

    if Path(args.target).is_file():
        if args.version is not None:
            raise ValueError("--version applies to a server, not to a manifest file")
        return read_manifest(args.target)
    if ":" not in args.target:
        raise ValueError(f"{args.target!r} is neither a file nor a host:port address")
    from broker.policy_client import PolicyClient, PolicyClientConfig, check_reachable
    from broker.signing import load_signer, policy_token
    from broker.tls import ClientTLS

    tls = ClientTLS(ca=args.tls_ca or "", cert=args.tls_cert or "", key=args.tls_key or "")
    token = policy_token(load_signer(args.run_secret_file))
    config = PolicyClientConfig(address=args.target, call_timeout_s=args.timeout, tls=tls, run_token=token)
    check_reachable(args.target, min(args.timeout, 3.0))
    with PolicyClient(config) as client:
        _check_handshake(client, args)
        return client.get_manifest(args.version)


def _check_handshake(client, args) -> None:
    """One health call without waiting for the channel: a TLS handshake that fails shows up here as
    UNAVAILABLE at once, named as such (gRPC would otherwise retry it until DEADLINE_EXCEEDED)."""
    import grpc

    try:
        client.health("", wait_for_ready=False)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            return  # reachable: the manifest call reports anything else
        details = e.details() or ""
        if args.tls_ca:
            raise ValueError(
                f"{args.target}: TLS handshake failed: likely a wrong CA (--tls-ca), a certificate not "
                f"issued for this server name, or a server that requires a client certificate "
                f"(--tls-cert/--tls-key); gRPC: {details.splitlines()[0][:300]}"
            ) from None
        raise ValueError(
            f"{args.target}: the server accepted the connection but does not speak plaintext gRPC "
            f"(a TLS server? pass --tls-ca); gRPC: {details.splitlines()[0][:300]}"
        ) from None


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def render(m, n_tensors: int = 20) -> str:
    from policy.chunks import chunk_count
    from policy.tp_layout import format_params

    c = m.contract
    created = datetime.datetime.fromtimestamp(m.created_unix_ns / 1e9, tz=datetime.UTC)
    parent = m.parent_version if m.HasField("parent_version") else "none"
    model = json.loads(c.model_config_json)
    model_short = ", ".join(f"{k}={model[k]}" for k in ("vocab_size", "dim", "n_layers", "n_experts") if k in model)
    pinned = c.tp_plan.partition_tp_size
    sites = Counter((s.format, s.scope, s.tp_scale_mode) for s in c.activation_sites)
    n_chunks = sum(chunk_count(t.nbytes, m.chunk_bytes) for t in m.tensors)
    lines = [
        f"policy version {m.version} (parent {parent}), created {created.isoformat(timespec='seconds')}",
        f"  contract fingerprint  {m.contract_fingerprint}",
        f"  model config          sha256 {c.model_config_sha256[:16]}  ({model_short})",
        f"  recipe                {c.recipe_name}  sha256 {c.recipe_sha256[:16]}",
        f"  quantizer spec        {c.quantizer_spec_version}",
        f"  TP plan               {len(c.tp_plan.rules)} rules; partition tp_size: {pinned or 'any'}",
        f"  activation sites      {len(c.activation_sites)}"
        + "".join(f"; {n} x {f}/{s}/{mode}" for (f, s, mode), n in sorted(sites.items())),
        f"  tensors               {len(m.tensors)}, {_mb(m.total_bytes)} in {n_chunks} chunks of <= {m.chunk_bytes} B",
    ]
    by_format: dict[str, list[int]] = {}
    for t in m.tensors:
        acc = by_format.setdefault(t.format, [0, 0])
        acc[0] += 1
        acc[1] += t.nbytes
    for fmt, (count, nbytes) in sorted(by_format.items()):
        lines.append(f"    {fmt:<10} {count:>6} tensors  {_mb(nbytes)}")
    shown = list(m.tensors) if n_tensors < 0 else list(m.tensors)[:n_tensors]
    if shown:
        lines.append("")
        lines.append(
            f"  {'name':<52} {'format':<9} {'params':<22} {'shape':<12} {'tp':<15} "
            f"{'parts (bytes)':<44} {'global':<11} {'chunks':>6}  sha256"
        )
        for t in shown:
            parts = " ".join(f"{p.name}={p.nbytes}" for p in t.parts)
            params = json.dumps(format_params(t), separators=(",", ":"))
            gs = f"{t.global_scale:.4g}" if t.HasField("global_scale") else "-"
            shape = "x".join(str(s) for s in t.shape)
            lines.append(
                f"  {t.name:<52} {t.format:<9} {params:<22} {shape:<12} {t.tp_style:<15} {parts:<44} "
                f"{gs:<11} {len(t.chunk_xxh3):>6}  {t.sha256.hex()[:16]}"
            )
        if len(shown) < len(m.tensors):
            lines.append(f"  ... {len(m.tensors) - len(shown)} more (--tensors -1 lists all)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import grpc

    try:
        m = load(args)
    except grpc.RpcError as e:
        print(f"tandem inspect: {args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if args.json:
        from google.protobuf import json_format

        print(json_format.MessageToJson(m, preserving_proto_field_name=True, indent=1))
    else:
        print(render(m, args.tensors))
    return 0
