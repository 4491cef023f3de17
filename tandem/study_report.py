"""A study's report: DIR/summary.csv (one row per run), DIR/report.md and its PNGs.

The numbers, per run, from its metrics.jsonl (n steps):
    final_reward      = mean of reward_mean over the last k = ceil(0.1 n) steps
    reward_change     = final_reward - (mean over the first k steps)
    logp_abs_diff, logp_abs_diff_quant, logp_abs_diff_stale, kl_k3, staleness_mean,
    logp_abs_diff_quant_p50, router_agree_frac, step_time_s
                      = means over the steps that report them (a part no step could split, or router
                        agreement without routing replay, is left empty, never NaN)
    dropped_stale_frac = dropped_stale / (dropped_stale + samples used), counts of the whole run
    grad_norm_spikes  = #{i : grad_norm_i > 5 * median(grad_norm_0 .. grad_norm_{i-1})}, i >= 3
and, against the bf16 run with the same config otherwise (same staleness and seed, the precision keys
`recipe`, `rollout_recipe`, `keep_bf16`, `trainer.backward` aside), per group of seeds:
    d_s = final_reward(run, seed s) - final_reward(bf16, seed s)
    mean(d) +- t_{0.975, m-1} * sd(d) / sqrt(m)        (m paired seeds; no interval for m = 1)
"""

from __future__ import annotations

import csv
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from . import config as run_config
from .study import Study, StudyRun, command_line, commit, read_jsonl, run_state

# Two-sided 95% quantiles of Student's t, t_{0.975, df} for df = 1..30 (above 30: 1.96 is within 4%).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
MISMATCH_KEYS = ("logp_abs_diff", "logp_abs_diff_quant", "logp_abs_diff_stale", "kl_k3")
# Train-inference consistency and its cost (exact mode, routing replay): per-step means too.
CONSISTENCY_KEYS = ("logp_abs_diff_quant_p50", "router_agree_frac", "step_time_s")
# The config keys of the staleness bound and the seed (summary columns `max_staleness` and `seed`).
STALENESS_KEY, SEED_KEY = "loop.max_staleness", "loop.seed"
# Keys that set the precision of a run: the bf16 baseline of a run differs from it in these only.
PRECISION_KEYS = ("recipe", "rollout_recipe", "keep_bf16", "trainer.backward")
SUMMARY_TAIL = (
    "final_reward",
    "reward_change",
    *MISMATCH_KEYS,
    *CONSISTENCY_KEYS,
    "staleness_mean",
    "dropped_stale_frac",
    "grad_norm_spikes",
    "wall_time_s",
    "steps",
    "status",
    "folder",
)


# ------------------------------------------------------------------------------ pure statistics


def head_tail_means(values: list[float], frac: float = 0.1) -> tuple[float, float]:
    """(mean of the first k values, mean of the last k), k = ceil(frac * n), at least 1."""
    k = max(1, math.ceil(frac * len(values)))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def grad_norm_spikes(norms: list[float], factor: float = 5.0, min_history: int = 3) -> int:
    """Steps whose grad norm exceeds `factor` times the median of all earlier steps' (from step
    `min_history` on, so that a median exists)."""
    return sum(1 for i in range(min_history, len(norms)) if norms[i] > factor * statistics.median(norms[:i]))


