"""Per-step metrics: one JSON object per line in metrics.jsonl, a Prometheus endpoint, and the
writers of `logging:` (TensorBoard, W&B; `make_writers`), each fed every row's numbers.

Prometheus (names per the conventions: `_total` counters, `_seconds`, units in every HELP):
- counters `tandem_trainer_<name>_total` for every integer counter of the trainer's State
  (samples, completion tokens, drops, versions published, ...): read from State at scrape time,
  so after a restart they continue from the checkpoint's totals;
- gauges `tandem_trainer_step` and `tandem_trainer_policy_version`, present from start-up;
- gauges of the last step's numbers (reward, staleness, mismatch, ...; table GAUGES);
- histogram `tandem_trainer_step_seconds` of the optimizer step's wall time;
- the default process collector (CPU seconds, memory, file descriptors).
`progress_line` is the row as the console shows it, one line per step.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from broker.metrics import MetricsEndpoint
from policy.fields import is_int, is_number

from .config import LoggingConfig, WandbConfig

# metrics.jsonl key -> (Prometheus gauge name, HELP). Cumulative quantities are counters instead.
GAUGES = {
    "reward_mean": ("tandem_trainer_reward_mean", "mean reward of the last step's samples (task units, 0..1)"),
    "staleness_mean": ("tandem_trainer_staleness_mean", "mean staleness of the last step's samples (versions)"),
    "staleness_max": ("tandem_trainer_staleness_max", "largest staleness among the last step's samples (versions)"),
    "logp_abs_diff": (
        "tandem_trainer_logp_abs_diff",
        "mean |log p_trainer - log p_rollout| per completion token, last step (nats)",
    ),
    "logp_abs_diff_quant": (
        "tandem_trainer_logp_abs_diff_quant",
        "quantization part of the mismatch: trainer under the sample's version vs rollout, mean per token (nats)",
    ),
    "logp_abs_diff_quant_p50": (
        "tandem_trainer_logp_abs_diff_quant_p50",
        "median over the last step's tokens of the quantization part |logp_version - logp_rollout| (nats)",
    ),
    "logp_abs_diff_quant_p95": (
        "tandem_trainer_logp_abs_diff_quant_p95",
        "95th percentile over the last step's tokens of the quantization part (nats)",
    ),
    "logp_abs_diff_stale": (
        "tandem_trainer_logp_abs_diff_stale",
        "staleness part of the mismatch: current vs the sample's version, mean per token (nats)",
    ),
    "logp_abs_diff_stale_kv": (
        "tandem_trainer_logp_abs_diff_stale_kv",
        "|trainer under the token's version - rollout| over tokens sampled on KV of an older version "
        "(loop.inflight_updates), mean per token, last step (nats)",
    ),
    "token_staleness_mean": (
        "tandem_trainer_token_staleness_mean",
        "mean over the last step's completion tokens of trainer version - the token's version (versions)",
    ),
    "tokens_over_max_staleness_frac": (
        "tandem_trainer_tokens_over_max_staleness_frac",
        "fraction of the last step's completion tokens more than loop.max_staleness versions old (0..1; 0 by admission)",
    ),
    "samples_multi_version": (
        "tandem_trainer_samples_multi_version",
        "samples of the last step whose tokens span more than one version (loop.inflight_updates) (samples)",
    ),
    "tokens_on_stale_kv": (
        "tandem_trainer_tokens_on_stale_kv",
        "completion tokens of the last step sampled on KV an older version computed (tokens)",
    ),
    "kl_k3": ("tandem_trainer_kl_k3", "k3 estimate of KL(rollout || trainer) per completion token, last step (nats)"),
    "grad_norm": (
        "tandem_trainer_grad_norm",
        "L2 gradient norm before clipping, mean over the last step's updates (unitless)",
    ),
    "clip_frac": ("tandem_trainer_clip_frac", "fraction of tokens whose PPO ratio was clipped, last step (0..1)"),
    "tis_frac": ("tandem_trainer_tis_frac", "fraction of tokens whose importance weight hit the cap, last step (0..1)"),
    "step_time_s": ("tandem_trainer_last_step_seconds", "wall time of the last optimizer step (seconds)"),
    "lr": ("tandem_trainer_learning_rate", "learning rate of the last optimizer step (trainer.lr_schedule; unitless)"),
    "eval_greedy_accuracy": (
        "tandem_trainer_eval_greedy_accuracy",
        "greedy accuracy on held-out prompts at the last evaluation (0..1)",
    ),
    "eval_sampled_accuracy": (
        "tandem_trainer_eval_sampled_accuracy",
        "sampled accuracy (loop.temperature) on held-out prompts at the last evaluation (0..1)",
    ),
    "outstanding_groups": (
        "tandem_trainer_outstanding_groups",
        "prompt groups fed and not yet used or dropped, after the last step (groups)",
    ),
}

# State counter -> HELP. A State counter missing here is still exported, with a generic HELP.
COUNTER_HELP = {
    "samples": "trajectories used in optimizer steps (samples)",
    "completion_tokens": "completion tokens trained on (tokens)",
    "dropped_stale": "samples dropped as staler than max_staleness (samples)",
    "dropped_fingerprint": "samples dropped and dead-lettered for a foreign contract fingerprint (samples)",
    "dead_lettered": "stream entries moved to the dead-letter stream (entries)",
    "malformed": "undecodable trajectory entries dead-lettered (entries)",
    "invalid": "well-formed but invalid trajectories dead-lettered (samples)",
    "duplicates": "trajectories delivered again after being used, acked without training (samples)",
    "versions_published": "policy versions published (versions)",
    "unsigned": "trajectory entries without a valid run-secret signature, dead-lettered (entries)",
    "refed": "prompt groups fed again because Redis lost them (groups)",
    "prompts_dead_lettered": "fed prompt groups the rollout workers dead-lettered, settled as dropped (groups)",
    "prompt_seq": "prompt groups fed since the run began: the prompt sequence position (groups)",
}
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class MetricWriter(Protocol):
    """What MetricsSink feeds every row to, after metrics.jsonl."""

    def write(self, row: dict) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers by key: `step`, bools, text and nested values left out."""
    return {k: float(v) for k, v in row.items() if k != "step" and is_number(v)}


