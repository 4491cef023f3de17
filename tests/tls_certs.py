"""Test certificates made by openssl: a dedicated CA and certificates it signs (tests skip without openssl)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, names: tuple[str, ...], san: str = "IP:127.0.0.1") -> None:
    """d/ca.crt + ca.key, and d/<name>.crt + <name>.key for each name, valid for `san` and for both
    server and client authentication."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=tandem-test-ca", cwd=d)  # fmt: skip
    (d / "ext").write_text(f"subjectAltName={san}\n")
    for name in names:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", "/CN=127.0.0.1", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "1", "-extfile", "ext", cwd=d)  # fmt: skip
