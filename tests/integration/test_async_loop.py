"""The asynchronous loop end to end: a real redis-server, the trainer and two rollout workers as
separate processes talking gRPC and Redis, as `tandem run` starts them.

Each worker keeps three prompt groups in flight (continuous batching). One run exercises the fault
paths in order: a rollout worker is SIGKILLed (the other finishes its
prompts), a stale and a wrong-fingerprint trajectory are injected (dropped and counted), and the
trainer is SIGKILLed and restarted (it resumes from its checkpoint and uses no sample twice).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from broker.codec import Trajectory, decode_trajectory
from broker.keys import Keys
from broker.streams import DATA_FIELD, TrajectoryStream, connect, run_async

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 10  # steps left after step 3 for the injected samples to be read and counted, even under load


def _config(tmp: Path, run_id: str, redis_url: str) -> Path:
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "num_rollout_workers": 2,
        "loop": {"max_staleness": 1, "seed": 3},
        "recipe": "nvfp4_moe",
        "model": {
            "preset": "tiny",
            "overrides": {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64},
        },
        "task": {"digits": 1},
        "trainer": {
            "max_steps": MAX_STEPS,
            "groups_per_step": 2,
            "group_size": 4,
            "minibatches": 1,
            "warmstart_steps": 5,
            "warmstart_batch": 8,
            "metrics_port": -1,
            "checkpoint_every": 2,  # a restart redoes the steps since the last even one
            "collect_timeout_s": 60.0,
        },
        # Three groups in flight per worker (continuous batching): the killed worker leaves several
        # prompts to reclaim, and every version swap drains groups in flight first.
        "rollout": {
            "reclaim_idle_s": 2.0,
            "heartbeat_s": 0.5,
            "heartbeat_ttl_s": 3.0,
            "read_block_ms": 200,
            "max_inflight_groups": 3,
            "max_batch": 8,
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", *args],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def _lines(path: Path) -> list[dict]:
    """Complete lines only: the trainer may be writing the last one right now."""
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(ln) for ln in complete if ln.strip()]


def _wait(cond, what: str, timeout_s: float, procs=()) -> None:
    """Wait for cond(); fail at once if a process died or exited (an exited trainer makes no more
    progress), else after timeout_s (a hang detector: generous, since it costs nothing when the run
    is healthy and three cold torch processes on a loaded 2-core box start slowly)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            assert p.poll() is None, f"a process exited ({p.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.2)


def _inject(redis_url: str, run_id: str, fingerprint: str, version: int, tag: str) -> None:
    async def main():
        r = connect(redis_url)
        try:
            stream = TrajectoryStream(r, Keys(run_id=run_id))
            await stream.add(
                [
                    Trajectory(
                        sample_id=f"{tag}/0",
                        prompt_id=tag,
                        group_id=tag,
                        sample_index=0,
                        group_size=4,
                        prompt_tokens=np.array([1, 4, 5], dtype=np.int32),
                        completion_tokens=np.array([6, 2], dtype=np.int32),
                        behavior_logprobs=np.array([-0.5, -0.1], dtype=np.float32),
                        reward=1.0,
                        policy_version=version,
                        contract_fingerprint=fingerprint,
                        worker_id="injector",
                        created_at=time.time(),
                    )
                ]
            )
        finally:
            await r.aclose()

    run_async(main())


def _all_trajectories(redis_url: str, run_id: str) -> list[Trajectory]:
    async def main():
        r = connect(redis_url)
        try:
            entries = await r.xrange(Keys(run_id=run_id).trajectories)
        finally:
            await r.aclose()
        return [decode_trajectory(fields[DATA_FIELD]) for _, fields in entries]

    return run_async(main())


def test_async_loop_with_faults(tmp_path, redis_url, run_id):
    cfg = _config(tmp_path, run_id, redis_url)
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    logs.mkdir()
    trainer_args = ["trainer", "--config", str(cfg), "--run-dir", str(run_dir)]
    trainer = _spawn(trainer_args, logs / "trainer.log")
    workers = {w: _spawn(["rollout", "--config", str(cfg), "--worker-id", w], logs / f"{w}.log") for w in ("w0", "w1")}
    procs = [trainer, *workers.values()]
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait(lambda: len(_lines(metrics)) >= 1, "the first step", 300, procs)

        # A dead worker: the survivor reclaims its prompts and the run goes on.
        workers["w1"].send_signal(signal.SIGKILL)
        workers["w1"].wait()
        _wait(lambda: len(_lines(metrics)) >= 3, "step 3 with one worker", 240, [trainer, workers["w0"]])

        # Bad samples: one too stale, one from another contract. Committed entries get trimmed, and
        # right after a commit none may be left: look until some are there.
        seen: list[Trajectory] = []
        _wait(lambda: seen.extend(_all_trajectories(redis_url, run_id)) or seen, "trajectories", 240, [trainer])
        fingerprint = seen[0].contract_fingerprint
        _inject(redis_url, run_id, fingerprint, version=1, tag="stale-injected")
        _inject(redis_url, run_id, "f" * 64, version=_lines(metrics)[-1]["policy_version"], tag="foreign-injected")
        _wait(
            lambda: _lines(metrics)[-1]["dropped_fingerprint"] >= 1 and _lines(metrics)[-1]["dropped_stale"] >= 1,
            "the injected samples to be dropped",
            240,
            [trainer, workers["w0"]],
        )

        # A crashed trainer: killed without warning, restarted on the same run folder.
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        steps_before = len(_lines(metrics))
        trainer = _spawn(trainer_args, logs / "trainer.log")
        assert trainer.wait(timeout=180) == 0, (logs / "trainer.log").read_text()[-3000:]
    finally:
        for p in [trainer, *workers.values()]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [trainer, *workers.values()]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    log = (logs / "trainer.log").read_text()
    assert "resumed from" in log
    # Versions reach the surviving worker as deltas against the one it holds (trainer.policy_deltas),
    # none refused; the restarted trainer's first version comes whole (its server knows no parent).
    w0 = (logs / "w0.log").read_text()
    assert "delta against v" in w0 and "fetched it whole" not in w0, w0[-3000:]
    rows = _lines(metrics)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "each step exactly once after the restart"
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0] >= 2
    assert rows[-1]["dropped_stale"] >= 1 and rows[-1]["dropped_fingerprint"] >= 1
    assert steps_before >= 3
    # Publishing runs off the step: each step logs how long it waited for the previous publish.
    assert all(r["publish_blocked_s"] >= 0 for r in rows)
    assert all(0 <= r["quantize_s"] <= r["publish_s"] for r in rows)  # the same publish's part

    # No sample used twice, across the restart and the dead worker's reclaimed prompts.
    audit = _lines(run_dir / "audit.jsonl")
    used = [g[0] for line in audit for g in line["groups"]]
    assert [a["step"] for a in audit] == list(range(1, MAX_STEPS + 1))
    assert len(used) == len(set(used)) == MAX_STEPS * 2
    assert not {"stale-injected", "foreign-injected"} & set(used)
    # Every sample carries a version and the run's fingerprint.
    assert seen and all(t.policy_version >= 1 and t.contract_fingerprint == fingerprint for t in seen)
    assert all(g[1] >= 1 for line in audit for g in line["groups"])
    # The surviving worker kept producing after its peer died (at step 1).
    assert "w0" in {g[2] for line in audit[2:] for g in line["groups"]}