def t_interval(diffs: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of the 95% t interval); half-width None for fewer than 2 values."""
    m = statistics.fmean(diffs)
    if len(diffs) < 2:
        return m, None
    t = T975[len(diffs) - 2] if len(diffs) - 1 <= len(T975) else 1.96
    return m, t * statistics.stdev(diffs) / math.sqrt(len(diffs))


def moving_average(values: list[float], w: int) -> list[float]:
    """Trailing mean over up to `w` values (shorter at the start)."""
    return [statistics.fmean(values[max(0, i - w + 1) : i + 1]) for i in range(len(values))]


# ------------------------------------------------------------------------------ per-run summary


def _get(cfg: dict, dotted: str):
    for k in dotted.split("."):
        if not isinstance(cfg, dict) or k not in cfg:
            return None
        cfg = cfg[k]
    return cfg


def summarize_run(run: StudyRun, run_dir: Path) -> dict:
    """The summary row of one run (metrics missing: status only)."""
    resolved = run_config.from_dict(run.config)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    done = run_state(run_dir) == "done"
    out = {
        "name": run.name,
        "recipe": resolved.recipe,
        "rollout_recipe": resolved.rollout_recipe or resolved.recipe,
        "contract_breaking": resolved.contract_breaking,
        "max_staleness": _get(resolved.to_dict(), STALENESS_KEY),
        "seed": _get(resolved.to_dict(), SEED_KEY),
        "status": "done" if done else ("partial" if rows else "missing"),
        "steps": len(rows),
        "folder": run_dir.name,
    }
    if rows:
        start, final = head_tail_means([r["reward_mean"] for r in rows])
        used = sum(r["samples"] for r in rows)
        dropped = rows[-1]["dropped_stale"]
        attempts = read_jsonl(run_dir / "attempts.jsonl")
        out.update(
            final_reward=final,
            reward_change=final - start,
            **{k: _mean_of(r.get(k) for r in rows) for k in (*MISMATCH_KEYS, *CONSISTENCY_KEYS, "staleness_mean")},
            dropped_stale_frac=dropped / max(1, dropped + used),
            grad_norm_spikes=grad_norm_spikes([r["grad_norm"] for r in rows]),
            wall_time_s=sum(a["end"] - a["start"] for a in attempts),
        )
        if any(r.get("contract_breaking") != resolved.contract_breaking for r in rows):
            out["status"] += " (metrics rows disagree with the config's contract_breaking)"
    return out


def summary_columns(runs: list[StudyRun]) -> list[str]:
    """name, recipe, rollout_recipe, contract_breaking, every other key of the study, the numbers."""
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r.keys if k not in keys and k not in ("recipe", "rollout_recipe", STALENESS_KEY, SEED_KEY)]
    return ["name", "recipe", "rollout_recipe", "contract_breaking", "max_staleness", "seed", *keys, *SUMMARY_TAIL]


def summary_rows(runs: list[StudyRun], out: Path) -> list[dict]:
    rows = []
    for r in runs:
        row = summarize_run(r, out / (r.alias_of or r.name))
        row["name"] = r.name
        for k in r.keys:
            if k not in (STALENESS_KEY, SEED_KEY):
                row.setdefault(k, _get(r.config, k))
        if r.alias_of:
            row["status"] += f" (same run as {r.alias_of})"
        rows.append(row)
    return rows


def _baseline_key(run: StudyRun) -> str:
    """The run's resolved config with the precision keys and run_id blanked: equal for a run and its bf16 baseline."""
    d = run_config.from_dict(run.config).to_dict()
    d.pop("run_id")
    d.pop("recipe")
    d.pop("rollout_recipe")
    d.pop("keep_bf16")
    d["trainer"].pop("backward")
    return yaml.safe_dump(d, sort_keys=True)


def group_label(run: StudyRun) -> str:
    """Seeds of one setting share a label: the run's keys without `seed`."""
    keys = {k: v for k, v in run.keys.items() if k != SEED_KEY}
    if run.named:
        return run.name
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in keys.items()) or run.name


def versus_bf16(runs: list[StudyRun], rows: list[dict]) -> list[dict]:
    """Per setting (group of seeds) of a non-bf16 run: final reward minus the paired bf16 run's."""
    by_name = {r["name"]: r for r in rows}
    base: dict[tuple[str, int], dict] = {}
    for run, row in zip(runs, rows):
        if row["recipe"] == "bf16" and not row["contract_breaking"] and "final_reward" in row:
            base.setdefault((_baseline_key(run), row["seed"]), row)
    groups: dict[str, list[tuple[dict, dict]]] = {}
    for run, row in zip(runs, rows):
        if (row["recipe"] == "bf16" and not row["contract_breaking"]) or "final_reward" not in row:
            continue
        b = base.get((_baseline_key(run), row["seed"]))
        if b is not None and b["name"] != row["name"]:
            groups.setdefault(group_label(run), []).append((by_name[row["name"]], b))
    out = []
    for label, pairs in groups.items():
        mean, half = t_interval([r["final_reward"] - b["final_reward"] for r, b in pairs])
        out.append(
            {
                "setting": label,
                "recipe": pairs[0][0]["recipe"],
                "rollout_recipe": pairs[0][0]["rollout_recipe"],
                "contract_breaking": pairs[0][0]["contract_breaking"],
                "max_staleness": pairs[0][0]["max_staleness"],
                "seeds": len(pairs),
                "final_reward": statistics.fmean(r["final_reward"] for r, _ in pairs),
                "bf16_final_reward": statistics.fmean(b["final_reward"] for _, b in pairs),
                "diff": mean,
                "ci95": half,
                "baseline": ", ".join(sorted({b["name"] for _, b in pairs})),
            }
        )
    return out


