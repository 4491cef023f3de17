"""Summarize `tandem run` folders of bench/run_e2e_device.sh: one table, one JSON.

    python3 bench/e2e_report.py RUN_DIR [RUN_DIR ...] [--skip 2] [--sync NAME] [--json out.json]

Per run, over the steady state (steps after the first `--skip`, i.e. past engine compilation and
the first fetches), from `metrics.jsonl`, the workers' logs and the launcher-side GPU samples
(`gpu_util.csv`, `gpu_procs.csv`, written by run_e2e_device.sh):
  wall/step      (time of the last row - time of the first steady row) / (rows - 1)
  train/step     trainer busy per step: step_time_s (recompute + GRPO update) + publish_s (the
                 publish's time on the training thread: the wait for the previous publish, the
                 quantized parts; describing, framing, hashing and serving run in the publisher's
                 thread, publish_bg_s, off the step)
  rollout/step   what the pool needs per step: groups_per_step x generating seconds per group / workers
  ideal          max(rollout/step, train/step) of the synchronous run (--sync; its two phases do not
                 overlap there, so each is measured alone) when it has the same recipe and trainer
                 backend, else of the run itself (e.g. the `megatron` run: trainer.backend=megatron)
  publish->live  per version: the slowest worker's time from the pointer (published_at) to live;
                 median and max; plus the trainer's publish_s before the pointer exists and
                 publish_announce_wait_s between the version being servable and the pointer
  tok/s          completion tokens per generating second, per worker (what the engine does while
                 it has a group) and per wall second (throughput, waits included)
  GPU idle       (1 - mean utilization.gpu / 100) x wall/step over the steady window (NVML's
                 utilization: the share of each sample period with any kernel running)
  warm start     the model's own evaluation after its warm start (model.json, bench/make_e2e_model.py:
                 reward and fraction ending in <eos>, sampled and greedy)
  traces         where the run has traces/<name>-trace-summary.json (rollout.trace and trainer.trace,
                 E2E_TRACE_AFTER_S): per worker and for the trainer, its traced steps' wall time,
                 device busy time and top kernels
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

LIVE = re.compile(
    r"(?P<worker>[\w.-]+): policy v(?P<version>\d+) live \((?P<bytes>\d+) bytes, (?P<load>[\d.]+)s, "
    r"(?P<after>[-\d.na]+|\?)s after publish\); under v(?P<prev>\w+): (?P<groups>\d+) groups, "
    r"(?P<tokens>\d+) tokens in (?P<gen>[\d.]+)s generating"
)
# The swap's split, on the same line (rollout/worker.py).
SPLIT_PARTS = ("receive", "verify", "drain_wait", "h2d", "swap")
SPLIT = re.compile(", ".join(rf"{p} (?P<{p}>[\d.]+)s" for p in SPLIT_PARTS))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def read_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def read_live(run: Path) -> list[dict]:
    out = []
    for log in sorted((run / "logs").glob("rollout-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = LIVE.search(line)
            if m:
                d = m.groupdict()
                out.append(
                    {
                        "worker": d["worker"],
                        "version": int(d["version"]),
                        "bytes": int(d["bytes"]),
                        "load_s": float(d["load"]),
                        "after_publish_s": None if d["after"] == "?" else float(d["after"]),
                        "prev": None if d["prev"] == "None" else int(d["prev"]),
                        "groups": int(d["groups"]),
                        "tokens": int(d["tokens"]),
                        "gen_s": float(d["gen"]),
                    }
                )
                split = SPLIT.search(line)
                if split:
                    out[-1].update({p + "_s": float(v) for p, v in split.groupdict().items()})
    return out


def read_gpu(run: Path, t0: float, t1: float) -> dict:
    """Mean utilization within [t0, t1] and the largest memory each process role held."""
    util = []
    path = run / "gpu_util.csv"
    if path.exists():
        for row in csv.reader(path.open()):
            try:
                t, u = float(row[0]), float(row[1])
            except (ValueError, IndexError):
                continue
            if t0 <= t <= t1:
                util.append(u)
    mem: dict[str, float] = {}
    path = run / "gpu_procs.csv"
    if path.exists():
        for row in csv.reader(path.open()):
            if len(row) < 3:
                continue
            try:
                used = float(row[2])
            except ValueError:
                continue
            role = row[1]
            mem[role] = max(mem.get(role, 0.0), used)
    return {"util_mean": _mean(util), "util_samples": len(util), "mem_mib": mem}


def summarize(run: Path, *, skip: int, groups_per_step: int | None = None) -> dict:
    rows = read_rows(run)
    if not rows:
        return {"run": run.name, "error": "no metrics.jsonl rows"}
    steady = rows[skip:] if len(rows) > skip + 1 else rows
    n = len(steady)
    wall = (steady[-1]["time"] - steady[0]["time"]) / (n - 1) if n > 1 else None
    # time of a row = end of that step (before its publish); the window starts one step earlier
    t_start = steady[0]["time"] - (wall or 0)
    # Row k's timers (step k, plus collect and the previous step's publish) cover the interval from
    # row k-1's time to row k's: the per-step means take the rows whose interval is inside the window.
    win = steady[1:] if n > 1 else steady
    cfg = _run_config(run)
    gps = groups_per_step or cfg.get("groups_per_step") or 1
    workers = cfg.get("num_rollout_workers") or 1
    first_v = steady[0]["policy_version"] - 1
    live = read_live(run)
    steady_live = [e for e in live if e["prev"] is not None and e["prev"] >= first_v]
    per_worker = {}
    for e in steady_live:
        w = per_worker.setdefault(e["worker"], {"groups": 0, "tokens": 0, "gen_s": 0.0})
        for k in ("groups", "tokens", "gen_s"):
            w[k] += e[k]
    span = steady[-1]["time"] - t_start
    for w in per_worker.values():
        w["tok_per_gen_s"] = w["tokens"] / w["gen_s"] if w["gen_s"] else None
        w["tok_per_wall_s"] = w["tokens"] / span if span > 0 else None
        w["gen_s_per_group"] = w["gen_s"] / w["groups"] if w["groups"] else None
    group_s = _mean([w["gen_s_per_group"] for w in per_worker.values()])
    rollout_per_step = gps * group_s / workers if group_s else None
    train_per_step = _mean([r["step_time_s"] + r.get("publish_s", 0.0) for r in win])
    versions = sorted({e["version"] for e in live if e["version"] > first_v})
    timed = [e for e in live if e["after_publish_s"] is not None]  # "?": the pointer had no publish time
    timed_versions = sorted({e["version"] for e in timed} & set(versions))
    slowest = [max(e["after_publish_s"] for e in timed if e["version"] == v) for v in timed_versions]
    everyone = [v for v in versions if len({e["worker"] for e in live if e["version"] == v}) == workers]
    gpu = read_gpu(run, t_start, steady[-1]["time"])
    last = rows[-1]
    return {
        "run": run.name,
        "recipe": cfg.get("recipe"),
        "backend": cfg.get("backend"),
        "max_staleness": cfg.get("max_staleness"),
        "steps": len(rows),
        "steady_steps": n,
        "wall_per_step_s": wall,
        "train_per_step_s": train_per_step,
        "step_time_s": _mean([r["step_time_s"] for r in win]),
        "recompute_s": _mean([r.get("recompute_s") for r in win]),
        "publish_s": _mean([r.get("publish_s") for r in win]),
        "snapshot_s": _mean([r.get("snapshot_s") for r in win]),  # runs before trainer.versions
        "quantize_s": _mean([r.get("quantize_s") for r in win]),
        "publish_blocked_s": _mean([r.get("publish_blocked_s") for r in steady]),
        "publish_bg_s": _mean([r.get("publish_bg_s") for r in steady]),
        "publish_announce_wait_s": _mean([r.get("publish_announce_wait_s") for r in steady]),
        "retained_bytes_max": max((r.get("retained_bytes", 0) for r in rows), default=None),
        "collect_s": _mean([r.get("collect_s") for r in win]),
        "rollout_per_step_s": rollout_per_step,
        "workers": per_worker,
        "publish_to_live_median_s": statistics.median(slowest) if slowest else None,
        "publish_to_live_max_s": max(slowest) if slowest else None,
        "versions_live_on_every_worker": f"{len(everyone)}/{len(versions)}",
        "policy_bytes": live[-1]["bytes"] if live else None,
        "load_s": _mean([e["load_s"] for e in live if e["version"] > first_v]),
        "swap_split_median_s": {
            p: statistics.median(xs) if xs else None
            for p in SPLIT_PARTS
            for xs in [[e[p + "_s"] for e in live if e["version"] > first_v and p + "_s" in e]]
        },
        "dropped_stale": last.get("dropped_stale"),
        "dropped_fingerprint": last.get("dropped_fingerprint"),
        "invalid": last.get("invalid"),
        "staleness_mean": _mean([r["staleness_mean"] for r in steady]),
        "logp_abs_diff": _mean([r["logp_abs_diff"] for r in steady]),
        "logp_abs_diff_quant": _mean([r.get("logp_abs_diff_quant") for r in steady]),
        "logp_abs_diff_quant_p50": _mean([r.get("logp_abs_diff_quant_p50") for r in steady]),
        "logp_abs_diff_stale": _mean([r.get("logp_abs_diff_stale") for r in steady]),
        # per-token versions (loop.inflight_updates): staleness by token, and what ran on older KV
        "token_staleness_mean": _mean([r.get("token_staleness_mean") for r in steady]),
        "tokens_over_max_staleness_frac_max": max(
            (r.get("tokens_over_max_staleness_frac", 0.0) for r in rows), default=None
        ),
        "samples_multi_version": _mean([r.get("samples_multi_version") for r in steady]),
        "tokens_on_stale_kv": _mean([r.get("tokens_on_stale_kv") for r in steady]),
        "logp_abs_diff_stale_kv": _mean([r.get("logp_abs_diff_stale_kv") for r in steady]),
        "reward_mean": _mean([r["reward_mean"] for r in rows]),
        "completion_tokens_per_step": _mean([r["completion_tokens"] for r in steady]),
        "benchmark_ignore_stop": any(r.get("benchmark_ignore_stop") for r in rows),
        "gpu_util_mean": gpu["util_mean"],
        "gpu_idle_per_step_s": (1 - gpu["util_mean"] / 100) * wall if gpu["util_mean"] is not None and wall else None,
        "gpu_mem_mib": gpu["mem_mib"],
        "warmstart_eval": _model_eval(run),
    }


def _model_eval(run: Path) -> dict | None:
    """The warm start's evaluation that bench/make_e2e_model.py wrote (model.json), or None."""
    path = run / "model.json"
    try:
        return json.loads(path.read_text()).get("eval") if path.exists() else None
    except (json.JSONDecodeError, AttributeError):
        return None


