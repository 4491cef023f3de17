"""The asynchronous loop with routing replay (loop.routing_replay) end to end: a real redis-server,
the trainer and two rollout workers as separate processes, as `tandem run` starts them. Every
trajectory on the stream carries its tokens' expert ids ([n, MoE layers, k] uint8), the trainer
accepts them all (none refused) and takes every step with them replayed; with drain-on-swap and
with in-flight updates (a sample's ids then come from the versions that sampled its tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from loop_run import TINY_MODEL, Loop, all_trajectories, lines, tiny_config, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 6
N_LAYERS, TOP_K = 2, 2


@pytest.mark.parametrize("inflight", [False, True], ids=["drain", "inflight"])
def test_async_loop_with_routing_replay(tmp_path, redis_url, run_id, inflight):
    overrides = {**TINY_MODEL["overrides"], "n_layers": N_LAYERS, "top_k": TOP_K}
    cfg = tiny_config(
        tmp_path, run_id, redis_url,
        loop={"routing_replay": True, "inflight_updates": inflight},
        model={"overrides": overrides},
        trainer={"max_steps": MAX_STEPS},
    )  # fmt: skip
    seen = []
    with Loop(cfg, tmp_path) as run:
        # Committed entries get trimmed: look until some are there.
        wait(lambda: seen.extend(all_trajectories(redis_url, run_id)) or seen, "trajectories", 600, [run.trainer])
        run.wait_trainer()

    for t in seen:  # every completion token's expert ids, per MoE layer, compact
        r = t.routed_experts
        assert r is not None and r.dtype == np.uint8 and r.shape == (len(t.completion_tokens), N_LAYERS, TOP_K)
        assert int(r.max()) < 4 and (np.sort(r, axis=-1)[..., 1:] != np.sort(r, axis=-1)[..., :1]).all()
    rows = lines(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert rows[-1]["invalid"] == rows[-1]["malformed"] == 0, "samples refused (routed_experts missing or wrong?)"
    # Each step updated and published (the tiny model's rewards are mostly 0: no advantage, a zero
    # gradient; tests/unit/test_routing_replay.py checks a replayed update's gradient).
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert all(np.isfinite(r["grad_norm"]) and np.isfinite(r["logp_abs_diff"]) for r in rows)
    assert all("logp_abs_diff" in r for r in rows)
