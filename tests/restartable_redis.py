"""A redis-server on a fixed loopback port that tests stop, restart, wipe and restart again, with
AOF persistence (`appendfsync` as given) or none: the outages that services must ride out."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from broker.local_redis import free_port


class RestartableRedis:
    def __init__(self, workdir: Path, *, appendfsync: str | None = "everysec"):
        self.workdir, self.appendfsync = Path(workdir), appendfsync
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> str:
        aof = (
            ["--appendonly", "no"]
            if self.appendfsync is None
            else ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        )
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *aof,
             "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                assert self.proc.poll() is None, (self.workdir / "redis.log").read_text()[-2000:]
                try:
                    if client.ping():
                        return self.url
                except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                    pass
                assert time.monotonic() < deadline, f"redis-server on {self.port} did not answer in {timeout_s}s"
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, *, kill: bool = False) -> None:
        """SIGKILL (a crash: AOF keeps what was fsynced) or SIGTERM (a clean shutdown)."""
        if self.proc is not None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None

    def wipe(self) -> None:
        """Stop and lose everything (a failover to an empty replica)."""
        self.stop(kill=True)
        for p in self.workdir.iterdir():
            if p.name != "redis.log":
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def __enter__(self) -> RestartableRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(kill=True)
