"""Fault scenarios against real processes (issue 13): random SIGKILLs of workers and the trainer,
SIGKILLs of the trainer pinned mid-checkpoint and between checkpoint and commit, Redis restarts with
AOF, a Redis wiped clean (mid-run and between resumes), a worker partitioned from Redis and the
trainer, a slow consumer, a policy fetch stalled mid-stream (tests/faults/proxy.py), poison
trajectories injected live. Each ends with the exactly-once audit of tests/faults/harness.py: no fed prompt
lost, no group trained twice, nothing trained that the trainer did not feed."""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import time
from collections.abc import Callable

import numpy as np
import pytest
import redis
from harness import TRIALS, Run, audit, checkpoint_state, config, lines, report, trained_by
from proxy import Proxy
from restartable_redis import RestartableRedis

from broker.codec import Trajectory, decode_prompt_group
from broker.keys import Keys
from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.signing import load_signer
from broker.streams import DATA_FIELD, TrajectoryStream, add_entries, connect, read_deadletter
from policy import manifest as mf

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]


@pytest.fixture
def redis_server(tmp_path, request):
    server = RestartableRedis(tmp_path / "redis", appendfsync=getattr(request, "param", None))
    server.start()
    yield server
    server.stop(kill=True)


def _start(tmp_path, run_id, url, *, max_steps, workers=("w0", "w1"), **trainer) -> Run:
    run = Run(tmp_path, config(tmp_path, run_id, url, max_steps=max_steps, **trainer))
    run.start_trainer()
    for w in workers:
        run.start_worker(w)
    return run


def test_random_sigkills_of_workers_and_trainer(tmp_path, redis_server, run_id):
    """FAULT_TRIALS kills, each of a random worker, the trainer, or both, at a random moment; the
    killed ones restart on the same names and run folder."""
    rng = random.Random(int(time.time()))
    max_steps = 6 + 4 * TRIALS
    run = _start(tmp_path, run_id, redis_server.url, max_steps=max_steps)
    recovery, kinds = [], []
    try:
        run.wait_steps(1)
        for trial in range(TRIALS):
            run.wait_steps(1 + 4 * trial)  # spread over the run, whatever the machine's speed
            kind = rng.choice(["worker", "trainer", "both"])
            step_s = lines(run.run_dir / "metrics.jsonl")[-1]["step_time_s"]
            time.sleep(rng.uniform(0.0, 2 * step_s))  # anywhere in a step: collect, train, checkpoint, commit
            if run.steps() >= max_steps - 1:
                break  # no step left to recover into
            t_fault = time.time()
            if kind in ("worker", "both"):
                w = rng.choice(sorted(run.workers))
                run.kill(run.workers[w])
                run.start_worker(w)
            if kind in ("trainer", "both"):
                run.kill(run.trainer)
                run.start_trainer()
            kinds.append(kind)
            recovery.append(run.wait_step_after(t_fault))
        assert run.wait_trainer() == 0, run.log_tail("trainer")
    finally:
        run.close()
    figures = audit(run.run_dir, max_steps)
    assert kinds, "no fault was injected"
    report("random_sigkill", trials=len(kinds), faults=kinds, recovery_s_p50=statistics.median(recovery),
           recovery_s_max=max(recovery), **figures)  # fmt: skip


@pytest.mark.parametrize("redis_server", ["everysec", "always"], indirect=True)
def test_redis_restart_with_aof(tmp_path, redis_server, run_id):
    """Redis SIGKILLed twice mid-run and restarted from its AOF: every service rides it out."""
    max_steps = 5
    run = _start(tmp_path, run_id, redis_server.url, max_steps=max_steps)
    recovery = []
    try:
        for at in (1, 3):
            run.wait_steps(at)
            t_fault = time.time()
            redis_server.stop(kill=True)
            time.sleep(1.0)  # down for 1 s
            redis_server.start()
            recovery.append(run.wait_step_after(t_fault))
        assert run.wait_trainer() == 0, run.log_tail("trainer")
        for w, p in run.workers.items():
            assert p.poll() is None, f"{w} died: {run.log_tail(w)}"
    finally:
        run.close()
    assert "back after" in run.log_tail("trainer", 100_000)
    figures = audit(run.run_dir, max_steps)
    report(f"redis_restart_aof_{redis_server.appendfsync}", faults=2, recovery_s_p50=statistics.median(recovery),
           recovery_s_max=max(recovery), **figures)  # fmt: skip


