"""TLS settings of the policy gRPC, one frozen dataclass per side (PEM file paths; "" = unset).

`ServerTLS` is the trainer's (`trainer.tls`), `ClientTLS` a rollout worker's (`rollout.tls`); the
gRPC server and client configs take them as they are. Consistency is checked on construction;
that the files exist is checked by the server / client config (at service start).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path


def _missing_files(tls) -> list[str]:
    paths = [f.name for f in fields(tls) if f.name != "server_name"]
    return [
        f"tls.{n}={getattr(tls, n)!r} is not a file"
        for n in paths
        if getattr(tls, n) and not Path(getattr(tls, n)).is_file()
    ]


@dataclass(frozen=True, kw_only=True)
class ServerTLS:
    """TLS of the trainer's policy server; plaintext when `cert` is empty."""

    cert: str = ""
    """PEM certificate chain the server presents ("" = plaintext)."""
    key: str = ""
    """PEM private key of `cert` (set both or neither)."""
    client_ca: str = ""
    """PEM CA that must have signed every client's certificate: requires client certificates (mTLS)."""

    def __post_init__(self):
        errors = []
        if bool(self.cert) != bool(self.key):
            errors.append(f"tls.cert={self.cert!r}, tls.key={self.key!r} (set both or neither)")
        if self.client_ca and not self.cert:
            errors.append(f"tls.client_ca={self.client_ca!r} (mTLS needs tls.cert and tls.key)")
        if errors:
            raise ValueError("ServerTLS: " + "; ".join(errors))

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def missing_files(self) -> list[str]:
        return _missing_files(self)


@dataclass(frozen=True, kw_only=True)
class ClientTLS:
    """TLS of a rollout worker's connection to the policy server; plaintext when `ca` is empty."""

    ca: str = ""
    """PEM CA that signed the trainer's certificate ("" = plaintext)."""
    cert: str = ""
    """PEM client certificate, where the trainer requires one (mTLS)."""
    key: str = ""
    """PEM private key of `cert` (set both or neither)."""
    server_name: str = ""
    """Name checked against the trainer's certificate instead of the dialed host."""

    def __post_init__(self):
        errors = []
        if bool(self.cert) != bool(self.key):
            errors.append(f"tls.cert={self.cert!r}, tls.key={self.key!r} (set both or neither)")
        if (self.cert or self.server_name) and not self.ca:
            errors.append(
                f"tls.cert={self.cert!r}, tls.server_name={self.server_name!r} need tls.ca (TLS is on only with a CA)"
            )
        if errors:
            raise ValueError("ClientTLS: " + "; ".join(errors))

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def missing_files(self) -> list[str]:
        return _missing_files(self)