# ------------------------------------------------------------------------------ plots


def _panels(runs, rows):
    """recipe label -> group label -> [(run, row)] of runs with metrics."""
    out: dict[str, dict[str, list]] = {}
    for run, row in zip(runs, rows):
        if "final_reward" not in row:
            continue
        panel = row["recipe"] + (f" -> rollout {row['rollout_recipe']}" if row["contract_breaking"] else "")
        out.setdefault(panel, {}).setdefault(group_label(run), []).append((run, row))
    return out


def _log_axis(ax, values: list[float]) -> None:
    """A log axis (symlog when some value is 0: the staleness part at max_staleness 0); None: no value."""
    values = [v for v in values if v is not None]
    positive = [v for v in values if v > 0]
    if not positive:
        return
    if len(positive) == len(values):
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=min(positive) / 2)
        if min(values) >= 0:
            ax.set_ylim(bottom=0)  # |Δ log p| is never negative: no empty mirror half


LEGEND_INSIDE = 6  # more series than this: one legend below the panels instead of one per panel


LEGEND_FONTSIZE = 9  # readable in a report at the PNGs' size


def figures(study: Study, runs: list[StudyRun], rows: list[dict], out: Path) -> list[tuple[str, Any]]:
    """The report's figures as (file name, matplotlib Figure): reward curves per recipe; mismatch, KL
    and dropped fraction against max_staleness (when the grid varies it); the named runs' mismatch.
    Every figure has a title naming the study; steps and staleness axes have integer ticks only."""
    import matplotlib

    matplotlib.use("Agg")
    panels = _panels(runs, rows)
    if not panels:
        return []
    return [
        ("reward_curves.png", _reward_curves(study, panels, out)),
        *_versus_staleness(study, panels),
        *_named_runs(study, runs, rows),
    ]