def test_redis_wiped_mid_run_and_between_resumes(tmp_path, redis_server, run_id):
    """Defect 9: a private Redis without persistence loses everything, once while the trainer runs
    and once between two resumes; the checkpoint alone keeps prompts from being trained twice."""
    run = _start(tmp_path, run_id, redis_server.url, max_steps=2, prompts_ahead=6)  # prompts queued at each wipe
    recovery = []
    try:
        assert run.wait_trainer() == 0, run.log_tail("trainer")
        redis_server.wipe()  # between resumes, the workers still running
        redis_server.start()
        run.start_trainer("trainer.max_steps=6")
        run.wait_steps(4)
        t_fault = time.time()
        redis_server.wipe()  # mid-run
        redis_server.start()
        recovery.append(run.wait_step_after(t_fault))
        assert run.wait_trainer() == 0, run.log_tail("trainer")
    finally:
        run.close()
    figures = audit(run.run_dir, 6)
    assert figures["refed"] > 0, "the lost prompts were fed again"
    report("redis_wiped", faults=2, recovery_s_p50=statistics.median(recovery), recovery_s_max=max(recovery),
           **figures)  # fmt: skip


def _poison(url: str, run_id: str, secret_file: str) -> tuple[int, str]:
    """Inject, for a fed prompt no worker has read yet, one sample per crash input of defect 3 and a
    forged group for a prompt never fed (all signed: a compromised worker), plus one undecodable
    entry and one unsigned copy of a good sample. Returns (invalid samples, the poisoned group)."""

    async def main() -> tuple[int, str]:
        r = connect(url)
        keys = Keys(run_id=run_id)
        try:
            # A prompt no worker has read yet (none runs yet): its real samples arrive after the poison.
            deadline = time.monotonic() + 120
            while not (await r.exists(keys.policy_latest) and await r.xlen(keys.prompts)):
                assert time.monotonic() < deadline, "the trainer published nothing and fed no prompt"
                await asyncio.sleep(0.2)
            (_, fields), = await r.xrange(keys.prompts, count=1)  # fmt: skip
            group = decode_prompt_group(fields[DATA_FIELD])
            version = int(await r.hget(keys.policy_latest, "version"))
            base = dict(
                prompt_id=group.prompt_id, group_id=group.group_id, group_size=group.n_samples,
                prompt_tokens=group.prompt_tokens, completion_tokens=np.array([5, 2], dtype=np.int32),
                behavior_logprobs=np.array([-0.5, -0.1], dtype=np.float32), reward=1.0, policy_version=version,
                contract_fingerprint=(await r.hget(keys.policy_latest, "contract_fingerprint")).decode(),
                worker_id="evil", created_at=time.time(),
            )  # fmt: skip

            def t(i: int, **changes) -> Trajectory:
                kw = {**base, "sample_id": f"{group.group_id}/{i}", "sample_index": i, **changes}
                return Trajectory(**kw)

            bad = [
                t(0, group_size=1),
                t(1, completion_tokens=np.array([5, 10_000], dtype=np.int32)),
                t(2, reward=1e300),
                t(3, completion_tokens=np.full(2000, 5, np.int32), behavior_logprobs=np.full(2000, -1.0, np.float32)),
                t(0, group_id="p999999", prompt_id="p999999", sample_id="p999999/0"),
            ]
            signer = load_signer(secret_file)
            await TrajectoryStream(r, keys, signer=signer).add(bad)
            await add_entries(r, keys.trajectories, [b"\x93not msgpack"], signer)
            await TrajectoryStream(r, keys).add([t(3)])  # unsigned: whoever can write Redis
            return len(bad), group.group_id
        finally:
            await r.aclose()

    return asyncio.run(main())


def test_poison_trajectories_injected_live(tmp_path, redis_server, run_id):
    """Defect 3: every invalid sample is dead-lettered alone with its reason and counted; the step
    never fails; no legitimate sample is dead-lettered; the real group of the poisoned prompt trains."""
    max_steps = 4
    run = _start(tmp_path, run_id, redis_server.url, max_steps=max_steps, workers=())
    try:
        n_bad, poisoned = _poison(redis_server.url, run_id, str(tmp_path / "run.secret"))
        time.sleep(1.5)  # the trainer reads them (it polls every 0.5 s), then the workers start
        for w in ("w0", "w1"):
            run.start_worker(w)
        assert run.wait_trainer() == 0, run.log_tail("trainer")
    finally:
        run.close()
    figures = audit(run.run_dir, max_steps)
    state = checkpoint_state(run.run_dir)
    assert (state["invalid"], state["malformed"], state["unsigned"]) == (n_bad, 1, 1), state
    last = lines(run.run_dir / "metrics.jsonl")[-1]
    assert (last["invalid"], last["malformed"], last["unsigned"]) == (n_bad, 1, 1)

    async def deadletters():
        r = connect(redis_server.url)
        try:
            return await read_deadletter(r, Keys(run_id=run_id), count=1000)
        finally:
            await r.aclose()

    dead = asyncio.run(deadletters())
    reasons = [d.reason for d in dead]
    assert len(dead) == n_bad + 2, reasons  # each alone: not one legitimate sample among them
    for want in ("group_size=1", "vocab is", "reward=1e+300", "2000 completion tokens", "no prompt this trainer fed",
                 "decode", "unsigned"):  # fmt: skip
        assert sum(want in r for r in reasons) == 1, (want, reasons)
    # The poisoned prompt's real group still trained (the forged copies did not shadow it).
    trained = {g[0] for r in lines(run.run_dir / "audit.jsonl") for g in r["groups"]}
    assert poisoned in trained or poisoned in state["outstanding"], poisoned
    report("poison", faults=n_bad + 2, **figures)


