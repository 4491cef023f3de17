"""What the fault scenarios share: a run of real processes (trainer + rollout workers, as
`tandem trainer` / `tandem rollout`, on a real redis-server) that a scenario kills, restarts,
partitions and poisons, and the exactly-once audit every scenario ends with.

The audit, from the trainer's `audit.jsonl` and its final checkpoint (the trainer's own record,
which does not depend on what Redis kept):
    fed         = prompt groups p0 .. p{prompt_seq-1}      (prompt i is a pure function of i)
    trained     = the groups of every audit line            (each exactly once)
    dropped     = the groups settled without training      (stale, counted)
    outstanding = fed, not yet settled (queued, in flight, held)
    fed == trained + dropped + outstanding, pairwise disjoint; nothing trained that was not fed.

FAULT_TRIALS (environment, default 2) sets how many random kills a random-kill scenario makes;
CI runs the default, docs/reliability.md says how to run more. With FAULT_REPORT set to a file
path, each scenario appends its figures there as one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from broker.signing import write_secret_file
from trainer.checkpoints import latest_checkpoint

TRIALS = int(os.environ.get("FAULT_TRIALS", "2"))
KILL_POINTS = Path(__file__).with_name("kill_points.py")
ROOT = Path(__file__).resolve().parents[2]


def config(tmp: Path, run_id: str, redis_url: str, *, max_steps: int, workers: int = 2, **trainer) -> Path:
    secret = tmp / "run.secret"  # signed runs: trajectories and the policy pointer carry HMACs
    if not secret.exists():
        write_secret_file(secret)
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "run_secret_file": str(secret),
        "num_rollout_workers": workers,
        "loop": {"max_staleness": 1, "seed": 5},
        "recipe": "bf16",
        "redis_outage_s": 60.0,
        "model": {
            "preset": "tiny",
            "overrides": {"n_layers": 1, "dim": 32, "n_experts": 2, "expert_ffn_dim": 32, "shared_expert_ffn_dim": 32},
        },
        "task": {"digits": 1},
        "trainer": {
            "max_steps": max_steps,
            "groups_per_step": 2,
            "group_size": 4,
            "minibatches": 1,
            "warmstart_steps": 2,
            "warmstart_batch": 8,
            "metrics_port": -1,
            "collect_timeout_s": 90.0,
            **trainer,
        },
        "rollout": {"reclaim_idle_s": 2.0, "heartbeat_s": 0.5, "heartbeat_ttl_s": 3.0, "read_block_ms": 200},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Run:
    """The processes of one run; `close()` stops whatever is still running."""

    def __init__(self, tmp: Path, cfg: Path):
        self.tmp, self.cfg = tmp, cfg
        self.run_dir = tmp / "run"
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.trainer: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def _spawn(self, args: list[str], log: str, env: dict | None = None, command: list[str] | None = None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        if command is not None:  # a script: the repository's packages first on its path, as `-m` has them
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        return subprocess.Popen(
            [sys.executable, *(command or ["-m", "tandem.cli"]), *args],
            stdout=open(self.logs / log, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )

    def start_trainer(self, *overrides: str, env: dict | None = None, kill_at: str | None = None) -> None:
        """`env`: extra environment; `kill_at`: POINT@STEP, the trainer SIGKILLed there (kill_points.py)."""
        args = ["trainer", "--config", str(self.cfg), "--run-dir", str(self.run_dir), *overrides]
        if kill_at is None:
            self.trainer = self._spawn(args, "trainer.log", env)
        else:
            self.trainer = self._spawn([kill_at, *args[1:]], "trainer.log", env, command=[str(KILL_POINTS)])

    def start_worker(self, worker_id: str, *overrides: str) -> None:
        self.workers[worker_id] = self._spawn(
            ["rollout", "--config", str(self.cfg), "--worker-id", worker_id, *overrides], f"{worker_id}.log"
        )

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def steps(self) -> int:
        return len(lines(self.run_dir / "metrics.jsonl"))

    def wait_steps(self, n: int, timeout_s: float = 180.0) -> float:
        """Wait until metrics.jsonl has n lines; the seconds it took. Fails if a process died."""
        t0 = time.monotonic()
        while self.steps() < n:
            for name, p in [("trainer", self.trainer), *self.workers.items()]:
                if p is not None and p.poll() not in (None, 0):
                    raise AssertionError(f"{name} exited {p.returncode} waiting for step {n}:\n{self.log_tail(name)}")
            assert time.monotonic() - t0 < timeout_s, f"no step {n} after {timeout_s}s:\n{self.log_tail('trainer')}"
            time.sleep(0.1)
        return time.monotonic() - t0

    def wait_step_after(self, t_wall: float, timeout_s: float = 180.0) -> float:
        """Wait for a step finished after wall time `t_wall` (a fault); the seconds from `t_wall`."""
        while not any(m["time"] > t_wall for m in lines(self.run_dir / "metrics.jsonl")):
            if self.trainer is not None and self.trainer.poll() == 0:
                return time.time() - t_wall  # it finished its last step just before the fault
            for name, p in [("trainer", self.trainer), *self.workers.items()]:
                if p is not None and p.poll() not in (None, 0):
                    raise AssertionError(f"{name} exited {p.returncode} after a fault:\n{self.log_tail(name)}")
            assert time.time() - t_wall < timeout_s, f"no step {timeout_s}s after a fault:\n{self.log_tail('trainer')}"
            time.sleep(0.1)
        return max(0.0, min(m["time"] for m in lines(self.run_dir / "metrics.jsonl") if m["time"] > t_wall) - t_wall)

    def wait_trainer(self, timeout_s: float = 240.0) -> int:
        try:
            return self.trainer.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"trainer still running after {timeout_s}s:\n{self.log_tail('trainer')}") from None

    def log_tail(self, name: str, n: int = 4000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def close(self) -> None:
        procs = [p for p in [self.trainer, *self.workers.values()] if p is not None and p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def trained_by(run_dir: Path, worker_id: str) -> list[int]:
    """The steps that trained a group of `worker_id`, from audit.jsonl."""
    return [r["step"] for r in lines(run_dir / "audit.jsonl") for g in r["groups"] if g[2] == worker_id]


def lines(path: Path) -> list[dict]:
    """The complete lines of a JSONL file another process appends to (a last line still being
    written, without its newline, is left out)."""
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(ln) for ln in complete if ln.strip()]


def checkpoint_state(run_dir: Path) -> dict:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None, f"no trainer checkpoint in {run_dir}"
    return torch.load(path, map_location="cpu", weights_only=True)["state"]


def audit(run_dir: Path, max_steps: int, *, stopped: bool = False) -> dict:
    """The exactly-once audit (module docstring); returns the figures. Fails on any violation.
    `stopped`: the trainer was stopped (SIGTERM) rather than finishing max_steps, so what it dropped
    in its last, unfinished collect is in the checkpoint but in no audit or metrics line."""
    rows = lines(run_dir / "audit.jsonl")
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1)), [r["step"] for r in rows]
    state = checkpoint_state(run_dir)
    trained = [g[0] for r in rows for g in r["groups"]]
    dropped = [g for r in rows for g in r.get("dropped", [])] + list(state.get("dropped_unaudited", []))
    fed = {f"p{i}" for i in range(state["prompt_seq"])}
    outstanding = set(state["outstanding"])
    doubled = len(trained) - len(set(trained))
    assert doubled == 0, f"{doubled} groups trained twice"
    assert set(trained) <= fed, f"trained groups never fed: {sorted(set(trained) - fed)[:5]}"
    assert not set(trained) & set(dropped), sorted(set(trained) & set(dropped))[:5]
    assert not (set(trained) | set(dropped)) & outstanding
    # Drop counters are run totals, persisted in the checkpoint: never lower after a restart.
    metrics = lines(run_dir / "metrics.jsonl")
    counters = ("dropped_stale", "dropped_fingerprint", "duplicates", "malformed", "invalid", "unsigned", "refed")
    for key in (*counters, "prompts_dead_lettered"):
        values = [m[key] for m in metrics]
        assert values == sorted(values), f"{key} went down (reset by a restart?): {values}"
        assert values[-1] <= state[key] if stopped else values[-1] == state[key], (key, values[-1], state[key])
    lost = fed - set(trained) - set(dropped) - outstanding
    assert not lost, f"{len(lost)} fed prompts neither trained, dropped nor outstanding: {sorted(lost)[:5]}"
    return {
        "fed": len(fed),
        "trained": len(trained),
        "dropped": len(dropped),
        "outstanding": len(outstanding),
        "lost": len(lost),
        "doubled": doubled,
        "invalid": state["invalid"],
        "duplicates": state["duplicates"],
        "refed": state["refed"],
    }


def report(scenario: str, **figures) -> None:
    path = os.environ.get("FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, **figures}) + "\n")
