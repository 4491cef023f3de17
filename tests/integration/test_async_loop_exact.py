"""The asynchronous loop in exact mode (loop.exact) end to end: a real redis-server, the trainer and
two rollout workers as separate processes, as `tandem run` starts them. Every step's quantization part
of the mismatch is exactly 0 (each token's behavior log-prob equals the trainer's recompute under its
version, bit for bit); at max_staleness 0 the whole mismatch and kl_k3 are exactly 0 too. (kl_k3 alone
proves little here: in fp32, exp(d) - 1 - d is 0 for the ~1e-7 differences the default mode leaves
on this model; logp_abs_diff is the check that fails without exact mode: with it off, a run of this
config at max_staleness 0 had logp_abs_diff_quant 5.7e-8..1.4e-7 per step, kl_k3 0.0.) With routing
replay on, the trainer's router picks the recorded experts for every token at staleness 0.)"""

from __future__ import annotations

import pytest
from loop_run import Loop, lines, tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS = 4


@pytest.mark.parametrize(("max_staleness", "replay"), [(0, True), (1, False)])
def test_async_loop_in_exact_mode_has_zero_mismatch(tmp_path, redis_url, run_id, max_staleness, replay):
    cfg = tiny_config(
        tmp_path, run_id, redis_url,
        loop={"exact": True, "max_staleness": max_staleness, "routing_replay": replay},
        trainer={"max_steps": MAX_STEPS},
    )  # fmt: skip
    with Loop(cfg, tmp_path) as run:
        run.wait_trainer()

    rows = lines(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    assert all(r["logp_abs_diff_quant"] == 0.0 and r["logp_abs_diff_quant_p95"] == 0.0 for r in rows), rows
    assert sum(r["completion_tokens"] for r in rows) > 0
    if max_staleness == 0:
        assert all(r["staleness_max"] == 0 for r in rows)
        assert all(r["kl_k3"] == 0.0 and r["logp_abs_diff"] == 0.0 for r in rows), rows
    if replay:
        assert all(r["router_agree_frac"] == 1.0 == r["tokens_routed_as_rollout_frac"] for r in rows), rows