def _sample_backlog(run: Run, redis_port: int, run_id: str, until: Callable[[], bool], timeout_s: float) -> int:
    """Poll (every 0.2 s) fed - settled prompt groups, from Redis's prompt_seq marker and the audit,
    until `until()`; the peak."""
    r = redis.Redis(port=redis_port, socket_timeout=2.0)
    peak, t0 = 0, time.monotonic()
    try:
        while not until():
            assert time.monotonic() - t0 < timeout_s, f"timed out:\n{run.log_tail('trainer')}"
            raw = r.get(Keys(run_id=run_id).prefix + "prompt_seq")
            rows = lines(run.run_dir / "audit.jsonl")
            settled = sum(len(x["groups"]) + len(x.get("dropped", [])) for x in rows)
            peak = max(peak, int(raw or 0) - settled)
            time.sleep(0.2)
    finally:
        r.close()
    return peak


def _until_trained_by(run: Run, worker_id: str, after_step: int, timeout_s: float = 180.0) -> float:
    """Wait until a step after `after_step` trained a group of `worker_id`; the seconds it took."""
    t0 = time.monotonic()
    while not [s for s in trained_by(run.run_dir, worker_id) if s > after_step]:
        for name, p in [("trainer", run.trainer), *run.workers.items()]:
            assert p.poll() is None, f"{name} exited {p.returncode}:\n{run.log_tail(name)}"
        assert time.monotonic() - t0 < timeout_s, f"{worker_id} never came back:\n{run.log_tail(worker_id)}"
        time.sleep(0.2)
    return time.monotonic() - t0


def _stop_trainer(run: Run) -> int:
    """SIGTERM (a graceful stop: checkpoint and commit), then the steps it took."""
    run.trainer.send_signal(signal.SIGTERM)
    assert run.wait_trainer() == 0, run.log_tail("trainer")
    return run.steps()


PARTITION_S = 6.0  # longer than the heartbeat TTL (3 s) + the reclaim idle time (2 s) of harness.config