def _run_config(run: Path) -> dict:
    """The few keys of the resolved config.yaml the report needs."""
    import yaml

    path = run / "config.yaml"
    if not path.exists():
        return {}
    cfg = yaml.safe_load(path.read_text()) or {}
    return {
        "recipe": cfg.get("recipe"),
        "backend": (cfg.get("trainer") or {}).get("backend", "torch"),
        "num_rollout_workers": cfg.get("num_rollout_workers"),
        "max_staleness": (cfg.get("loop") or {}).get("max_staleness"),
        "groups_per_step": (cfg.get("trainer") or {}).get("groups_per_step"),
    }


def _fmt(x, spec=".2f"):
    return "—" if x is None else format(x, spec)


def table(reports: list[dict], sync: dict | None) -> str:
    ideal_src = sync or {}
    lines = [
        "| run | recipe | staleness | wall/step s | train/step s (step + publish) | rollout/step s | ideal s | "
        "wall / ideal | publish→live s (median / max) | tok/s per worker (generating / wall) | dropped stale | "
        "fingerprint | quant / stale \\|Δlogp\\| | GPU util % | GPU idle/step s |",
        "|" + "---|" * 15,
    ]
    for r in reports:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['error']} |" + " |" * 13)
            continue
        # the synchronous run's phases, of the same recipe, measured without overlap; else the run's own
        same = (
            ideal_src
            and "error" not in ideal_src
            and (ideal_src.get("recipe"), ideal_src.get("backend")) == (r.get("recipe"), r.get("backend"))
        )
        src = ideal_src if same else r
        ideal = max(x for x in (src.get("rollout_per_step_s"), src.get("train_per_step_s")) if x is not None) \
            if (src.get("rollout_per_step_s") or src.get("train_per_step_s")) else None  # fmt: skip
        r["ideal_per_step_s"] = ideal
        r["wall_over_ideal"] = r["wall_per_step_s"] / ideal if ideal and r["wall_per_step_s"] else None
        tok = ", ".join(
            f"{w}: {_fmt(v['tok_per_gen_s'], ',.0f')} / {_fmt(v['tok_per_wall_s'], ',.0f')}"
            for w, v in sorted(r["workers"].items())
        )
        lines.append(
            f"| {r['run']} | {r['recipe']}{'' if r.get('backend') in (None, 'torch') else ' (' + r['backend'] + ')'} | "
            f"{r['max_staleness']} | {_fmt(r['wall_per_step_s'])} | "
            f"{_fmt(r['train_per_step_s'])} ({_fmt(r['step_time_s'])} + {_fmt(r['publish_s'])}) | "
            f"{_fmt(r['rollout_per_step_s'])} | {_fmt(ideal)} | {_fmt(r['wall_over_ideal'])} | "
            f"{_fmt(r['publish_to_live_median_s'])} / {_fmt(r['publish_to_live_max_s'])} | {tok or '—'} | "
            f"{r['dropped_stale']} | {r['dropped_fingerprint']} | {_fmt(r['logp_abs_diff_quant'], '.1e')} / "
            f"{_fmt(r['logp_abs_diff_stale'], '.1e')} | {_fmt(r['gpu_util_mean'], '.0f')} | "
            f"{_fmt(r['gpu_idle_per_step_s'])} |"
        )
    flagged = [r["run"] for r in reports if r.get("benchmark_ignore_stop")]
    if flagged:
        lines.append(
            f"\nBENCHMARK ONLY ({', '.join(flagged)}): completions ignored their stop token (rollout.ignore_stop), "
            "so every one runs to task.max_new_tokens; rewards there say nothing about learning."
        )
    return "\n".join(lines)