def _plots(study: Study, runs: list[StudyRun], rows: list[dict], out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in figures(study, runs, rows, out):
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return paths


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _reward_curves(study: Study, panels: dict, out: Path):
    """One panel per recipe, one curve per setting, mean +- std over seeds."""
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(3, n)
    fig, axes = plt.subplots(
        (n + cols - 1) // cols, cols, figsize=(5.5 * cols, 3.8 * ((n + cols - 1) // cols)), layout="constrained"
    )
    axes = [axes] if n == 1 else list(getattr(axes, "flat", axes))
    for ax, (panel, groups) in zip(axes, panels.items()):
        for label, members in groups.items():
            curves = []
            for run, _ in members:
                rewards = [r["reward_mean"] for r in read_jsonl(out / (run.alias_of or run.name) / "metrics.jsonl")]
                curves.append(moving_average(rewards, max(1, len(rewards) // 10)))
            steps = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(steps)]
            std = [statistics.pstdev([c[i] for c in curves]) for i in range(steps)]
            x = list(range(1, steps + 1))
            (line,) = ax.plot(x, mean, label=f"{label} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=line.get_color(), alpha=0.2)  # fmt: skip
        ax.set_title(panel)
        ax.set_xlabel("trainer step")
        _integer_ticks(ax.xaxis)
        ax.set_ylabel("reward (trailing mean, 10% of steps)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=LEGEND_FONTSIZE)
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(f"{study.name}: reward, mean ± std over seeds")
    return fig


def _versus_staleness(study: Study, panels: dict) -> list[tuple[str, Any]]:
    """Grid settings that vary max_staleness: mismatch parts, KL and dropped fraction against it."""
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, list[dict]]] = {}
    for panel, groups in panels.items():
        for _, members in groups.items():
            for run, row in members:
                if run.named:
                    continue
                other = {k: v for k, v in run.keys.items() if k not in (SEED_KEY, STALENESS_KEY, "recipe")}
                label = panel + ("".join(f", {k.rsplit('.', 1)[-1]}={v}" for k, v in other.items()))
                series.setdefault(label, {}).setdefault(row["max_staleness"], []).append(row)
    if not series:
        return []
    specs = (
        ("mismatch_vs_staleness.png", ("logp_abs_diff_quant", "logp_abs_diff_stale", "logp_abs_diff"),
         "mean |Δ log p| per token", "train / rollout mismatch"),
        ("kl_vs_staleness.png", ("kl_k3",), "KL k3 (behaviour || proximal), mean over steps", "KL"),
        ("dropped_vs_staleness.png", ("dropped_stale_frac",), "fraction of samples dropped as stale",
         "samples dropped as stale"),
        ("router_agreement_vs_staleness.png", ("router_agree_frac",),
         "(token, MoE layer) pairs where the trainer's router\npicks the replayed experts", "router agreement"),
    )  # fmt: skip
    out = []
    for fname, keys, ylabel, what in specs:
        if not any(r.get(k) is not None for by_s in series.values() for rs in by_s.values() for r in rs for k in keys):
            continue  # router agreement without routing replay: nothing to plot
        below = 0.3 * math.ceil(len(series) / 3) if len(series) > LEGEND_INSIDE else 0  # the legend's rows
        fig, axes = plt.subplots(1, len(keys), figsize=(max(11, 5.5 * len(keys)), 3.8 + below), squeeze=False,
                                 layout="constrained")  # fmt: skip
        for ax, key in zip(axes[0], keys):
            for label, by_s in series.items():
                xs = [s for s in sorted(by_s) if any(r[key] is not None for r in by_s[s])]
                if not xs:
                    continue
                ys = [_mean_of(r[key] for r in by_s[s]) for s in xs]
                es = [statistics.pstdev([r[key] for r in by_s[s] if r[key] is not None]) for s in xs]
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
            ax.set_xlabel("max_staleness")
            ax.set_xticks(sorted({s for by_s in series.values() for s in by_s}))
            ax.set_ylabel(ylabel)
            if key.startswith("logp_abs_diff"):  # the quantization part can be 1e-7 beside 1e-1
                _log_axis(ax, [r[key] for by_s in series.values() for rs in by_s.values() for r in rs])
            ax.set_title(key)
            ax.grid(alpha=0.3)
            if len(series) <= LEGEND_INSIDE:
                ax.legend(fontsize=LEGEND_FONTSIZE)
        if len(series) > LEGEND_INSIDE:
            fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncols=3,
                       fontsize=LEGEND_FONTSIZE)  # fmt: skip
        fig.suptitle(f"{study.name}: {what} against max_staleness, mean ± std over seeds")
        out.append((fname, fig))
    return out


def _named_runs(study: Study, runs: list[StudyRun], rows: list[dict]) -> list[tuple[str, Any]]:
    """The named runs (the ablations): the mismatch parts side by side."""
    import matplotlib.pyplot as plt

    named = [(run, row) for run, row in zip(runs, rows) if run.named and "final_reward" in row]
    if not named:
        return []
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(named)), 4))
    width = 0.4
    for j, (key, label) in enumerate(
        (("logp_abs_diff_quant", "quantization part"), ("logp_abs_diff_stale", "staleness part"))
    ):
        ax.bar([i + (j - 0.5) * width for i in range(len(named))], [row[key] or 0.0 for _, row in named], width,
               label=label)  # fmt: skip
    ax.set_xticks(range(len(named)))
    ax.set_xticklabels(
        [run.name + (" [contract broken]" if row["contract_breaking"] else "") for run, row in named],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    ax.set_ylabel("mean |Δ log p| per token")
    _log_axis(ax, [row[k] for _, row in named for k in ("logp_abs_diff_quant", "logp_abs_diff_stale")])
    ax.set_title(f"{study.name}: mismatch of the named runs")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=LEGEND_FONTSIZE)
    return [("mismatch_named_runs.png", fig)]


# ------------------------------------------------------------------------------ the report


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"{cpu}; {len(os.sched_getaffinity(0))} CPUs usable of {os.cpu_count()}; {platform.system()} "
        f"{platform.release()}; Python {platform.python_version()}; torch {torch.__version__}"
    )


def run_commits(runs: list[StudyRun], out: Path) -> list[str]:
    """The commits the runs' attempts ran at (attempts.jsonl), in order of first use."""
    seen: dict[str, None] = {}
    for r in runs:
        for a in read_jsonl(out / (r.alias_of or r.name) / "attempts.jsonl"):
            seen.setdefault(a.get("commit", "unknown"), None)
    return list(seen) or ["none recorded"]


