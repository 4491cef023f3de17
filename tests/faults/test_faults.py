"""Fault scenarios against real processes: random SIGKILLs of workers and the trainer,
SIGKILLs of the trainer pinned mid-checkpoint and between checkpoint and commit, Redis restarts with
AOF, a Redis wiped clean (mid-run and between resumes), a worker partitioned from Redis and the
trainer, a slow consumer, a policy fetch stalled mid-stream (tests/faults/proxy.py), poison
trajectories and poison prompts injected live. Each ends with the exactly-once audit of
tests/faults/harness.py: no fed prompt lost, no group trained twice, nothing trained that the
trainer did not feed."""

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

from broker.codec import PromptGroup, Trajectory, decode_prompt_group
from broker.keys import Keys
from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.registry import Heartbeats
from broker.signing import PROMPT, load_signer
from broker.streams import DATA_FIELD, PromptQueue, TrajectoryStream, add_entries, connect, read_deadletter
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
    """A private Redis without persistence loses everything, once between two resumes (the
    workers running), then twice while the trainer and the workers run: restarted with no data, and
    FLUSHALL. The checkpoint alone keeps prompts from being lost or trained twice; no worker exits;
    every loss is seen (a retried write cannot hide it) and the backlog stays within its bound."""
    max_steps, ahead = 10, 6  # prompts queued at each wipe
    run = _start(tmp_path, run_id, redis_server.url, max_steps=2, prompts_ahead=ahead)
    recovery = []
    try:
        assert run.wait_trainer() == 0, run.log_tail("trainer")
        redis_server.wipe()  # between resumes, the workers still running
        redis_server.start()
        run.start_trainer(f"trainer.max_steps={max_steps}")
        run.wait_steps(4)
        redis_server.wipe()  # mid-run: restarted without its data
        redis_server.start()
        t_fault = time.time()  # Redis is back, empty: the trainer's next feed round must see the loss
        _wait_for_line(run, "trainer", "Redis lost its data", 2)
        recovery.append(run.wait_step_after(t_fault))
        # Then FLUSHALL with the workers stopped: nobody makes the prompts group again, so the trainer's
        # feed rounds find none for a while.
        for p in run.workers.values():
            p.send_signal(signal.SIGSTOP)
        try:
            with redis.Redis(port=redis_server.port, socket_timeout=5.0) as r:
                r.flushall()  # mid-run: emptied without a restart (no connection drops)
            _wait_for_line(run, "trainer", "Redis lost its data", 3)
            time.sleep(1.5)  # three more feed rounds (a 0.5 s read each) without a prompts group
        finally:
            for p in run.workers.values():
                p.send_signal(signal.SIGCONT)
        t_fault = time.time()
        recovery.append(run.wait_step_after(t_fault))
        assert run.wait_trainer() == 0, run.log_tail("trainer")
        for w, p in run.workers.items():
            assert p.poll() is None, f"{w} exited {p.returncode}:\n{run.log_tail(w)}"
    finally:
        run.close()
    figures = audit(run.run_dir, max_steps)
    assert figures["refed"] > 0, "the lost prompts were fed again"
    # Fed and not settled after each step (the step's own groups settled): within the bound. An empty
    # Redis once read as room for the whole bound again (~60 outstanding with the workers dead).
    peak = max(m["outstanding_groups"] for m in lines(run.run_dir / "metrics.jsonl"))
    assert peak <= ahead, f"{peak} groups outstanding after a step (bound {ahead})"
    report("redis_wiped", faults=3, recovery_s_p50=statistics.median(recovery), recovery_s_max=max(recovery),
           backlog_peak=peak, **figures)  # fmt: skip


