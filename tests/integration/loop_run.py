"""A small asynchronous run for the loop's integration tests: a tiny nvfp4_moe model, two workers,
the trainer and each worker as its own `tandem.cli` process (as `tandem run` starts them).

    cfg = tiny_config(tmp_path, run_id, redis_url, loop={"inflight_updates": True})
    with Loop(cfg, tmp_path) as run:       # trainer + w0, w1 started; all stopped (SIGTERM) on exit
        run.wait_trainer()                 # its exit code 0, else its log's tail
    rows = lines(run.run_dir / "metrics.jsonl")
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from broker.codec import Trajectory, decode_trajectory
from broker.keys import Keys
from broker.streams import DATA_FIELD, connect, run_async

TINY_MODEL = {
    "preset": "tiny",
    "overrides": {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64},
}
TRAINER = {
    "max_steps": 10,
    "groups_per_step": 2,
    "group_size": 4,
    "minibatches": 1,
    "warmstart_steps": 2,
    "warmstart_batch": 8,
    "metrics_port": -1,
    "checkpoint_every": 0,
    "collect_timeout_s": 60.0,
}


def tiny_config(tmp: Path, run_id: str, redis_url: str, **sections: dict) -> Path:
    """config.yaml of a tiny two-worker run; each keyword is a section whose keys replace the base's."""
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "num_rollout_workers": 2,
        "loop": {"max_staleness": 1, "seed": 3},
        "recipe": "nvfp4_moe",
        "model": TINY_MODEL,
        "trainer": dict(TRAINER),
        "rollout": {"read_block_ms": 200, "max_inflight_groups": 2, "max_batch": 4},
    }
    for name, keys in sections.items():
        cfg[name] = {**cfg.get(name, {}), **keys}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *args], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip


def lines(path: Path) -> list[dict]:
    """Complete lines only: the trainer may be writing the last one right now."""
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(ln) for ln in complete if ln.strip()]


def wait(cond, what: str, timeout_s: float, procs=()) -> None:
    """Wait for cond(); fail at once if a process exited (an exited trainer makes no more progress),
    else after timeout_s (a hang detector: generous, since it costs nothing when the run is healthy
    and three cold torch processes on a loaded 2-core box start slowly)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            assert p.poll() is None, f"a process exited ({p.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM what still runs, then wait 20 s for each (SIGKILL past that)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def all_trajectories(redis_url: str, run_id: str) -> list[Trajectory]:
    """Every trajectory still on the run's stream (committed entries get trimmed)."""

    async def main():
        r = connect(redis_url)
        try:
            entries = await r.xrange(Keys(run_id=run_id).trajectories)
        finally:
            await r.aclose()
        return [decode_trajectory(fields[DATA_FIELD]) for _, fields in entries]

    return run_async(main())


class Loop:
    """The trainer (run folder tmp/run) and workers w0, w1, logs in tmp/logs/<name>.log."""

    def __init__(self, cfg: Path, tmp: Path, workers: tuple[str, ...] = ("w0", "w1")):
        self.cfg, self.run_dir, self.logs = cfg, tmp / "run", tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.trainer_args = ["trainer", "--config", str(cfg), "--run-dir", str(self.run_dir)]
        self.trainer = spawn(self.trainer_args, self.logs / "trainer.log")
        self.workers = {w: spawn(["rollout", "--config", str(cfg), "--worker-id", w], self.log(w)) for w in workers}

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def restart_trainer(self) -> None:
        self.trainer = spawn(self.trainer_args, self.log("trainer"))

    def wait_trainer(self, timeout_s: float = 600) -> None:
        """Until the trainer exits (a worker exiting first fails at once); it must exit 0."""
        wait(lambda: self.trainer.poll() is not None, "the trainer to finish", timeout_s, self.workers.values())
        assert self.trainer.returncode == 0, self.log("trainer").read_text()[-3000:]

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, *exc) -> None:
        stop([self.trainer, *self.workers.values()])
