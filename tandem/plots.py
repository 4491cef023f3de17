"""PNG plots of a run folder's metrics.jsonl: reward, train/rollout mismatch, staleness."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write reward.png, mismatch.png and staleness.png next to metrics.jsonl; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    out = []

    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [r["reward_mean"] for r in rows]
    ax.plot(steps, rewards, marker=".", alpha=0.5, label="reward (mean over the step's samples)")
    w = 10
    if len(rewards) >= w:
        avg = [sum(rewards[i - w + 1 : i + 1]) / w for i in range(w - 1, len(rewards))]
        ax.plot(steps[w - 1 :], avg, linewidth=2, label=f"moving average ({w} steps)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"reward per step ({run_dir.name})")
    out.append(run_dir / "reward.png")
    fig.savefig(out[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (
        ("logp_abs_diff", "|logp_prox - logp_behav| (total)", "k--"),
        ("logp_abs_diff_quant", "quantization part (version v vs rollout)", ".-"),
        ("logp_abs_diff_stale", "staleness part (current vs version v)", ".-"),
        ("kl_k3", "KL k3 (behav || prox)", ".-"),
    ):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], style, label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean per completion token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("train / rollout mismatch")
    out.append(run_dir / "mismatch.png")
    fig.savefig(out[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)

    hist: dict[int, int] = {}
    for r in rows:
        for k, v in r.get("staleness_hist", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    fig, ax = plt.subplots(figsize=(6, 4))
    if hist:
        ks = sorted(hist)
        ax.bar(ks, [hist[k] for k in ks])
        ax.set_xticks(ks)
    ax.set_xlabel("staleness (trainer version - sample version) of used samples")
    ax.set_ylabel("samples")
    ax.set_title(f"staleness histogram (dropped as stale: {sum(r.get('dropped_stale', 0) for r in rows[-1:])})")
    out.append(run_dir / "staleness.png")
    fig.savefig(out[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
