"""Plots of a run folder: log-scale mismatch with its percentiles, the run id in every title, a
marker wherever the run resumed, in every plot over steps."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from tandem import plots  # noqa: E402


def _rows():
    rows = []
    for step in range(1, 7):
        rows.append(
            {
                "step": step,
                "reward_mean": 0.1 * step,
                "staleness_mean": 1.0,
                "staleness_max": 2,
                "staleness_hist": {"1": 30, "2": 2},
                "dropped_stale": 0,
                "logp_abs_diff": 0.05,
                "logp_abs_diff_quant": 2e-7 if step != 2 else 0.0,  # an exact 0 must stay drawable
                "logp_abs_diff_quant_p50": 1e-7,
                "logp_abs_diff_quant_p95": 5e-7,
                "logp_abs_diff_stale": 0.05,
                "kl_k3": -1e-9,  # the k3 estimator can come out slightly negative
            }
        )
    rows[3]["resumed_from"] = 3  # step 4 is the first after a restart from step 3's checkpoint
    return rows


def _vlines(ax) -> list[float]:
    return [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"]


def test_mismatch_is_log_scale_with_percentiles_and_resume_marker():
    fig = plots.mismatch_figure(_rows(), "run exp7 (exp7-1)")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert any("median" in s for s in labels) and any("95th percentile" in s for s in labels)
    assert any(s.startswith("total") for s in labels)
    quant = next(line for line in ax.get_lines() if line.get_label().startswith("quantization part: version"))
    assert min(quant.get_ydata()) == plots.LOG_FLOOR  # the exact 0 is on the axis, not dropped
    assert "run exp7" in ax.get_title()
    assert _vlines(ax) == [3.5]


def test_mismatch_value_rules():
    nan = float("nan")
    stale0 = {"staleness_max": 0, "logp_abs_diff_stale": 0.0, "logp_abs_diff_quant": 0.0, "kl_k3": -1e-9}
    values = {
        "absent": plots.mismatch_value({}, "logp_abs_diff"),
        "null": plots.mismatch_value({"logp_abs_diff": None}, "logp_abs_diff"),
        "NaN": plots.mismatch_value({"logp_abs_diff": nan}, "logp_abs_diff"),
        "stale part, nothing stale": plots.mismatch_value(stale0, "logp_abs_diff_stale"),
        "stale part, stale samples": plots.mismatch_value({**stale0, "staleness_max": 1}, "logp_abs_diff_stale"),
        "exact 0": plots.mismatch_value(stale0, "logp_abs_diff_quant"),
        "negative k3": plots.mismatch_value(stale0, "kl_k3"),
        "value": plots.mismatch_value({"kl_k3": 3e-7}, "kl_k3"),
    }
    drawn = {k: v for k, v in values.items() if v == v}
    assert drawn == {
        "stale part, stale samples": plots.LOG_FLOOR,
        "exact 0": plots.LOG_FLOOR,
        "negative k3": plots.LOG_FLOOR,
        "value": 3e-7,
    }


def test_a_step_without_a_value_is_not_drawn_at_the_floor():
    rows = _rows()
    rows[0].update(staleness_max=0, staleness_mean=0.0, logp_abs_diff_stale=0.0)  # step 1: nothing stale yet
    rows[2]["logp_abs_diff_quant"] = float("nan")  # step 3: no sample of a known version
    del rows[4]["kl_k3"]  # step 5: not recorded
    ax = plots.mismatch_figure(rows, "run exp7").axes[0]
    lines = {line.get_label().split(":")[0].split(" (")[0]: list(line.get_ydata()) for line in ax.get_lines()}
    floor = plots.LOG_FLOOR
    assert lines["staleness part"] == [pytest.approx(v, nan_ok=True) for v in [float("nan")] + [0.05] * 5]
    assert [v == v for v in lines["quantization part"]] == [True, True, False, True, True, True]
    assert lines["quantization part"][1] == floor  # step 2's exact 0 stays on the axis
    assert [v == v for v in lines["KL k3"]] == [True, True, True, True, False, True]
    floor_entries = [s for s in lines if s.startswith("exact 0")]
    assert floor_entries == [f"exact 0, drawn at {floor:g}"], lines.keys()
    # With no exact zero anywhere, the legend has no floor entry.
    for r in rows:
        r.update(logp_abs_diff_quant=2e-7, kl_k3=1e-8)
    labels = [line.get_label() for line in plots.mismatch_figure(rows, "run exp7").axes[0].get_lines()]
    assert not any(s.startswith("exact 0") for s in labels)


def test_every_plot_names_the_run_and_marks_the_resume(tmp_path):
    (tmp_path / "config.yaml").write_text("run_id: exp7\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    label = plots.run_label(tmp_path)
    assert label == f"run exp7 ({tmp_path.name})"
    reward = plots.reward_figure(_rows(), label)
    staleness = plots.staleness_figure(_rows(), label)
    assert "run exp7" in reward.axes[0].get_title() and "run exp7" in staleness.texts[0].get_text()
    assert _vlines(reward.axes[0]) == [3.5] and _vlines(staleness.axes[0]) == [3.5]
    written = plots.write_plots(tmp_path)
    assert [p.name for p in written] == ["reward.png", "mismatch.png", "staleness.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_reward_plot_draws_held_out_accuracy_at_the_evaluated_steps():
    rows = _rows()
    for r in rows[1::2]:  # steps 2, 4, 6
        r.update(eval_greedy_accuracy=r["step"] / 10, eval_sampled_accuracy=r["step"] / 20)
    ax = plots.reward_figure(rows, "run x").axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    greedy = lines["held-out accuracy, greedy (trainer.eval_every)"]
    sampled = lines["held-out accuracy, sampled (trainer.eval_every)"]
    assert list(greedy.get_xdata()) == [2, 4, 6] and list(greedy.get_ydata()) == [0.2, 0.4, 0.6]
    assert list(sampled.get_ydata()) == [0.1, 0.2, 0.3]
    assert not any(
        "held-out" in label for label in (x.get_label() for x in plots.reward_figure(_rows(), "x").axes[0].get_lines())
    )
