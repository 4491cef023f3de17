"""`tandem run` as a user meets it: a live run scraped from outside (Prometheus text parsed with
prometheus_client's parser, gRPC reflection), Ctrl-C sent to the launcher's whole foreground
process group (as a terminal does), then a resume from the run folder against the same Redis
streams (the private Redis keeps an append-only file in the run folder)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.signing import load_signer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LR_SCHEDULE = {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
MODEL = {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64}


def _config(tmp: Path, max_steps: int) -> Path:
    cfg = {
        "run_id": "launch",
        "num_rollout_workers": 2,
        "loop": {"max_staleness": 1, "seed": 5},
        "recipe": "nvfp4_moe",
        "model": {"preset": "tiny", "overrides": MODEL},
        "trainer": {
            "max_steps": max_steps,
            "groups_per_step": 2,
            "group_size": 4,
            "minibatches": 1,
            "warmstart_steps": 5,
            "warmstart_batch": 8,
            "checkpoint_every": 3,
            "keep_checkpoints": 2,
            "collect_timeout_s": 120.0,
            "policy_server_process": True,  # the CUDA default, here on the CPU: serving from a child process
            "policy_server_processes": 2,  # two of them on one port (SO_REUSEPORT)
            "lr_schedule": LR_SCHEDULE,
            "eval_every": 2,
            "eval_prompts": 4,
        },
        "task": {"heldout_fraction": 0.2},
        "rollout": {"fetch_timeout_s": 10.0},
        "logging": {"tensorboard": True},
    }
    path = tmp / f"config-{max_steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(cfg: Path, run_dir: Path, console: Path) -> subprocess.Popen:
    # Its own session, like a shell job: killpg(pid, SIGINT) is a terminal's Ctrl-C.
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "run", str(cfg), "--run-dir", str(run_dir)],
        stdout=open(console, "ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def _wait(cond, what: str, timeout_s: float, proc: subprocess.Popen, console: Path):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, (
            f"tandem run exited ({proc.returncode}) waiting for {what}:\n{console.read_text()[-3000:]}"
        )
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.3)


def _port(log: Path, pattern: str):
    found = re.findall(pattern, log.read_text()) if log.exists() else []
    return found[-1] if found else None


def _scrape(port: str) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str | None = None) -> float:
    return next(s.value for s in families[family].samples if s.name == (sample or family))


def test_live_run_metrics_ctrl_c_and_resume(tmp_path):
    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    logs = run_dir / "logs"
    proc = _launch(_config(tmp_path, max_steps=200), run_dir, console)
    try:
        _wait(lambda: len(_lines(run_dir / "metrics.jsonl")) >= 2, "two steps", 300, proc, console)

        # The trainer's metrics: State counters, step-time histogram, gauges, process collector.
        trainer_port = _port(logs / "trainer.log", r"Prometheus port (\d+)")
        fams = _scrape(trainer_port)
        for name in ("samples", "completion_tokens", "dropped_stale", "dropped_fingerprint", "versions_published"):
            assert fams[f"tandem_trainer_{name}"].type == "counter", name
        assert _value(fams, "tandem_trainer_samples", "tandem_trainer_samples_total") >= 2 * 8
        assert _value(fams, "tandem_trainer_versions_published", "tandem_trainer_versions_published_total") >= 2
        assert fams["tandem_trainer_step_seconds"].type == "histogram"
        assert _value(fams, "tandem_trainer_step_seconds", "tandem_trainer_step_seconds_count") >= 1
        assert _value(fams, "tandem_trainer_step") >= 2 and _value(fams, "tandem_trainer_policy_version") >= 2
        assert "tandem_trainer_logp_abs_diff_quant_p95" in fams and "process_cpu_seconds" in fams
        assert _value(fams, "tandem_trainer_learning_rate") > 0
        # The policy server's counters, summed over its processes (trainer.policy_server_processes).
        assert _value(fams, "tandem_policy_sent_bytes", "tandem_policy_sent_bytes_total") > 0
        for f in fams.values():
            if f.name.startswith("tandem_"):
                assert f.documentation and f.documentation != f.name, f.name
                assert f.type != "counter" or f.samples[0].name.endswith("_total")
        # Each worker's own endpoint.
        for w in ("w0", "w1"):
            port = _wait(
                lambda w=w: _port(logs / f"rollout-{w}.log", r"metrics \(Prometheus\) on port (\d+)"),
                f"{w}'s metrics port",
                60,
                proc,
                console,
            )
            wf = _wait(
                lambda port=port: (f := _scrape(port)) and _value(f, "tandem_rollout_policy_version") >= 1 and f,
                f"{w} to load a policy",
                120,
                proc,
                console,
            )
            fetched = _value(wf, "tandem_rollout_policy_fetch_bytes", "tandem_rollout_policy_fetch_bytes_total")
            assert fetched > 0, (logs / f"rollout-{w}.log").read_text()[-3000:]
            for name in ("groups", "generated_tokens", "versions_refused"):
                assert wf[f"tandem_rollout_{name}"].type == "counter"
            for name in ("generated_tokens_per_second", "policy_staleness"):
                assert wf[f"tandem_rollout_{name}"].type == "gauge"
            assert wf["tandem_rollout_policy_fetch_seconds"].type == "histogram"
        # gRPC reflection on the policy port (on under `tandem run`).
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        address = _port(logs / "trainer.log", r"policy server on (\S+);")
        with grpc.insecure_channel(address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=10))
        assert "tandem.v1.PolicyService" in {s.name for s in resp.list_services_response.service}
        # Policies go to the run's workers only: a client without the run token gets nothing.
        with PolicyClient(PolicyClientConfig(address=address)) as c, pytest.raises(grpc.RpcError) as e:
            c.get_manifest()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        token = load_signer(str(run_dir / "run.secret")).policy_token()
        with PolicyClient(PolicyClientConfig(address=address, run_token=token)) as c:
            assert c.get_manifest().version >= 1

        # Ctrl-C at the terminal: SIGINT to the whole foreground process group.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, console.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    # Stopped in order: no traceback anywhere, workers drained, the trainer checkpointed (which
    # needs Redis: it was stopped last).
    for log in [console, *logs.glob("*.log")]:
        text = log.read_text()
        assert "Traceback" not in text and "ConnectionError" not in text, f"{log.name}:\n{text[-3000:]}"
    assert all("drained after" in (logs / f"rollout-{w}.log").read_text() for w in ("w0", "w1"))
    stopped = _lines(run_dir / "metrics.jsonl")[-1]["step"]
    assert f"stopped at step {stopped} (checkpoint step-{stopped:06d}.pt)" in (logs / "trainer.log").read_text()
    assert "[trainer] step" in console.read_text()  # the console shows progress; trainer.log keeps it too
    assert re.search(
        r"\[trainer\] step +2/200 .* lr \S+ .* eval greedy \S+ sampled \S+ eta \d+[smh]", console.read_text()
    )
    assert "[trainer] step" in (logs / "trainer.log").read_text()

    # The run folder is the user's alone; checkpoints are proportionate and pruned.
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for path in [run_dir / "config.yaml", run_dir / "run.secret", run_dir / "metrics.jsonl", logs / "trainer.log"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    ckpts = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert 1 <= len(ckpts) <= 2 and ckpts[-1].name == f"step-{stopped:06d}.pt"
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    from tandem import config, services

    _, model_config, _ = services.task_and_model(config.load(run_dir / "config.yaml"))
    fp32_bytes = 4 * model_config.num_parameters()
    assert ckpts[-1].stat().st_size < 3.1 * fp32_bytes  # weights + two AdamW moments, no more
    assert (run_dir / "redis" / "appendonlydir").is_dir()

    # Resume from the folder: the same streams and prompt sequence (AOF), a marker for the plots.
    proc = _launch(_config(tmp_path, max_steps=stopped + 2), run_dir, console)
    try:
        assert proc.wait(timeout=300) == 0, console.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stopped:06d}.pt'}" in (logs / "trainer.log").read_text()
    rows = _lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, stopped + 3))
    assert rows[stopped].get("resumed_from") == stopped and all("resumed_from" not in r for r in rows[:stopped])
    # The LR schedule is a function of the step (each run's max_steps its horizon): the resumed run
    # goes on from the checkpoint's step. Held-out accuracy every 2 steps; TensorBoard has the rows.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.warmstart import lr_factor

    def lr(t, steps):
        s = LR_SCHEDULE
        return 3e-4 * lr_factor(t, steps=steps, warmup=s["warmup_steps"], kind=s["kind"], min_ratio=s["min_lr_ratio"])

    want = [lr(t, 200) for t in range(stopped)] + [lr(t, stopped + 2) for t in range(stopped, stopped + 2)]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12)
    assert [r["step"] for r in rows if "eval_greedy_accuracy" in r] == [s for s in range(1, stopped + 3) if s % 2 == 0]
    assert all(0 <= r[k] <= 1 for r in rows for k in ("eval_greedy_accuracy", "eval_sampled_accuracy") if k in r)
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("reward_mean")}
    assert tb == pytest.approx({r["step"]: r["reward_mean"] for r in rows}, rel=1e-6)
    used = [g[0] for line in _lines(run_dir / "audit.jsonl") for g in line["groups"]]
    assert len(used) == len(set(used)) == 2 * (stopped + 2), "a prompt group used twice: Redis forgot the run"
    # The README's list of the run folder's files names everything the folder holds.
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = readme.split("the run folder (`runs/demo-<time>/`", 1)[1].split("\n\n", 1)[0]
    unlisted = [p.name for p in run_dir.iterdir() if f"`{p.name}{'/' if p.is_dir() else '`'}" not in listed]
    assert not unlisted, f"README.md does not list {unlisted} among the run folder's files"
    # Counters continue from the checkpoint's totals.
    state = torch.load(sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)["state"]
    assert state["samples"] == 8 * (stopped + 2) and state["step"] == stopped + 2

    # `tandem probe --run-dir` measures what the run trained, with the run's model and recipe.
    probe = [sys.executable, "-m", "tandem.cli", "probe", "--run-dir", str(run_dir), "--batch", "2", "--seq-len", "8"]
    res = subprocess.run(probe + ["--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert f"version {state['version']}" in out["weights"] and out["results"][0]["recipe"] == "nvfp4_moe"
    assert out["results"][0]["weights_bitwise_equal"]
    res = subprocess.run(probe + ["--version", "999"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "holds the weights of version 999 (kept: " in res.stderr
    assert "Traceback" not in res.stderr


def test_ports_in_the_run_folder_a_resume_that_changes_the_lr_and_ctrl_c_in_the_warm_start(tmp_path):
    """One launch: a run folder whose config.yaml had another lr, resumed with --accept-changes
    (the old config kept, the change printed); a fixed rollout.metrics_port shared by two workers
    (w0 binds it, w1 the next), free ports for the trainer, all in ports.json and printed once;
    then Ctrl-C in the middle of a long warm start, which the trainer takes between two steps."""
    from tandem import config

    run_dir, console = tmp_path / "run", tmp_path / "console.txt"
    cfg_path = _config(tmp_path, max_steps=3)
    run_dir.mkdir()
    before = config.dump(config.load(cfg_path))
    (run_dir / "config.yaml").write_text(before)
    base = _two_free_ports()
    long_warm_start = ["trainer.lr=0.01", "trainer.warmstart_steps=100000", f"rollout.metrics_port={base}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "run", str(cfg_path), "--run-dir", str(run_dir), *long_warm_start]
        + ["--accept-changes"],
        stdout=open(console, "ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    logs = run_dir / "logs"
    try:
        _wait(lambda: "warm start step 1/100000" in _text(logs / "trainer.log"), "the warm start", 180, proc, console)
        ports = json.loads((run_dir / "ports.json").read_text())
        assert ports["w0"] == {"rollout.metrics_port": f"127.0.0.1:{base}"}
        assert ports["w1"] == {"rollout.metrics_port": f"127.0.0.1:{base + 1}"}
        trainer = ports["trainer"]
        assert set(trainer) == {"trainer.grpc_port", "trainer.metrics_port"} and ports["redis"].startswith("redis://")
        assert all(int(a.rsplit(":", 1)[1]) > 0 for a in trainer.values())
        # each service bound what ports.json says
        for w, port in (("w0", base), ("w1", base + 1)):
            _wait(
                lambda w=w: _port(logs / f"rollout-{w}.log", r"metrics \(Prometheus\) on port (\d+)"),
                f"{w}'s metrics port",
                60,
                proc,
                console,
            )
            assert _port(logs / f"rollout-{w}.log", r"metrics \(Prometheus\) on port (\d+)") == str(port)
        trainer_log = _text(logs / "trainer.log")
        assert f"Prometheus port {trainer['trainer.metrics_port'].rsplit(':', 1)[1]}" in trainer_log
        assert f"policy server on {trainer['trainer.grpc_port']};" in trainer_log
        out = console.read_text()
        assert out.count("[tandem] ports: ") == 1 and f"w1 metrics_port 127.0.0.1:{base + 1}" in out
        assert "trainer.lr: 0.0003 -> 0.01" in out and "trainer.warmstart_steps: 5 -> 100000" in out
        (kept,) = (run_dir / "config-history").iterdir()
        assert kept.read_text() == before
        assert config.load(run_dir / "config.yaml").trainer.lr == 0.01

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal
        assert proc.wait(timeout=120) == 130, console.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    trainer_log = _text(logs / "trainer.log")
    assert re.search(r"warm start stopped after step \d+/100000", trainer_log), trainer_log[-2000:]
    assert "stopped during the warm start: nothing saved" in trainer_log
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("*.pt"))
    for log in [console, *logs.glob("*.log")]:
        assert "Traceback" not in log.read_text(), f"{log.name}:\n{log.read_text()[-3000:]}"


def _two_free_ports() -> int:
    """A port P with P and P + 1 free, below the kernel's ephemeral range, where no other program's
    port 0 or outgoing connection lands between this pick and the workers' binds."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for base in random.sample(range(20000, low - 1), 200):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise AssertionError("no two free ports in a row below the ephemeral range")


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
