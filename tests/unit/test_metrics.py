"""The trainer's Prometheus exposition: every State counter as a `_total` counter read from State
(so a restarted trainer continues from its checkpoint's totals), gauges present before step 1,
HELP text that says what and in which unit, the step-time histogram, the process collector."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from trainer.metrics import COUNTER_HELP, GAUGES, MetricsSink
from trainer.state import State


def _scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}, {
        f.name: f for f in text_string_to_metric_families(text)
    }


def test_counters_come_from_state_and_gauges_exist_before_the_first_step(tmp_path):
    # A State as restored from a checkpoint, plus a counter State may gain later (exported too).
    state = {**vars(State(step=7, version=8, samples=1234, dropped_stale=5)), "quarantined": 2, "pending_commit": []}
    sink = MetricsSink(tmp_path / "metrics.jsonl", port=0, state=lambda: state)
    try:
        values, families = _scrape(sink.port)
        assert values["tandem_trainer_samples_total"] == 1234  # from the checkpoint, not from 0
        assert values["tandem_trainer_dropped_stale_total"] == 5
        assert values["tandem_trainer_quarantined_total"] == 2
        assert values["tandem_trainer_step"] == 7 and values["tandem_trainer_policy_version"] == 8
        assert "process_cpu_seconds_total" in values and "process_resident_memory_bytes" in values
        assert values["tandem_trainer_step_seconds_count"] == 0
        for f in families.values():
            if f.name.startswith("tandem_"):
                assert f.documentation and f.documentation != f.name and "(" in f.documentation, f.name
        state["samples"] += 64
        sink.write({"step": 8, "reward_mean": 0.5, "step_time_s": 0.7, "logp_abs_diff_quant_p95": 3e-7})
        values, _ = _scrape(sink.port)
        assert values["tandem_trainer_samples_total"] == 1298
        assert values["tandem_trainer_reward_mean"] == 0.5 and values["tandem_trainer_last_step_seconds"] == 0.7
        assert values["tandem_trainer_step_seconds_count"] == 1 and values["tandem_trainer_step_seconds_sum"] == 0.7
        assert values["tandem_trainer_logp_abs_diff_quant_p95"] == 3e-7
    finally:
        sink.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_every_state_counter_has_a_help_text():
    counters = [k for k, v in vars(State()).items() if isinstance(v, int) and k not in ("step", "version")]
    assert counters and set(counters) <= set(COUNTER_HELP)
    assert all(name.startswith("tandem_trainer_") for name, _ in GAUGES.values())