class TensorBoardWriter:
    """Every number of a row as a scalar at its step, in TensorBoard event files under `folder`."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(folder))

    def write(self, row: dict) -> None:
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, row["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """Every number of a row logged at its step to a W&B run under `folder`/wandb (offline: no network)."""

    def __init__(self, cfg: WandbConfig, folder: Path, *, name: str, config: dict):
        if cfg.mode == "offline":  # its core's logs and staging too, unless the user placed them
            os.environ.setdefault("WANDB_CACHE_DIR", str(Path(folder) / "wandb" / "cache"))
            os.environ.setdefault("WANDB_DATA_DIR", str(Path(folder) / "wandb" / "data"))
        import wandb

        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True)
        self._run = wandb.init(
            project=cfg.project, name=name, mode=cfg.mode, dir=str(folder), config=config, settings=settings
        )

    def write(self, row: dict) -> None:
        self._run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self._run.finish()


WRITER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # config key -> package it imports


def check_writers(cfg: LoggingConfig) -> None:
    """ValueError naming the key and the package when a writer is on and its library is missing."""
    wanted = [key for key, on in (("tensorboard", cfg.tensorboard), ("wandb", cfg.wandb.enabled)) if on]
    for key in wanted:
        try:
            importlib.import_module(WRITER_PACKAGES[key])
        except ImportError:
            pkg = WRITER_PACKAGES[key]
            raise ValueError(
                f"logging.{key}{'.enabled' if key == 'wandb' else ''}=true needs the {pkg} package, which is not "
                f"installed (pip install {pkg})"
            ) from None


def make_writers(cfg: LoggingConfig, run_dir: Path, *, name: str, config: dict) -> list[MetricWriter]:
    """The writers `cfg` turns on: tensorboard/ and wandb/ in the run folder."""
    check_writers(cfg)
    writers: list[MetricWriter] = []
    if cfg.tensorboard:
        writers.append(TensorBoardWriter(Path(run_dir) / "tensorboard"))
    if cfg.wandb.enabled:
        writers.append(WandbWriter(cfg.wandb, Path(run_dir), name=name, config=config))
    return writers


class MetricsSink:
    def __init__(
        self,
        path: Path,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        state: Callable[[], dict] | None = None,
        writers: Sequence[MetricWriter] = (),
    ):
        """port: -1 = no Prometheus endpoint, 0 = a free port (see `.port`), else that port.
        state: returns the trainer's State as a dict; its integers are exported (see module doc).
        writers: fed every row after metrics.jsonl (closed with the sink)."""
        self.writers = list(writers)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self.endpoint = MetricsEndpoint(port, host) if port >= 0 else None
        self.port = self.endpoint.port if self.endpoint else None
        if self.endpoint is None:
            return
        import prometheus_client as prom

        reg = self.endpoint.registry
        self._gauges = {k: prom.Gauge(name, help_text, registry=reg) for k, (name, help_text) in GAUGES.items()}
        self._step_seconds = prom.Histogram(
            "tandem_trainer_step_seconds",
            "wall time of one optimizer step (seconds)",
            buckets=STEP_BUCKETS,
            registry=reg,
        )
        if state is not None:
            self.endpoint.add_callback(lambda: state_samples(state()))

    def write(self, row: dict) -> None:
        """Append `row`; set the gauge of every GAUGES key it has (a key it lacks, a mean over no
        sample, leaves its gauge at the last step that had one: a gauge is never set to NaN)."""
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for writer in self.writers:
            writer.write(row)
        if self.endpoint is None:
            return
        for key, gauge in self._gauges.items():
            if isinstance(row.get(key), (int, float)):
                gauge.set(row[key])
        if "step_time_s" in row:
            self._step_seconds.observe(row["step_time_s"])

    def close(self) -> None:
        self._file.close()
        for writer in self.writers:
            writer.close()
        if self.endpoint is not None:
            self.endpoint.close()


def state_samples(state: dict):
    """(kind, name, help, value) for the State's step and version (gauges) and every other integer
    field (a counter, `tandem_trainer_<field>_total`)."""
    yield "gauge", "tandem_trainer_step", "optimizer steps taken (steps)", state["step"]
    yield (
        "gauge",
        "tandem_trainer_policy_version",
        "policy version last published or being trained (version number)",
        state["version"],
    )
    for name, value in state.items():
        if name in ("step", "version") or not is_int(value):
            continue
        help_text = COUNTER_HELP.get(name, f"the trainer's cumulative {name.replace('_', ' ')} (count)")
        yield "counter", f"tandem_trainer_{name}_total", help_text, value


def eta_s(step_ends: Sequence[float], steps_left: int) -> float | None:
    """Seconds to the end of the run: the mean wall time between the recent step ends given
    (a monotonic clock, oldest first) times `steps_left`; None with fewer than two ends."""
    if len(step_ends) < 2:
        return None
    return (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1) * max(0, steps_left)


def format_duration(seconds: float | None) -> str:
    """ "?" for None, else "45s", "12m05s" or "3h07m"."""
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(r: dict, *, max_steps: int, eta_s: float | None) -> str:
    """The console line of a step's metrics row; a mismatch part over no known sample (all from
    before a restart) reads n/a."""
    quant, stale = r.get("logp_abs_diff_quant"), r.get("logp_abs_diff_stale")
    split = "n/a" if quant is None else f"{quant:.1e} stale {stale:.4f}"
    evals = (
        f" eval greedy {r['eval_greedy_accuracy']:.3f} sampled {r['eval_sampled_accuracy']:.3f}"
        if "eval_greedy_accuracy" in r
        else ""
    )
    return (
        f"step {r['step']:>4}/{max_steps} v{r['policy_version']} reward {r['reward_mean']:.3f} "
        f"staleness {r['staleness_mean']:.2f}/{r['staleness_max']} dropped {r['dropped_stale']}s/"
        f"{r['dropped_fingerprint']}f |dlogp| {r['logp_abs_diff']:.4f} (quant {split}"
        f") kl {r['kl_k3']:.5f} lr {r['lr']:.2e} {r['step_time_s']:.2f}s{evals} eta {format_duration(eta_s)}"
    )
