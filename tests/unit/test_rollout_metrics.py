"""rollout.metrics: every number of the worker's stats() exported at scrape time under its table's
name (counters with `_total`, labelled families by their label), each with a HELP naming a unit."""

from __future__ import annotations

import prometheus_client as prom
import pytest

from rollout.metrics import COUNTERS, GAUGES, LABELLED, WorkerMetrics


def stats(**changes) -> dict:
    base = {key: 0 for key in (*COUNTERS, *GAUGES)} | {key: {} for key in LABELLED}
    return base | changes


def test_stats_are_read_at_every_scrape_under_their_names():
    now = stats(groups=3, policy_version=7, prompts_refused={"invalid": 2, "unsigned": 1})
    m = WorkerMetrics(-1, "127.0.0.1", lambda: now)
    value = m.endpoint.registry.get_sample_value
    assert value("tandem_rollout_groups_total") == 3 and value("tandem_rollout_policy_version") == 7
    assert value("tandem_rollout_prompts_refused_total", {"why": "invalid"}) == 2
    assert value("tandem_rollout_prompts_refused_total", {"why": "unsigned"}) == 1
    assert value("tandem_rollout_policy_swap_part_seconds", {"part": "h2d"}) is None  # no swap yet
    now = stats(groups=4, swap_part_seconds={"h2d": 0.25})
    assert value("tandem_rollout_groups_total") == 4
    assert value("tandem_rollout_policy_swap_part_seconds", {"part": "h2d"}) == 0.25
    m.observe_fetch(0.3)
    assert value("tandem_rollout_policy_fetch_seconds_bucket", {"le": "0.5"}) == 1
    assert value("tandem_rollout_policy_fetch_seconds_bucket", {"le": "0.25"}) == 0
    m.close()


@pytest.mark.parametrize("table", [COUNTERS, GAUGES])
def test_names_and_help_follow_the_conventions(table):
    for name, help_text in table.values():
        assert name.startswith("tandem_rollout_") and help_text.endswith(")"), name
        assert name.endswith("_total") == (table is COUNTERS), name
    for kind, name, _label, help_text in LABELLED.values():
        assert name.endswith("_total") == (kind == "counter") and help_text.endswith(")"), name
    text = prom.generate_latest(WorkerMetrics(-1, "127.0.0.1", stats).endpoint.registry).decode()
    assert "# TYPE tandem_rollout_groups_total counter\ntandem_rollout_groups_total 0.0\n" in text
    assert "# TYPE tandem_rollout_policy_swap_part_seconds gauge" in text
    assert "tandem_rollout_policy_swap_part_seconds{" not in text  # no sample before the first swap
