"""Fault scenarios of the trainer's own resources, against real processes: its policy-server child
SIGKILLed during publishes (trainer.policy_server_process on the CPU), its checkpoint folder full
(a real ENOSPC: a small tmpfs mounted over it), and Redis gone past `redis_outage_s` (the trainer
and a worker each exit 3 with one line). Each run that trains ends with the exactly-once audit of
tests/faults/harness.py."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import Run, audit, config, lines, report
from restartable_redis import RestartableRedis

from trainer.checkpoints import latest_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]


@pytest.fixture
def redis_server(tmp_path):
    server = RestartableRedis(tmp_path / "redis")
    server.start()
    yield server
    server.stop(kill=True)


@contextlib.contextmanager
def _tmpfs(folder: Path, size: str):
    """A tmpfs of `size` mounted on `folder` (root only: skipped otherwise), unmounted at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.decode().strip()}")
    try:
        (folder / "filler").touch()  # for _fill
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder: Path) -> Path:
    """Fill the file system of `folder` to the last byte: a real ENOSPC for the next write there. The
    filler file exists from the mount on (`_tmpfs`): on a full tmpfs even creating a file fails."""
    filler = folder / "filler"
    try:
        with open(filler, "ab") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError as e:  # ENOSPC: full (at the open too, when the trainer's writes filled it first)
        assert e.errno == errno.ENOSPC, e
    return filler


def _wait_line(run: Run, pattern: str, after: int = 0, timeout_s: float = 120.0) -> re.Match:
    """The first match of `pattern` in the trainer's log past character `after`."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = re.compile(pattern).search(run.log_tail("trainer", 10**7), after)
        if m:
            return m
        assert run.trainer.poll() is None, f"trainer exited {run.trainer.returncode}:\n{run.log_tail('trainer')}"
        assert time.monotonic() < deadline, f"no {pattern!r} in {timeout_s}s:\n{run.log_tail('trainer')}"
        time.sleep(0.1)


def test_a_full_disk_during_checkpoints_keeps_the_previous_one_and_training_goes_on(tmp_path, redis_server, run_id):
    """checkpoints/ on a 4 MiB tmpfs, filled to the last byte twice. Each failed checkpoint leaves no
    temporary file, one line, and the previous checkpoint the newest (whole: it loads); training goes
    on, and once there is room the next checkpoint is written (its samples committed). Stopped
    (SIGTERM) while the disk is full, the trainer says that its final checkpoint was not written and
    exits 1; the resume (with a stale temporary file of a killed trainer in the folder) starts from
    the newest checkpoint and the run is exactly-once."""
    run = Run(tmp_path, config(tmp_path, run_id, redis_server.url, max_steps=10_000, checkpoint_every=1))
    ckpts = run.run_dir / "checkpoints"
    with _tmpfs(ckpts, "4m"):
        try:
            run.start_trainer()
            for w in ("w0", "w1"):
                run.start_worker(w)
            run.wait_steps(2)
            filler = _fill(ckpts)
            failed = _wait_line(run, r"checkpoint step-(\d+)\.pt not written \(No space left on device\); training on, "
                                     r"the newest checkpoint is step-(\d+)\.pt")  # fmt: skip
            again = _wait_line(run, r"checkpoint step-(\d+)\.pt not written", after=failed.end())
            assert int(again[1]) > int(failed[1])  # training went on, and the next checkpoint tried again
            # The failed checkpoints left no temporary file (removed before their line); with
            # checkpoint_every 1 the next step's checkpoint may be writing its own right now.
            stray = [p.name for p in ckpts.glob("*.tmp") if p.name <= f"step-{again[1]}.pt.tmp"]
            assert not stray, sorted(ckpts.iterdir())
            newest = latest_checkpoint(ckpts)
            assert newest.name == f"step-{failed[2]}.pt"
            assert torch.load(newest, map_location="cpu", weights_only=True)["state"]["step"] == int(failed[2])
            filler.write_bytes(b"")  # room again: the next checkpoint is written
            written = _wait_line(run, r"step +(\d+)/", after=again.end())
            deadline = time.monotonic() + 60
            while latest_checkpoint(ckpts).name <= f"step-{int(written[1]):06d}.pt":
                assert time.monotonic() < deadline, sorted(ckpts.iterdir())
                time.sleep(0.1)
            log_at = len(run.log_tail("trainer", 10**7))
            filler = _fill(ckpts)
            _wait_line(run, r"not written \(No space left on device\)", after=log_at)
            run.trainer.send_signal(signal.SIGTERM)
            assert run.wait_trainer() == 1, run.log_tail("trainer")
            end = re.search(
                r"exiting 1: the final checkpoint \(step (\d+)\) was not written; the newest checkpoint is "
                r"step (\d+), a restart resumes there",
                run.log_tail("trainer", 10**7),
            )
            assert end, run.log_tail("trainer")
            resume_at = int(end[2])
            assert latest_checkpoint(ckpts).name == f"step-{resume_at:06d}.pt" and not list(ckpts.glob("*.tmp"))
            filler.write_bytes(b"")
            (ckpts / f"step-{resume_at + 1:06d}.pt.tmp").write_bytes(b"cut short")  # a killed trainer's
            max_steps = resume_at + 3
            run.start_trainer(f"trainer.max_steps={max_steps}")
            assert run.wait_trainer() == 0, run.log_tail("trainer")
            assert f"step-{resume_at:06d}.pt: step {resume_at}," in run.log_tail("trainer", 10**7)
        finally:
            run.close()
        log = run.log_tail("trainer", 10**7)
        figures = audit(run.run_dir, max_steps)
    assert "Traceback" not in log, log[-3000:]
    report("disk_full_checkpoints", faults=2, resumed_from=resume_at, **figures)


def _child_of(pid: int, marker: bytes) -> int | None:
    """The pid of a live child process of `pid` whose command line holds `marker`, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
            if fields[0] != "Z" and int(fields[1]) == pid and marker in cmdline:
                return int(stat.parent.name)
    return None