def traces(runs: list[Path]) -> str:
    """One row per traced service (policy/tracing.py's summary); "" when no run has traces."""
    rows = []
    for run in runs:
        for f in sorted((run / "traces").glob("*-trace-summary.json")):
            t = json.loads(f.read_text())
            top = "; ".join(f"{k['name'][:40]} {k['ms_per_step']:.2f}" for k in t["top_kernels"][:3])
            rows.append(
                f"| {run.name} | {t['name']} | {t['steps']} | {t['step_wall_ms_median']:.1f} | "
                f"{t['device_busy_ms_per_step']:.1f} ({t['device_busy_frac']:.0%}) | {top or '—'} | "
                f"{t['affinity']['process']} |"
            )
    if not rows:
        return ""
    head = (
        "| run | service | steps | wall ms/step (median) | device busy ms/step | top kernels (ms/step) | CPUs |\n"
        "|---|---|---|---|---|---|---|"
    )
    return "\n".join(["\nTraced steps of each service (rollout.trace, trainer.trace):\n", head, *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the steady state")
    ap.add_argument("--sync", help="the run folder name whose rollout and train times give the ideal overlap")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    missing = [str(r) for r in args.runs if not r.is_dir()]
    if missing:
        print(f"e2e_report: no such run folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    reports = [summarize(r, skip=args.skip) for r in args.runs]
    sync = next((r for r in reports if r["run"] == args.sync), None)
    print(table(reports, sync))
    if traced := traces(args.runs):
        print(traced)
    seen = []  # the runs share one model folder: its evaluation once
    for r in reports:
        ev = r.get("warmstart_eval")
        if ev and ev not in seen:
            seen.append(ev)
            print(f"\nwarm start of the model ({r['run']}'s model.json): " + "; ".join(
                f"{k} reward {v['reward_mean']:.3f}, ended with <eos> {v['eos_frac']:.2f}, mean length {v['mean_len']:.1f}"
                for k, v in ev.items() if isinstance(v, dict)))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
