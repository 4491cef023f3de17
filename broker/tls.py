"""TLS settings of the policy gRPC, one frozen dataclass per side (PEM file paths; "" = unset), and
`handshake_problem`, which says in one line why a worker's TLS handshake with the trainer fails.

`ServerTLS` is the trainer's (`trainer.tls`), `ClientTLS` a rollout worker's (`rollout.tls`); the
gRPC server and client configs take them as they are. Consistency is checked on construction;
that the files exist is checked by the server / client config (at service start). gRPC reports a
failed handshake only as a call that never connects (DEADLINE_EXCEEDED): the policy client then
repeats the handshake with Python's ssl module to name the side that refused and the file at fault.
"""

from __future__ import annotations

import socket
import ssl
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


class TLSHandshakeError(ConnectionError):
    """A TLS handshake with the policy server failed; the message says which side refused and why."""


# OpenSSL reasons of an alert the server sent: it refused the worker's certificate (or its absence).
_NO_CLIENT_CERT = ("CERTIFICATE_REQUIRED", "HANDSHAKE_FAILURE", "PEER_DID_NOT_RETURN_A_CERTIFICATE")
_BAD_CLIENT_CERT = ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "DECRYPT_ERROR")


def handshake_problem(address: str, tls: ClientTLS, timeout_s: float = 3.0) -> str | None:
    """Why a TLS handshake with `address` (host:port) under `tls` fails, in one line naming the side
    and the setting at fault; None if it succeeds, or if nothing answers there (not a TLS problem).
    A plaintext `tls` is checked too: a server that answers a TLS handshake is a TLS server."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return None
    with sock:
        if not tls.enabled:
            return _plaintext_problem(sock, address)
        ctx = ssl.create_default_context(cafile=tls.ca)
        ctx.set_alpn_protocols(["h2"])  # gRPC closes a connection that does not offer HTTP/2
        if tls.cert:
            ctx.load_cert_chain(tls.cert, tls.key)
        try:
            with ctx.wrap_socket(sock, server_hostname=tls.server_name or host) as s:
                # TLS 1.3: the server checks the client's certificate after the client's handshake is
                # done; gRPC then closes the connection (end of file) instead of sending its SETTINGS.
                s.settimeout(min(timeout_s, 1.0))
                if s.recv(1) == b"":
                    return _refused_by_server(address, tls, "the server closed the connection after the handshake")
        except ssl.SSLCertVerificationError as e:
            return (
                f"TLS handshake with {address} failed on the worker's side: the trainer's certificate does not "
                f"verify against rollout.tls.ca={tls.ca!r} ({e.verify_message}"
                + ("; or set rollout.tls.server_name" if "hostname" in (e.verify_message or "").lower() else "")
                + ")"
            )
        except ssl.SSLError as e:
            return _refused_by_server(address, tls, e.reason or str(e))
        except OSError:  # a timeout or a closed connection after the handshake: no TLS problem seen
            return None
    return None


def _refused_by_server(address: str, tls: ClientTLS, reason: str) -> str:
    closed = reason.startswith("the server closed")
    if (closed or any(r in reason for r in _NO_CLIENT_CERT)) and not tls.cert:
        return (
            f"TLS handshake with {address} failed on the trainer's side: it requires a client certificate "
            f"(mTLS) and this worker has none: set rollout.tls.cert and rollout.tls.key ({reason})"
        )
    if closed or any(r in reason for r in _NO_CLIENT_CERT + _BAD_CLIENT_CERT):
        return (
            f"TLS handshake with {address} failed on the trainer's side: it refused the worker's certificate "
            f"rollout.tls.cert={tls.cert!r} (not signed by the trainer's trainer.tls.client_ca?) ({reason})"
        )
    if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER" in reason or "PACKET_LENGTH" in reason:
        return f"TLS handshake with {address} failed: the server there does not speak TLS (unset rollout.tls.ca?) ({reason})"
    return f"TLS handshake with {address} failed: {reason}"


def _plaintext_problem(sock: socket.socket, address: str) -> str | None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock):
            pass
    except OSError:  # ssl.SSLError included: not a TLS server
        return None
    return (
        f"{address} is a TLS server and this worker speaks plaintext: set rollout.tls.ca to the CA of the "
        f"trainer's certificate (and rollout.tls.cert/key where it requires client certificates)"
    )