def _mean_of(values) -> float | None:
    """The mean of the values that are numbers (a metric absent from some rows); None if none is."""
    xs = [v for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _table(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(study: Study, runs: list[StudyRun], out: Path, command: str | None = None) -> Path:
    """summary.csv, the PNGs and report.md in `out`; returns report.md's path."""
    rows = summary_rows(runs, out)
    columns = summary_columns(runs)
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    pngs = _plots(study, runs, rows, out)
    lines = [
        *_report_header(study, runs, rows, out, command),
        *_versus_section(versus_bf16(runs, rows)),
        *_runs_section(columns, rows, pngs),
        *_configs_section(study, runs),
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def _report_header(study: Study, runs: list[StudyRun], rows: list[dict], out: Path, command: str | None) -> list:
    """The title, the description, what wrote the report and ran the runs, where, how many finished."""
    cmd = command or command_line()
    ran = list(dict.fromkeys(c["command"] for c in read_jsonl(out / "commands.jsonl"))) or ["none recorded"]
    lines = [
        f"# Study `{study.name}`",
        "",
        study.description,
        "",
        f"- Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `tandem study`.",
        f"- Command writing this report: `{cmd}`; the runs were run by: " + ", ".join(f"`{c}`" for c in ran),
        f"- Commit writing this report: `{commit()}`; the runs ran at: "
        + ", ".join(f"`{c}`" for c in run_commits(runs, out)),
        f"- Machine: {machine()}",
        f"- Runs: {len(rows)} ({sum(r['status'].startswith('done') for r in rows)} finished).",
    ]
    breaking = [r["name"] for r in rows if r["contract_breaking"]]
    if breaking:
        lines.append(
            f"- **Contract-breaking ablations** (trainer and rollouts on different recipes, the `rollout_recipe` "
            f"knob): {', '.join(breaking)}. Their mismatch is by design, not a contract failure."
        )
    return lines


_VERSUS_COLUMNS = [
    "setting",
    "recipe",
    "rollout_recipe",
    "max_staleness",
    "seeds",
    "final_reward",
    "bf16_final_reward",
    "diff",
    "ci95",
    "baseline",
]


def _versus_section(vs: list[dict]) -> list:
    """Final reward of each setting against its bf16 run (`versus_bf16`), as a table."""
    lines = ["", "## Final reward against the bf16 run of the same staleness", ""]
    if not vs:
        return [*lines, "No run has a bf16 run with the same configuration otherwise."]
    shown = [
        {
            **v,
            "ci95": "n/a (1 seed)" if v["ci95"] is None else f"±{v['ci95']:.3f}",
            "rollout_recipe": v["rollout_recipe"] + (" (contract broken)" if v["contract_breaking"] else ""),
        }
        for v in vs
    ]
    return [
        *lines,
        "Final reward = mean over the last 10% of steps; difference paired by seed, with a 95% t interval "
        "over seeds (none with one seed).",
        "",
        _table(_VERSUS_COLUMNS, shown),
    ]


def _runs_section(columns: list[str], rows: list[dict], pngs: list[Path]) -> list:
    """The figures, then every run's means (the table of summary.csv)."""
    return [
        "",
        "## Figures",
        "",
        *(f"![{p.stem}]({p.name})" for p in pngs),
        "",
        "## Every run",
        "",
        "Means over all steps; `dropped_stale_frac` = dropped as stale / (dropped + used); `grad_norm_spikes` = "
        "steps with grad norm above 5× the median of the earlier steps. The same numbers are in `summary.csv`.",
        "",
        _table(columns[:-1], rows),
    ]


def _configs_section(study: Study, runs: list[StudyRun]) -> list:
    """The study config as resolved and the first run's resolved config, as YAML blocks."""
    base_cfg = run_config.dump(run_config.from_dict(runs[0].config))
    return [
        "",
        "## Configs",
        "",
        "The study config as resolved (command-line overrides applied):",
        "",
        "```yaml",
        yaml.safe_dump(study.source, sort_keys=False).rstrip(),
        "```",
        "",
        f"Every run is the base config `{study.source['base']}` + `set` + its own keys (above); the first run, "
        "resolved (each run folder's `config.yaml` holds its own):",
        "",
        "```yaml",
        base_cfg.rstrip(),
        "```",
        "",
    ]