SERVER_CHILD = b"broker.server_process"  # the trainer's policy-server child (broker/server_process.py)


def _newest_live(worker_log: Path) -> int:
    """The newest version a worker's log says went live (0: none yet)."""
    text = worker_log.read_text() if worker_log.exists() else ""
    return max((int(v) for v in re.findall(r"policy v(\d+) live", text)), default=0)


def _stop_during_a_synchronous_publish(
    trainer: int, child: int, metrics: Path, trainer_log: Path, worker_logs: list[Path], tries: int = 5
) -> None:
    """SIGSTOP the serving child so that the trainer's (max_staleness 0) next publish waits for it.
    Step k's row (policy_version k+1) is written once v(k+1) is announced, and step k+1's prompts
    are fed after it: the trainer is frozen (SIGSTOP) as soon as that row is there, so it can neither
    train nor publish while the workers fetch v(k+1) from the child (one fast worker may make all of
    step k+1's groups: waiting for every worker alone lets the trainer publish v(k+2) first). Once
    every worker has v(k+1) live, the child is stopped and the trainer continued: its publish of
    v(k+2) waits for the child, which it says (PolicyServerProcess: "no reply to PUBLISH of version
    ..."). With no such line in 20 s (the trainer got past its publish before it was frozen), the
    child is continued and the next step tried."""
    for _ in range(tries):
        rows, deadline = len(lines(metrics)), time.monotonic() + 60
        while len(lines(metrics)) == rows:
            assert time.monotonic() < deadline, f"no step after step {rows} in 60 s"
            time.sleep(0.005)
        os.kill(trainer, signal.SIGSTOP)
        try:
            k = len(lines(metrics))
            deadline = time.monotonic() + 60
            while min(_newest_live(p) for p in worker_logs) <= k:
                assert time.monotonic() < deadline, f"no worker had v{k + 1} live in 60 s"
                time.sleep(0.05)
            mark = len(trainer_log.read_text())
            os.kill(child, signal.SIGSTOP)
        finally:
            os.kill(trainer, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if re.search(r"no reply to PUBLISH of version \d+ in", trainer_log.read_text()[mark:]):
                return
            time.sleep(0.1)
        os.kill(child, signal.SIGCONT)
    raise AssertionError(f"the trainer never waited for a publish in {tries} tries")


def _replacement(run: Run, kills: int, timeout_s: float = 60.0) -> int:
    """The pid of the child that replaced the `kills`-th killed one, once it serves (its log line)."""
    deadline = time.monotonic() + timeout_s
    while len(started := re.findall(r"started a new one \(pid (\d+)\)", run.log_tail("trainer", 10**7))) < kills:
        assert run.trainer.poll() is None, f"trainer exited {run.trainer.returncode}:\n{run.log_tail('trainer')}"
        assert time.monotonic() < deadline, f"no new policy-server child in {timeout_s}s:\n{run.log_tail('trainer')}"
        time.sleep(0.05)
    return int(started[-1])


def test_serving_child_killed_during_publishes(tmp_path, redis_server, run_id):
    """trainer.policy_server_process on the CPU, synchronous (max_staleness 0: the trainer waits for
    each publish); its serving child SIGKILLed 3 times, each once the previous replacement serves and
    two more steps passed: twice while a publish waits for its reply (the child stopped first,
    _stop_during_a_synchronous_publish), once at a random moment. Every kill is survived: the
    replacement gets the versions the dead one held and the in-flight publish; two steps after the
    last, the trainer is stopped (SIGTERM) and the run is exactly-once, with no publish failure and
    no traceback."""
    run = Run(tmp_path, config(tmp_path, run_id, redis_server.url, max_steps=10_000, policy_server_process=True))
    kills = []
    try:
        run.start_trainer("loop.max_staleness=0")
        for w in ("w0", "w1"):
            run.start_worker(w, "loop.max_staleness=0", "rollout.fetch_timeout_s=3")
        run.wait_steps(1)
        child = _child_of(run.trainer.pid, SERVER_CHILD)
        for kind in ("mid_publish", "random", "mid_publish", "end"):
            if kills:  # each kill once the previous one's replacement serves: every one is survived
                child = _replacement(run, len(kills))
                run.wait_steps(run.steps() + 2)  # the workers caught up
            if kind == "mid_publish":
                _stop_during_a_synchronous_publish(
                    run.trainer.pid,
                    child,
                    run.run_dir / "metrics.jsonl",
                    run.logs / "trainer.log",
                    [run.logs / f"{w}.log" for w in run.workers],
                )
            elif kind == "random":
                time.sleep(random.uniform(0.0, 1.0))
            else:
                break
            os.kill(child, signal.SIGKILL)
            kills.append(kind)
        run.trainer.send_signal(signal.SIGTERM)  # a graceful stop: checkpoint and commit
        assert run.wait_trainer() == 0, run.log_tail("trainer")
        steps = run.steps()
    finally:
        run.close()
    log = run.log_tail("trainer", 10**7)
    replaced = re.findall(r"policy server process \d+ exited \(-9\): started a new one .* with versions \[(.*)\]", log)
    assert len(replaced) == len(kills) and all(replaced), log[-3000:]  # each with the versions it held
    during = len(re.findall(r"exited \(-9\) during publishing version", log))
    assert during >= kills.count("mid_publish"), log[-3000:]  # each stopped one had a publish waiting
    assert "failed" not in log and "Traceback" not in log, log[-3000:]
    figures = audit(run.run_dir, steps, stopped=True)
    report("serving_child_killed", faults=len(kills), during_publish=during, **figures)


def test_redis_gone_past_the_bound_ends_every_service_with_3_and_one_line(tmp_path, redis_server, run_id):
    """`tandem run` (trainer + worker w0; synchronous, serving child on) and a worker started on its
    own (w9), against a Redis SIGKILLed for good while the trainer waits for a publish (its serving
    child stopped, continued once Redis is gone), so that the outage may surface inside a
    PublishError (tests/unit/test_atomic.py checks that it is found there). Past redis_outage_s (3 s):
    the launcher and w9 exit 3; the launcher, the trainer and w9 each say so in one line; no
    traceback anywhere."""
    sync = ["redis_outage_s=3", "loop.max_staleness=0"]
    cfg = config(tmp_path, run_id, redis_server.url, max_steps=200, workers=1, policy_server_process=True)
    run_dir, console, w9_log = tmp_path / "run", tmp_path / "console.log", tmp_path / "w9.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def spawn(args: list[str], out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *args], stdout=open(out, "ab"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip

    launcher = spawn(["run", str(cfg), "--run-dir", str(run_dir), *sync], console)
    w9 = spawn(["rollout", "--config", str(cfg), "--worker-id", "w9", *sync], w9_log)
    try:
        deadline = time.monotonic() + 180
        while not lines(run_dir / "metrics.jsonl"):
            assert launcher.poll() is None and w9.poll() is None, console.read_text()[-3000:]
            assert time.monotonic() < deadline, console.read_text()[-3000:]
            time.sleep(0.1)
        trainer = _child_of(launcher.pid, b"tandem.cli\0trainer")
        child = _child_of(trainer, SERVER_CHILD)
        _stop_during_a_synchronous_publish(
            trainer, child, run_dir / "metrics.jsonl", console, [run_dir / "logs" / "rollout-w0.log", w9_log]
        )
        redis_server.stop(kill=True)
        t_down = time.monotonic()
        os.kill(child, signal.SIGCONT)
        codes = {"tandem run": launcher.wait(timeout=120), "w9": w9.wait(timeout=120)}
        took = time.monotonic() - t_down
    finally:
        for p in (launcher, w9):
            if p.poll() is None:
                p.kill()
                p.wait()
    out, w9_out = console.read_text(), w9_log.read_text()
    assert codes == {"tandem run": 3, "w9": 3}, (codes, out[-3000:], w9_out[-3000:])
    # Which Redis call meets the outage first (the publish's announce, or the trainer's own feed or
    # heartbeat) is a race under load; a publish that failed, failed by the outage.
    assert set(re.findall(r"\[trainer\] publishing version \d+ failed: (\w+)", out)) <= {"RedisOutage"}, out[-3000:]
    for prefix, text, says in (
        ("[tandem]", out, r"Redis at redis://127\.0\.0\.1:\d+/0 unreachable for more than redis_outage_s=3s"),
        ("[trainer]", out, r"redis unreachable for 3\.\ds \(redis_outage_s=3\)"),
        ("[rollout w9]", w9_out, r"redis unreachable for 3\.\ds \(redis_outage_s=3\)"),
    ):
        gave_up = [ln for ln in text.splitlines() if ln.startswith(f"{prefix} giving up: ")]
        assert len(gave_up) == 1 and re.search(says, gave_up[0]), f"{prefix}:\n{text[-3000:]}"
    for text in (out, w9_out, *(p.read_text() for p in (run_dir / "logs").glob("*.log"))):
        assert "Traceback" not in text, text[-3000:]
    assert took < 60, f"the services took {took:.0f}s to give up (bound 3 s)"
    report("redis_gone_past_the_bound", bound_s=3, gave_up_s=round(took, 1), codes=codes)
