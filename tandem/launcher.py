"""`tandem run`: one machine, separate processes: a private redis-server (unless the config
names a Redis URL), the trainer and N rollout workers, exactly the services Kubernetes runs.

The launcher writes the run folder (config.yaml resolved, logs/, and what the trainer writes:
metrics.jsonl, checkpoints/, plots), shows the trainer's progress on the console, and on
Ctrl-C or when the trainer finishes stops the rollouts with SIGTERM (they drain), then Redis.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from broker.local_redis import LocalRedis, LocalRedisConfig
from broker.signing import SECRET_ENV, write_secret_file

from . import config as run_config
from .plots import write_plots


def _spawn(args: list[str], log: Path | None) -> subprocess.Popen:
    # A new session: Ctrl-C reaches only the launcher, which then stops children in order.
    out = open(log, "ab") if log else None
    # One BLAS thread per process: trainer and workers share the cores, and oversubscribed
    # torch threads are several times slower than one each.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *args],
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )


def _stop(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(config_path: str | None, run_dir: str | None, overrides: list[str]) -> int:
    # Ctrl-C and SIGTERM both stop the run in order (explicitly: a shell may have started us
    # with SIGINT ignored, as it does for background jobs).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    cfg = run_config.load(config_path, overrides)
    run_dir = Path(run_dir or Path("runs") / f"{cfg.run_id}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    redis = None
    if not cfg.redis_url:
        redis = LocalRedis(LocalRedisConfig(workdir=run_dir / "redis"))
        cfg = dataclasses.replace(cfg, redis_url=redis.start())
        print(f"[tandem] private redis-server at {cfg.redis_url}")
    if not cfg.run_secret_file and not os.environ.get(SECRET_ENV):
        secret = run_dir / "run.secret"  # kept on resume: the run's samples stay verifiable
        cfg = dataclasses.replace(cfg, run_secret_file=str(secret if secret.exists() else write_secret_file(secret)))
    resolved = run_dir / "config.yaml"
    resolved.write_text(run_config.dump(cfg))
    print(f"[tandem] run folder {run_dir}")
    common = ["--config", str(resolved)]
    trainer = _spawn(["trainer", *common, "--run-dir", str(run_dir)], None)
    workers = [
        _spawn(["rollout", *common, "--worker-id", f"w{i}"], run_dir / "logs" / f"rollout-w{i}.log")
        for i in range(cfg.num_rollout_workers)
    ]
    rc = 1
    try:
        while True:
            rc = trainer.poll()
            if rc is not None:
                break
            dead = [i for i, w in enumerate(workers) if w.poll() is not None]
            if dead and len(dead) == len(workers):
                print(f"[tandem] every rollout worker exited; see {run_dir / 'logs'}", file=sys.stderr)
                _stop([trainer])
                rc = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\n[tandem] Ctrl-C: stopping the trainer and the rollout workers", file=sys.stderr)
        _stop([trainer])
        rc = 130
    finally:
        _stop(workers)
        if redis is not None:
            redis.stop()
    plots = write_plots(run_dir)
    print(
        f"[tandem] trainer exited with {rc}; plots: {', '.join(p.name for p in plots) or 'none'}; "
        f"metrics: {run_dir / 'metrics.jsonl'}"
    )
    return rc
