"""PNG plots of a run folder's metrics.jsonl: reward (and held-out accuracy), train/rollout
mismatch, staleness.

Every title names the run (its run_id and folder); every plot over steps has a dashed vertical
line wherever the trainer resumed from a checkpoint (a metrics row with `resumed_from`). The
mismatch plot is on a log axis: its quantization part (~1e-7 per token) is the project's central
claim and would sit flat at 0 on a linear one next to the staleness part (~1e-1). Exact zeros
sit at LOG_FLOOR, named in the legend; a step without a value is not drawn (`mismatch_value`).
"""

from __future__ import annotations

import json
from pathlib import Path

from policy.fields import is_number

LOG_FLOOR = 1e-10  # a log axis has no 0: exact zeros are drawn here (and the legend says so)


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def run_label(run_dir: Path) -> str:
    """'run <run_id> (<folder>)', the run_id read from the folder's config.yaml where there is one."""
    import yaml

    run_id = None
    try:
        run_id = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("run_id")
    except (OSError, yaml.YAMLError, AttributeError):
        pass
    return f"run {run_id} ({run_dir.name})" if run_id else f"run {run_dir.name}"


def resume_steps(rows: list[dict]) -> list[float]:
    """x positions (between the checkpoint's step and the next) where the run resumed."""
    return [r["step"] - 0.5 for r in rows if "resumed_from" in r]


def _mark_resumes(ax, rows: list[dict]) -> None:
    for i, x in enumerate(resume_steps(rows)):
        ax.axvline(
            x, color="tab:red", linestyle=":", linewidth=1.2, label="resumed from a checkpoint" if i == 0 else None
        )


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write reward.png, mismatch.png and staleness.png next to metrics.jsonl; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return []
    label = run_label(run_dir)
    out = []
    for name, make in (("reward", reward_figure), ("mismatch", mismatch_figure), ("staleness", staleness_figure)):
        fig = make(rows, label)
        out.append(run_dir / f"{name}.png")
        fig.savefig(out[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return out


def reward_figure(rows: list[dict], label: str):
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [r["reward_mean"] for r in rows]
    ax.plot(steps, rewards, marker=".", alpha=0.5, label="reward (mean over the step's samples)")
    w = 10
    if len(rewards) >= w:
        avg = [sum(rewards[i - w + 1 : i + 1]) / w for i in range(w - 1, len(rewards))]
        ax.plot(steps[w - 1 :], avg, linewidth=2, label=f"moving average ({w} steps)")
    for key, style, what in (("eval_greedy_accuracy", "s-", "greedy"), ("eval_sampled_accuracy", "^-", "sampled")):
        evals = [(r["step"], r[key]) for r in rows if key in r]
        if evals:
            ax.plot(*zip(*evals), style, markersize=4, label=f"held-out accuracy, {what} (trainer.eval_every)")
    _mark_resumes(ax, rows)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"reward per step, {label}")
    return fig


def mismatch_figure(rows: list[dict], label: str):
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]

    def series(key):
        return [mismatch_value(r, key) for r in rows]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    # The total, dashed and on top: it mostly equals the staleness part, which would hide it.
    total = "total |logp_prox - logp_behav| (mean)"
    ax.plot(steps, series("logp_abs_diff"), "k--", linewidth=1.2, zorder=5, label=total)
    ax.plot(steps, series("logp_abs_diff_stale"), ".-", label="staleness part: current vs version v (mean)")
    ax.plot(steps, series("logp_abs_diff_quant"), ".-", label="quantization part: version v vs rollout (mean)")
    if any("logp_abs_diff_quant_p50" in r for r in rows):
        ax.plot(steps, series("logp_abs_diff_quant_p50"), "--", label="quantization part, median over tokens")
        ax.plot(steps, series("logp_abs_diff_quant_p95"), "--", label="quantization part, 95th percentile")
    ax.plot(steps, series("kl_k3"), ".-", alpha=0.6, label="KL k3 (behav || prox)")
    if any(y == LOG_FLOOR for line in ax.get_lines() for y in line.get_ydata()):
        ax.axhline(
            LOG_FLOOR, color="0.6", linewidth=0.8, label=f"exact 0, drawn at {LOG_FLOOR:g} (no value: not drawn)"
        )
    _mark_resumes(ax, rows)
    ax.set_yscale("log")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("nats per completion token (log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"train / rollout mismatch, {label}")
    return fig


def mismatch_value(row: dict, key: str) -> float:
    """The value the mismatch plot draws for `key` at one step's row, on its log axis:

    1. absent, null, NaN or not a number: NaN, so the step is not drawn (absent is absent);
    2. the staleness part of a step whose samples all came from the current version
       (`staleness_max` 0, as at step 1): NaN, as there was nothing stale to measure;
    3. <= 0 (an exact 0; the k3 estimator can round slightly negative): LOG_FLOOR, which the
       legend names;
    4. otherwise the value itself.
    """
    value = row.get(key)
    if not is_number(value) or value != value:
        return float("nan")
    if key == "logp_abs_diff_stale" and row.get("staleness_max") == 0:
        return float("nan")
    return max(float(value), LOG_FLOOR)


def staleness_figure(rows: list[dict], label: str):
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    hist: dict[int, int] = {}
    for r in rows:
        for k, v in r.get("staleness_hist", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    fig, (ax_steps, ax_hist) = plt.subplots(1, 2, figsize=(11, 4))
    ax_steps.plot(steps, [r.get("staleness_mean", float("nan")) for r in rows], ".-", label="mean")
    ax_steps.plot(steps, [r.get("staleness_max", float("nan")) for r in rows], ".", alpha=0.6, label="max")
    _mark_resumes(ax_steps, rows)
    ax_steps.set_xlabel("trainer step")
    ax_steps.set_ylabel("staleness of used samples (versions)")
    ax_steps.grid(alpha=0.3)
    ax_steps.legend(fontsize=8)
    ax_steps.set_title("per step")
    if hist:
        ks = sorted(hist)
        ax_hist.bar(ks, [hist[k] for k in ks])
        ax_hist.set_xticks(ks)
    ax_hist.set_xlabel("staleness (trainer version - sample version) of used samples")
    ax_hist.set_ylabel("samples")
    ax_hist.set_title(f"histogram (dropped as stale: {rows[-1].get('dropped_stale', 0)})")
    fig.suptitle(f"staleness, {label}")
    return fig
