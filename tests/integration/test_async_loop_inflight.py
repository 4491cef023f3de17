"""The asynchronous loop with in-flight weight updates (loop.inflight_updates) end to end: a real
redis-server, the trainer and two rollout workers as separate processes, as `tandem run` starts them.
Workers install each version between two decode steps, so samples span versions; the trainer
bounds the oldest token of each sample: its audit and metrics show no token more than
max_staleness versions old, and samples that did span versions. The workers also profile a few of
their steps while the trainer steps (rollout.trace) and write the trace and its summary."""

from __future__ import annotations

import json
import re

import pytest
from loop_run import Loop, lines, tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_STEPS, MAX_STALENESS = 10, 2


def test_async_loop_with_in_flight_updates(tmp_path, redis_url, run_id):
    cfg = tiny_config(
        tmp_path, run_id, redis_url,
        loop={"max_staleness": MAX_STALENESS, "inflight_updates": True},
        task={"digits": 9},
        trainer={"max_steps": MAX_STEPS},
        # Samples long enough for versions to arrive while they decode: 11 tokens each (the stop token
        # ignored), one sample at a time per worker.
        rollout={"max_batch": 1, "ignore_stop": True, "trace": {"dir": str(tmp_path / "traces"), "after_s": 0.0, "steps": 3}},
    )  # fmt: skip
    with Loop(cfg, tmp_path) as run:
        run.wait_trainer()

    rows = lines(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    # Per token: none more than max_staleness old; samples spanning versions, on KV kept from older ones.
    assert all(r["tokens_over_max_staleness_frac"] == 0.0 for r in rows)
    assert all(0 <= r["token_staleness_mean"] <= MAX_STALENESS for r in rows)
    spanning = sum(r["samples_multi_version"] for r in rows)
    assert (
        (spanning > 0)
        == (sum(r["tokens_on_stale_kv"] for r in rows) > 0)
        == any("logp_abs_diff_stale_kv" in r for r in rows)
    )
    assert all("logp_abs_diff_quant" in r for r in rows)
    # The audit: every group's oldest token within max_staleness of the version it was trained at
    # (publish_every 1: the line's version minus one), its newest no newer.
    audit = lines(run.run_dir / "audit.jsonl")
    assert [a["step"] for a in audit] == list(range(1, MAX_STEPS + 1))
    for line in audit:
        trained_at = line["version"] - 1
        for _, newest, _, oldest in line["groups"]:
            assert 1 <= oldest <= newest <= trained_at and trained_at - oldest <= MAX_STALENESS, line
    # Workers swapped with groups in flight, waiting for no drain.
    text = "".join(run.log(w).read_text() for w in ("w0", "w1"))
    assert "refusing v" not in text and "start again" not in text
    continued = [int(n) for n in re.findall(r"(\d+) sample\(s\) continued in flight", text)]
    assert sum(continued) > 0, "no version arrived while samples decoded"
    drain = [float(w) for w in re.findall(r"drain_wait (\d+\.\d+)s", text)]
    assert len(drain) >= MAX_STEPS and max(drain) < 1.0, drain
    # Each worker profiled 3 of its steps: a Chrome trace and a summary with its threads' affinity.
    for w in ("w0", "w1"):
        summary = json.loads((tmp_path / "traces" / f"{w}-trace-summary.json").read_text())
        assert summary["steps"] == 3 and summary["step_wall_ms_median"] > 0 and summary["top_cpu_ops"]
        assert summary["affinity"]["threads"] and (tmp_path / "traces" / f"{w}-trace.json").stat().st_size > 0
        assert f"{w}: traced 3 steps" in run.log(w).read_text()
