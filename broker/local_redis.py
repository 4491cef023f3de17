"""A private `redis-server` on a free loopback port, for tests, benchmarks and `tandem run`.

Simplified on purpose: loopback only, one process per instance, no persistence unless
`appendonly` (an append-only file in `workdir`, fsynced every second: what `tandem run` uses so
that a resumed run finds its streams again). The server runs in its own process session, so a
terminal's Ctrl-C reaches only its owner, which stops it last. A production deployment runs its
own Redis; this module only exists so that everything on one machine (CI, the demo, the
benchmarks) uses a real server started the same way.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on `host` a moment ago.

    Another process may take it before we bind it again; callers that start servers
    retry with a new port (see `LocalRedis.start`).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class LocalRedisConfig:
    workdir: Path
    executable: str = "redis-server"
    host: str = "127.0.0.1"
    start_timeout_s: float = 10.0
    start_attempts: int = 3
    maxmemory: str = "0"  # "0" = no limit; e.g. "2gb" for a bounded demo
    appendonly: bool = False  # persist to an AOF in workdir (appendonlydir/), reloaded on the next start

    def __post_init__(self) -> None:
        errors = []
        if not self.host.startswith("127.") and self.host not in ("localhost", "::1"):
            errors.append(f"host={self.host!r} (loopback only)")
        if not 0 < self.start_timeout_s <= 120:
            errors.append(f"start_timeout_s={self.start_timeout_s} (want 0 < t <= 120)")
        if not 1 <= self.start_attempts <= 10:
            errors.append(f"start_attempts={self.start_attempts} (want 1..10)")
        if errors:
            raise ValueError("LocalRedisConfig: " + "; ".join(errors))


class LocalRedis:
    """Start with `start()` (or `with LocalRedis(cfg) as url:`), stop with `stop()`."""

    def __init__(self, config: LocalRedisConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("LocalRedis is not started")
        return f"redis://{self.config.host}:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return Path(self.config.workdir) / "redis.log"

    def start(self) -> str:
        cfg = self.config
        exe = shutil.which(cfg.executable)
        if exe is None:
            raise RuntimeError(
                f"{cfg.executable!r} is not on PATH. Install Redis 7.0+ "
                "(Debian: `apt-get install redis-server`, or `make redis`)."
            )
        Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
        last_error = ""
        for _ in range(cfg.start_attempts):
            port = free_port(cfg.host)
            proc = subprocess.Popen(
                [
                    exe,
                    "--port",
                    str(port),
                    "--bind",
                    cfg.host,
                    "--save",
                    "",
                    "--appendonly",
                    "yes" if cfg.appendonly else "no",
                    "--appendfsync",
                    "everysec",
                    "--dir",
                    str(cfg.workdir),
                    "--logfile",
                    str(self.logfile),
                    "--daemonize",
                    "no",
                    "--maxmemory",
                    cfg.maxmemory,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a terminal's SIGINT reaches the owner only; it stops us last
            )
            error = _wait_for_ping(proc, cfg.host, port, cfg.start_timeout_s)
            if error is None:
                self.proc, self.port = proc, port
                return self.url
            _kill(proc)
            last_error = error
        log = self.logfile.read_text(errors="replace")[-2000:] if self.logfile.exists() else ""
        raise RuntimeError(
            f"redis-server did not answer PING after {cfg.start_attempts} attempts: "
            f"{last_error}\n--- {self.logfile} ---\n{log}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            _kill(self.proc)
            self.proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_for_ping(proc: subprocess.Popen, host: str, port: int, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host=host, port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                return f"exited with code {proc.returncode} on port {port}: {err.strip()}"
            try:
                if client.ping():
                    return None
            except redis.exceptions.ConnectionError:
                pass
            except redis.exceptions.BusyLoadingError:
                pass
            time.sleep(0.02)
        return f"no PING reply on port {port} within {timeout_s} s"
    finally:
        client.close()


def _kill(proc: subprocess.Popen) -> None:
    # SIGTERM first: redis-server flushes its AOF (if any) and exits.
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    if proc.stderr:
        proc.stderr.close()
