"""The asynchronous loop with routing replay (loop.routing_replay) end to end: a real redis-server,
the trainer and two rollout workers as separate processes, as `tandem run` starts them. Every
trajectory on the stream carries its tokens' expert ids ([n, MoE layers, k] uint8), the trainer
accepts them all (none refused) and takes every step with them replayed; with drain-on-swap and
with in-flight updates (a sample's ids then come from the versions that sampled its tokens)."""

from __future__ import annotations

import signal
import subprocess

import numpy as np
import pytest
import yaml
from test_async_loop import _all_trajectories, _lines, _spawn, _wait  # tests/integration/test_async_loop.py

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 6
N_LAYERS, TOP_K = 2, 2


def _config(tmp, run_id: str, redis_url: str, inflight: bool):
    cfg = {
        "run_id": run_id,
        "redis_url": redis_url,
        "num_rollout_workers": 2,
        "loop": {"max_staleness": 1, "seed": 3, "routing_replay": True, "inflight_updates": inflight},
        "recipe": "nvfp4_moe",
        "model": {
            "preset": "tiny",
            "overrides": {
                "n_layers": N_LAYERS,
                "dim": 64,
                "n_experts": 4,
                "top_k": TOP_K,
                "expert_ffn_dim": 64,
                "shared_expert_ffn_dim": 64,
            },
        },  # fmt: skip
        "trainer": {
            "max_steps": MAX_STEPS,
            "groups_per_step": 2,
            "group_size": 4,
            "minibatches": 1,
            "warmstart_steps": 2,
            "warmstart_batch": 8,
            "metrics_port": -1,
            "checkpoint_every": 0,
            "collect_timeout_s": 60.0,
        },
        "rollout": {"read_block_ms": 200, "max_inflight_groups": 2, "max_batch": 4},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("inflight", [False, True], ids=["drain", "inflight"])
def test_async_loop_with_routing_replay(tmp_path, redis_url, run_id, inflight):
    cfg = _config(tmp_path, run_id, redis_url, inflight)
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    trainer = _spawn(["trainer", "--config", str(cfg), "--run-dir", str(run_dir)], logs / "trainer.log")
    workers = [_spawn(["rollout", "--config", str(cfg), "--worker-id", w], logs / f"{w}.log") for w in ("w0", "w1")]
    seen = []
    try:
        # Committed entries get trimmed: look until some are there.
        _wait(lambda: seen.extend(_all_trajectories(redis_url, run_id)) or seen, "trajectories", 600, [trainer])
        _wait(lambda: trainer.poll() is not None, "the trainer to finish", 600, workers)
        assert trainer.returncode == 0, (logs / "trainer.log").read_text()[-3000:]
    finally:
        for p in [trainer, *workers]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [trainer, *workers]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    for t in seen:  # every completion token's expert ids, per MoE layer, compact
        r = t.routed_experts
        assert r is not None and r.dtype == np.uint8 and r.shape == (len(t.completion_tokens), N_LAYERS, TOP_K)
        assert int(r.max()) < 4 and (np.sort(r, axis=-1)[..., 1:] != np.sort(r, axis=-1)[..., :1]).all()
    rows = _lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert rows[-1]["invalid"] == rows[-1]["malformed"] == 0, "samples refused (routed_experts missing or wrong?)"
    # Each step updated and published (the tiny model's rewards are mostly 0: no advantage, a zero
    # gradient; tests/unit/test_routing_replay.py checks a replayed update's gradient).
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert all(np.isfinite(r["grad_norm"]) and np.isfinite(r["logp_abs_diff"]) for r in rows)
    assert all("logp_abs_diff" in r for r in rows)
