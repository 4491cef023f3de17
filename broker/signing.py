"""Authenticating what travels through Redis: HMAC-SHA256 with a per-run secret.

With a run secret, every trajectory entry carries `s = HMAC(key, "tandem.trajectory\\0" || d)` over
its encoded bytes `d`, every prompt entry `s = HMAC(key, "tandem.prompt\\0" || d)`, and
`policy:latest` carries `sig = HMAC(key, "tandem.policy_pointer\\0" || version \\n address \\n
fingerprint \\n published_at \\n content_digest)` over the stored strings. The trainer dead-letters
and counts trajectories without a valid tag; workers dead-letter and count such prompts, and refuse
such pointers. The domain prefix keeps a tag for one kind of message from verifying as another. The
policy server's run token (`policy_token`, the tag of an empty message in its own domain)
authenticates workers to the trainer's gRPC: sent as metadata `RUN_TOKEN_HEADER`, it reveals
nothing of the secret.

The secret: 32 random bytes as 64 hex characters, in a file (`run_secret_file`, e.g. a mounted
Kubernetes Secret) or the TANDEM_RUN_SECRET environment variable; `tandem run` generates one per
run (mode 0600 in the run folder). Without a secret nothing is signed or checked (tests, benches).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

TRAJECTORY = b"tandem.trajectory"
PROMPT = b"tandem.prompt"
POLICY_POINTER = b"tandem.policy_pointer"
POLICY_TOKEN = b"tandem.policy_token"
RUN_TOKEN_HEADER = "x-tandem-run-token"  # gRPC metadata keys are lower case
SECRET_ENV = "TANDEM_RUN_SECRET"
_MIN_KEY_BYTES = 16


class Signer:
    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
            raise ValueError(f"run secret: want at least {_MIN_KEY_BYTES} bytes")
        self._key = key

    @classmethod
    def from_hex(cls, text: str, where: str) -> Signer:
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError(f"run secret in {where}: not hex") from None
        if len(key) < _MIN_KEY_BYTES:
            raise ValueError(f"run secret in {where}: {len(key)} bytes, want at least {_MIN_KEY_BYTES}")
        return cls(key)

    def sign(self, domain: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, domain + b"\0" + payload, hashlib.sha256).digest()

    def verify(self, domain: bytes, payload: bytes, tag: bytes | None) -> bool:
        return tag is not None and hmac.compare_digest(self.sign(domain, payload), tag)

    def policy_token(self) -> str:
        """The run's token for the policy gRPC (64 hex characters), the same for trainer and workers."""
        return self.sign(POLICY_TOKEN, b"").hex()


def policy_token(signer: Signer | None) -> str:
    """`signer.policy_token()`, or "" (no token: the server treats the client as unauthenticated)."""
    return signer.policy_token() if signer is not None else ""


def load_signer(secret_file: str = "", environ: dict | None = None) -> Signer | None:
    """The run's Signer from `secret_file`, else from $TANDEM_RUN_SECRET; None if neither is set."""
    env = os.environ if environ is None else environ
    if secret_file:
        path = Path(secret_file)
        if not path.is_file():
            raise ValueError(f"run_secret_file={secret_file!r} does not exist")
        return Signer.from_hex(path.read_text(), secret_file)
    if env.get(SECRET_ENV):
        return Signer.from_hex(env[SECRET_ENV], f"${SECRET_ENV}")
    return None


def write_secret_file(path: Path) -> Path:
    """A fresh 32-byte secret, hex, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path
