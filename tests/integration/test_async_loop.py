"""The asynchronous loop end to end: a real redis-server, the trainer and two rollout workers as
separate processes talking gRPC and Redis, as `tandem run` starts them.

Each worker keeps three prompt groups in flight (continuous batching). One run exercises the fault
paths in order: a rollout worker is SIGKILLed (the other finishes its
prompts), a stale and a wrong-fingerprint trajectory are injected (dropped and counted), and the
trainer is SIGKILLed and restarted (it resumes from its checkpoint and uses no sample twice).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
from loop_run import Loop, all_trajectories, lines, tiny_config, wait

from broker.codec import Trajectory
from broker.keys import Keys
from broker.streams import TrajectoryStream, connect, run_async

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 10  # steps left after step 3 for the injected samples to be read and counted, even under load


def _config(tmp: Path, run_id: str, redis_url: str) -> Path:
    return tiny_config(
        tmp, run_id, redis_url,
        task={"digits": 1},
        # checkpoint_every 2: a restart redoes the steps since the last even one.
        trainer={"max_steps": MAX_STEPS, "warmstart_steps": 5, "checkpoint_every": 2},
        # Three groups in flight per worker (continuous batching): the killed worker leaves several
        # prompts to reclaim, and every version swap drains groups in flight first.
        rollout={"reclaim_idle_s": 2.0, "heartbeat_s": 0.5, "heartbeat_ttl_s": 3.0, "max_inflight_groups": 3,
                 "max_batch": 8},
    )  # fmt: skip


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


def test_async_loop_with_faults(tmp_path, redis_url, run_id):
    with Loop(_config(tmp_path, run_id, redis_url), tmp_path) as run:
        workers = run.workers
        metrics = run.run_dir / "metrics.jsonl"
        wait(lambda: len(lines(metrics)) >= 1, "the first step", 300, [run.trainer, *workers.values()])

        # A dead worker: the survivor reclaims its prompts and the run goes on.
        workers["w1"].send_signal(signal.SIGKILL)
        workers["w1"].wait()
        wait(lambda: len(lines(metrics)) >= 3, "step 3 with one worker", 240, [run.trainer, workers["w0"]])

        # Bad samples: one too stale, one from another contract. Committed entries get trimmed, and
        # right after a commit none may be left: look until some are there.
        seen: list[Trajectory] = []
        wait(lambda: seen.extend(all_trajectories(redis_url, run_id)) or seen, "trajectories", 240, [run.trainer])
        fingerprint = seen[0].contract_fingerprint
        _inject(redis_url, run_id, fingerprint, version=1, tag="stale-injected")
        _inject(redis_url, run_id, "f" * 64, version=lines(metrics)[-1]["policy_version"], tag="foreign-injected")
        wait(
            lambda: lines(metrics)[-1]["dropped_fingerprint"] >= 1 and lines(metrics)[-1]["dropped_stale"] >= 1,
            "the injected samples to be dropped",
            240,
            [run.trainer, workers["w0"]],
        )

        # A crashed trainer: killed without warning, restarted on the same run folder.
        run.trainer.send_signal(signal.SIGKILL)
        run.trainer.wait()
        steps_before = len(lines(metrics))
        run.restart_trainer()
        assert run.trainer.wait(timeout=180) == 0, run.log("trainer").read_text()[-3000:]

    log = run.log("trainer").read_text()
    assert "resumed from" in log
    # Versions reach the surviving worker as deltas against the one it holds (trainer.policy_deltas),
    # none refused; the restarted trainer's first version comes whole (its server knows no parent).
    w0 = run.log("w0").read_text()
    assert "delta against v" in w0 and "fetched it whole" not in w0, w0[-3000:]
    rows = lines(metrics)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "each step exactly once after the restart"
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0] >= 2
    assert rows[-1]["dropped_stale"] >= 1 and rows[-1]["dropped_fingerprint"] >= 1
    assert steps_before >= 3
    # Publishing runs off the step: each step logs how long it waited for the previous publish.
    assert all(r["publish_blocked_s"] >= 0 for r in rows)
    assert all(0 <= r["quantize_s"] <= r["publish_s"] for r in rows)  # the same publish's part

    # No sample used twice, across the restart and the dead worker's reclaimed prompts.
    audit = lines(run.run_dir / "audit.jsonl")
    used = [g[0] for line in audit for g in line["groups"]]
    assert [a["step"] for a in audit] == list(range(1, MAX_STEPS + 1))
    assert len(used) == len(set(used)) == MAX_STEPS * 2
    assert not {"stale-injected", "foreign-injected"} & set(used)
    # Every sample carries a version and the run's fingerprint.
    assert seen and all(t.policy_version >= 1 and t.contract_fingerprint == fingerprint for t in seen)
    assert all(g[1] >= 1 for line in audit for g in line["groups"])
    # The surviving worker kept producing after its peer died (at step 1).
    assert "w0" in {g[2] for line in audit[2:] for g in line["groups"]}