def _wait_for_line(run: Run, name: str, text: str, count: int, timeout_s: float = 120.0) -> None:
    """Wait until `name`'s log has `count` lines containing `text`; fails if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while run.log_tail(name, 1 << 20).count(text) < count:
        proc = run.trainer if name == "trainer" else run.workers[name]
        assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{run.log_tail(name)}"
        assert time.monotonic() < deadline, f"{count} x {text!r} not in {name}'s log:\n{run.log_tail(name)}"
        time.sleep(0.1)


def _poison(url: str, run_id: str, secret_file: str) -> tuple[int, str]:
    """Inject, for a fed prompt no worker has read yet, one sample per malformed case of
    test_poison_trajectories_injected_live and a
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
    """Every invalid sample is dead-lettered alone with its reason and counted; the step
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
    dead = asyncio.run(_deadletters(redis_server.url, run_id))
    reasons = [d.reason for d in dead]
    assert len(dead) == n_bad + 2, reasons  # each alone: not one legitimate sample among them
    for want in ("group_size=1", "vocab is", "reward=1e+300", "2000 completion tokens", "no prompt this trainer fed",
                 "decode", "unsigned"):  # fmt: skip
        assert sum(want in r for r in reasons) == 1, (want, reasons)
    # The poisoned prompt's real group still trained (the forged copies did not shadow it).
    trained = {g[0] for r in lines(run.run_dir / "audit.jsonl") for g in r["groups"]}
    assert poisoned in trained or poisoned in state["outstanding"], poisoned
    report("poison", faults=n_bad + 2, **figures)


def _poison_prompts(url: str, run_id: str, secret_file: str) -> dict[str, str]:
    """The prompt poisoner: XADDs to the prompts stream an unsigned prompt and, with the run secret
    (a compromised producer), garbage bytes, prompts with task={}, a token id >= vocab, more tokens
    than max_seq_len, n_samples=4096, and a copy of a fed prompt (its group id) with task={}; then
    takes a fed prompt as three consumers that all "die" holding it (a poison pill's delivery count).
    Returns {what: group id} of the forged copy's and the stolen prompt's."""

    async def main() -> dict[str, str]:
        r = connect(url)
        keys = Keys(run_id=run_id)
        try:
            deadline = time.monotonic() + 120
            while not (await r.exists(keys.policy_latest) and await r.xlen(keys.prompts) >= 2):
                assert time.monotonic() < deadline, "the trainer published nothing and fed no prompt"
                await asyncio.sleep(0.2)
            [(_, first), (_, second)] = await r.xrange(keys.prompts, count=2)
            fed, copied = decode_prompt_group(first[DATA_FIELD]), decode_prompt_group(second[DATA_FIELD])

            def evil(name: str, **changes) -> PromptGroup:
                kw = dict(prompt_id=name, group_id=name, prompt_tokens=fed.prompt_tokens, n_samples=fed.n_samples,
                          task=fed.task)  # fmt: skip
                return PromptGroup(**{**kw, **changes})

            signer = load_signer(secret_file)
            await PromptQueue(r, keys).add([evil("evil-unsigned")])
            await add_entries(r, keys.prompts, [b"\x93not msgpack"], signer, PROMPT)
            await PromptQueue(r, keys, signer=signer).add(
                [
                    evil("evil-task", task={}),
                    evil("evil-vocab", prompt_tokens=np.array([1, 10_000], dtype=np.int32)),
                    evil("evil-long", prompt_tokens=np.full(1100, 5, np.int32)),
                    evil("evil-n", n_samples=4096),
                    evil(copied.group_id, prompt_id=copied.prompt_id, prompt_tokens=copied.prompt_tokens, task={}),
                ]
            )
            # A fed prompt, delivered to three consumers in turn, each of which dies holding it.
            [[_, [(sid, _)]]] = await r.xreadgroup("rollout", "ghost0", {keys.prompts: ">"}, count=1)
            for ghost in ("ghost1", "ghost2"):
                await r.xclaim(keys.prompts, "rollout", ghost, 0, [sid])
            [(_, stolen)] = await r.xrange(keys.prompts, min=sid, max=sid)
            return {"copied": copied.group_id, "stolen": decode_prompt_group(stolen[DATA_FIELD]).group_id}
        finally:
            await r.aclose()

    return asyncio.run(main())


def test_poison_prompts_injected_live(tmp_path, redis_server, run_id):
    """Every poison prompt is dead-lettered exactly once with its reason, and counted; no worker exits;
    the stolen prompt (4th delivery) is dead-lettered on reclaim and the trainer settles it as dropped;
    the forged copy of a fed group id does not settle the real one; 0 lost, 0 doubled."""
    max_steps = 4
    run = _start(tmp_path, run_id, redis_server.url, max_steps=max_steps, workers=())
    try:
        ids = _poison_prompts(redis_server.url, run_id, str(tmp_path / "run.secret"))
        time.sleep(2.5)  # the stolen prompt idles past rollout.reclaim_idle_s (2 s) before a worker looks
        for w in ("w0", "w1"):
            run.start_worker(w)
        assert run.wait_trainer() == 0, run.log_tail("trainer")
        assert all(p.poll() is None for p in run.workers.values()), [run.log_tail(w) for w in run.workers]
        refused = asyncio.run(_refused_prompts(redis_server.url, run_id, want=8))
    finally:
        run.close()
    figures = audit(run.run_dir, max_steps)
    state = checkpoint_state(run.run_dir)
    dead = asyncio.run(_deadletters(redis_server.url, run_id))
    reasons = sorted(d.reason for d in dead if d.source.endswith(":prompts"))
    assert len({d.source_id for d in dead if d.source.endswith(":prompts")}) == len(reasons) == 8, reasons
    for want, n in (("unsigned", 1), ("decode", 1), ("task fields", 2), ("vocab is", 1), ("new > max_seq_len", 1),
                    ("n_samples=4096", 1), ("delivered 4 times", 1)):  # fmt: skip
        assert sum(want in r for r in reasons) == n, (want, reasons)
    assert refused == 8  # the workers' heartbeats
    dropped = {g for r in lines(run.run_dir / "audit.jsonl") for g in r["dropped"]}
    trained = {g[0] for r in lines(run.run_dir / "audit.jsonl") for g in r["groups"]}
    assert ids["stolen"] in dropped and state["prompts_dead_lettered"] == 1
    assert lines(run.run_dir / "metrics.jsonl")[-1]["prompts_dead_lettered"] == 1
    assert ids["copied"] in trained | set(state["outstanding"]), ids
    report("poison_prompts", faults=8, **figures)


async def _deadletters(url: str, run_id: str) -> list:
    r = connect(url)
    try:
        return await read_deadletter(r, Keys(run_id=run_id), count=1000)
    finally:
        await r.aclose()


async def _refused_prompts(url: str, run_id: str, *, want: int, timeout_s: float = 30.0) -> int:
    """The prompts the live workers say (heartbeat info) they refused, once that reaches `want`."""
    r = connect(url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            live = await Heartbeats(r, Keys(run_id=run_id)).live(role="rollout")
            n = sum(b["info"].get("refused_prompts", 0) for b in live.values())
            if n >= want or time.monotonic() > deadline:
                return n
            await asyncio.sleep(0.2)
    finally:
        await r.aclose()


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
    """SIGKILL pinned (tests/faults/kill_points.py): at step 2 with the checkpoint's temporary file
    written but not renamed, then at step 4 with the checkpoint durable and its samples not committed.
    Each resume is from the right checkpoint, and the run is exactly-once."""
    max_steps = 5
    run = Run(tmp_path, config(tmp_path, run_id, redis_server.url, max_steps=max_steps, checkpoint_every=1))
    ckpts = run.run_dir / "checkpoints"
    recovery = []
    try:
        run.start_trainer(kill_at="mid_checkpoint@2")
        for w in ("w0", "w1"):
            run.start_worker(w)
        assert run.wait_trainer() == -signal.SIGKILL, run.log_tail("trainer")
        assert (ckpts / "step-000002.pt.tmp").exists() and not (ckpts / "step-000002.pt").exists()
        for point, resumed_at in (("before_commit@4", 1), (None, 4)):
            t_fault = time.time()
            run.start_trainer(kill_at=point)
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