def test_partition_then_a_stalled_policy_fetch(tmp_path, redis_server, run_id, free_port):
    """w1 reaches Redis and the trainer only through proxies (one run, two faults, to save CI time).
    1. A partition: both go dark until the run has gone on without w1 (at least PARTITION_S), then
       heal. w0 reclaims what w1 held; w1 rides the outage out and trains again.
    2. A stall: replies stop halfway through w1's next policy fetch; the fetch times out
       (rollout.fetch_timeout_s) or a newer version's fetch supersedes it, w1 fetches again on a
       new connection and trains again.
    w1 fetches in its fetch child (rollout.fetch_process), w0 in process. Nothing is lost or trained twice."""
    grpc_port = free_port()
    to_redis = Proxy(("127.0.0.1", redis_server.port)).start()
    to_trainer = Proxy(("127.0.0.1", grpc_port)).start()
    run = Run(tmp_path, config(tmp_path, run_id, redis_server.url, max_steps=1000, grpc_port=grpc_port))
    try:
        run.start_trainer()
        run.start_worker("w0")
        run.start_worker("w1", f"redis_url={to_redis.url()}/0", f"rollout.policy_address={to_trainer.address}",
                         "rollout.fetch_timeout_s=4", "rollout.fetch_process=true")  # fmt: skip
        _until_trained_by(run, "w1", 0)
        t_fault = time.time()
        to_redis.blackhole()
        to_trainer.blackhole()
        time.sleep(PARTITION_S)
        carried_on = run.wait_step_after(t_fault + PARTITION_S)  # w0 alone, w1 still cut off
        step_at_heal = run.steps()
        to_redis.heal()
        to_trainer.heal()
        rejoin = _until_trained_by(run, "w1", step_at_heal)

        token = load_signer(str(tmp_path / "run.secret")).policy_token()  # the trainer serves workers only
        with PolicyClient(PolicyClientConfig(address=f"127.0.0.1:{grpc_port}", run_token=token)) as c:
            m = c.get_manifest()
        to_trainer.stall_after(len(mf.manifest_to_bytes(m)) + m.total_bytes // 2)  # the next fetch, mid-stream
        deadline = time.monotonic() + 120
        while not to_trainer.stalled_connections:
            assert time.monotonic() < deadline, f"no fetch went through the proxy:\n{run.log_tail('w1')}"
            time.sleep(0.1)
        after_stall = _until_trained_by(run, "w1", run.steps())
        steps = _stop_trainer(run)
        assert run.workers["w1"].poll() is None, run.log_tail("w1")
    finally:
        run.close()
        to_redis.close()
        to_trainer.close()
    # The stalled fetch ends by its deadline, or earlier when a newer version supersedes it.
    log = run.log_tail("w1", 100_000)
    assert "failed, will retry" in log or "superseded" in log, run.log_tail("w1")
    figures = audit(run.run_dir, steps, stopped=True)
    report("partition", faults=1, partition_s=round(PARTITION_S + carried_on, 1), recovery_s_p50=rejoin,
           recovery_s_max=rejoin, **figures)  # fmt: skip
    report("stalled_fetch", faults=1, recovery_s_p50=after_stall, recovery_s_max=after_stall, **figures)


def test_slow_consumer(tmp_path, redis_server, run_id):
    """The trainer's link to Redis slowed (every chunk 100 ms late) for 4 steps, then restored: the
    workers run ahead only as far as the backlog bound lets them, and nothing is lost or doubled."""
    max_steps = 8
    link = Proxy(("127.0.0.1", redis_server.port)).start()
    cfg = config(tmp_path, run_id, redis_server.url, max_steps=max_steps)
    run = Run(tmp_path, cfg)
    bound = 2 * 2 + 2  # queued_groups (groups_per_step 2 x max_staleness 1) + the step being trained + a surplus
    try:
        run.start_trainer(f"redis_url={link.url()}/0")
        for w in ("w0", "w1"):
            run.start_worker(w)
        run.wait_steps(2)
        link.delay_s = 0.1
        t_slow = time.time()
        peak = _sample_backlog(run, redis_server.port, run_id, lambda: run.steps() >= 6, timeout_s=240)
        slow_s = (time.time() - t_slow) / 4
        link.delay_s = 0.0
        assert run.wait_trainer() == 0, run.log_tail("trainer")
    finally:
        run.close()
        link.close()
    figures = audit(run.run_dir, max_steps)
    assert peak <= bound, f"{peak} prompt groups fed and not settled while the trainer was slow (bound {bound})"
    report("slow_consumer", faults=1, backlog_peak=peak, slow_step_s=round(slow_s, 2), **figures)


def test_trainer_killed_mid_checkpoint_and_before_commit(tmp_path, redis_server, run_id):
    """SIGKILL pinned (trainer/service.fault_point): at step 2 with the checkpoint's temporary file
    written but not renamed, then at step 4 with the checkpoint durable and its samples not committed.
    Each resume is from the right checkpoint, and the run is exactly-once."""
    max_steps = 5
    run = Run(tmp_path, config(tmp_path, run_id, redis_server.url, max_steps=max_steps, checkpoint_every=1))
    ckpts = run.run_dir / "checkpoints"
    recovery = []
    try:
        run.start_trainer(env={"TANDEM_FAULT_POINT": "mid_checkpoint@2"})
        for w in ("w0", "w1"):
            run.start_worker(w)
        assert run.wait_trainer() == -signal.SIGKILL, run.log_tail("trainer")
        assert (ckpts / "step-000002.pt.tmp").exists() and not (ckpts / "step-000002.pt").exists()
        for point, resumed_at in (("before_commit@4", 1), (None, 4)):
            t_fault = time.time()
            run.start_trainer(env={"TANDEM_FAULT_POINT": point} if point else None)
            if point:
                assert run.wait_trainer() == -signal.SIGKILL, run.log_tail("trainer")
                assert (ckpts / "step-000004.pt").exists()
            else:
                assert run.wait_trainer() == 0, run.log_tail("trainer")
            assert f"step-{resumed_at:06d}.pt: step {resumed_at}," in run.log_tail("trainer", 100_000)
            recovery.append(max(0.0, min(m["time"] for m in lines(run.run_dir / "metrics.jsonl")
                                         if m["step"] == resumed_at + 1) - t_fault))  # fmt: skip
    finally:
        run.close()
    figures = audit(run.run_dir, max_steps)
    report("pinned_trainer_kills", faults=2, recovery_s_p50=statistics.median(recovery),
           recovery_s_max=max(recovery), **figures)  # fmt: skip
