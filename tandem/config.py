"""One YAML file per run plus `key=value` overrides -> one frozen, validated RunConfig.

Each component owns its section's dataclass (`trainer.config.TrainerConfig`,
`rollout.config.RolloutConfig`, `rollout.tasks.TaskConfig`); this module only composes them, builds
them from the file and its overrides (`trainer.max_steps=20`, `model.dim=64`; read and parsed by
policy.configfile, the loader of every YAML config) and rejects unknown keys by their full dotted
path, so a typo never silently falls back to a default. `from_dict` builds a run config held as a
plain dict (a study's runs); the overrides a pod's environment adds are tandem.env_config's.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from broker.keys import check_name
from policy.configfile import check_size, parse_override, read_mapping, set_dotted
from policy.fields import is_int, is_number
from policy.loop import AsyncConfig, exact_refusal
from rollout.config import RolloutConfig
from rollout.tasks import TaskConfig
from trainer.config import LoggingConfig, TrainerConfig

from .env_config import redact_url

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """The model: a preset plus field overrides (e.g. {"n_layers": 2}; vocab comes from the task), or a
    Hugging Face checkpoint folder whose config.json gives the architecture and whose weights start
    training (then overrides and a preset, if given, must agree with it; only `max_seq_len` may differ)."""

    preset: str = ""
    """A `policy.model.PRESETS` name; empty means "tiny" (without a checkpoint). With a checkpoint it must
    agree with config.json in every field but vocab_size and max_seq_len."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields that replace the preset's (vocab_size always comes from the task); with a
    checkpoint, each must equal config.json's value, except max_seq_len."""
    checkpoint: str = ""
    """A Hugging Face folder (config.json + safetensors; qwen3 or qwen3_moe): its config.json is the
    model, its weights the trainer's start (policy/checkpoint.py)."""


@dataclass(frozen=True, kw_only=True)
class KeepBf16Section:
    """Overrides of the recipe's `keep_bf16` (whole layers kept in bf16), for `recipe` and `rollout_recipe`
    alike; None keeps the recipe's own value. The overridden recipe keeps its name; its fingerprint changes."""

    last_fraction: float | None = None
    """Keep the last ceil(last_fraction * n_layers) layers whole in bf16; null: the recipe's value."""
    first: int | None = None
    """Keep the first `first` layers whole in bf16; null: the recipe's value."""

    def __post_init__(self):
        f, n = self.last_fraction, self.first
        if f is not None and not is_number(f, 0, 1):
            raise ValueError(f"keep_bf16.last_fraction={f!r} (a number in [0, 1], or null)")
        if n is not None and not is_int(n, lo=0):
            raise ValueError(f"keep_bf16.first={n!r} (an int >= 0, or null)")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run: the top-level keys and one section per component (`tandem run --explain KEY`)."""

    run_id: str = "demo"
    """Names the run's Redis keys (tandem:{run_id}:...); 1-64 letters, digits, '-', '_' and '.'."""
    redis_url: str = ""
    """redis://, rediss:// or unix:// URL; empty: `tandem run` starts a private redis-server."""
    num_rollout_workers: int = 2
    """Rollout worker processes `tandem run` starts (1..64 there; the services started on their own
    do not read it)."""
    recipe: str = "nvfp4_moe"
    """A built-in recipe name or a recipe YAML file (`tandem plan RECIPE` shows it)."""
    rollout_recipe: str = ""
    """Ablation knob that breaks the contract on purpose: the rollouts run this recipe while the trainer
    trains (QAT) under `recipe`; the trainer publishes its weights quantized under it and accepts its
    contract fingerprint instead of its own. "" (the default) = `recipe`: the contract holds. Every
    metrics row records it (`rollout_recipe`, `contract_breaking`)."""
    keep_bf16: KeepBf16Section = field(default_factory=KeepBf16Section)
    """Overrides of the recipe's whole-layer bf16 choice (for `recipe` and `rollout_recipe`)."""
    loop: AsyncConfig = field(default_factory=AsyncConfig)
    """Run-wide settings both sides share: max_staleness, temperature, seed."""
    redis_outage_s: float = 60.0
    """Services ride out a Redis restart or failover this long (retrying with backoff), then exit
    non-zero (code 3) for the orchestrator to restart them (broker.outage)."""
    run_secret_file: str = ""
    """The run secret that signs trajectories and the policy pointer (broker.signing): a file of 64
    hex characters; "" = $TANDEM_RUN_SECRET if set, else unsigned. `tandem run` makes one per run."""
    model: ModelSection = field(default_factory=ModelSection)
    """The policy model."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """What the run learns: prompts, verifier, tokenizer."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer service."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """A rollout worker."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """TensorBoard and W&B writers beside metrics.jsonl."""

    def __post_init__(self):
        errors = []
        try:
            check_name("run_id", self.run_id)  # the Redis keys' rule, checked before anything starts
        except ValueError as e:
            errors.append(str(e))
        if not 0 <= self.num_rollout_workers <= 64:
            errors.append(f"num_rollout_workers={self.num_rollout_workers} (want 0..64)")
        if not 0 <= self.redis_outage_s <= 3600:
            errors.append(f"redis_outage_s={self.redis_outage_s} (want 0..3600 seconds)")
        if self.trainer.eval_every and not (self.task.heldout_fraction or self.task.heldout_path):
            errors.append(
                f"trainer.eval_every={self.trainer.eval_every} needs held-out prompts: set task.heldout_fraction "
                "(or task.heldout_path for a jsonl task)"
            )
        if self.loop.routing_replay and self.trainer.backend == "megatron":
            errors.append(
                "loop.routing_replay=true with trainer.backend='megatron' (its MoE router takes no forced "
                "routing here: use trainer.backend='torch')"
            )
        if self.loop.exact and (why := exact_refusal(self.trainer.device, self.trainer.backend, self.trainer.dtype)):
            errors.append(why)
        if errors:
            raise ValueError("RunConfig: " + "; ".join(errors))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def contract_breaking(self) -> bool:
        """True when the `rollout_recipe` ablation knob names a recipe other than `recipe`."""
        return bool(self.rollout_recipe) and self.rollout_recipe != self.recipe


def _build(cls, data: dict, path: str):
    """Build dataclass `cls` from a dict, recursing into dataclass-typed fields."""
    if not isinstance(data, dict):
        raise ValueError(f"config {path or '<root>'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        hints = ""
        for k in unknown:
            near = _near(k, fields)
            if near:
                hints += f"; did you mean {where}{near[0]}: {field_docs(cls).get(near[0], '')}"
            else:  # a key of another section (e.g. max_staleness, now loop.max_staleness)
                elsewhere = [d for d, _ in _all_keys(RunConfig) if d.rsplit(".", 1)[-1] == k]
                if elsewhere:
                    hints += f"; did you mean {elsewhere[0]}: {explain(elsewhere[0]).split(': ', 1)[1]}"
        raise ValueError(
            f"unknown config key(s) {', '.join(where + k for k in unknown)}; known: {', '.join(sorted(fields))}" + hints
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        sub = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, sub)
        else:
            kwargs[name] = _coerce(hint, value, sub)
    return cls(**kwargs)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: its attribute docstring (the string literal under it), whitespace collapsed}."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def explain(key: str) -> str:
    """`tandem run --explain KEY`: a config key's type, default and documentation (a section: all its keys)."""
    cls, path, default = RunConfig, "", RunConfig()
    for part in [p for p in key.split(".") if p]:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            near = _near(part, fields)
            raise ValueError(
                f"unknown config key {path + part!r}"
                + (f"; did you mean {', '.join(path + n for n in near)}?" if near else "")
                + f" (keys of {path.rstrip('.') or 'the top level'}: {', '.join(fields)})"
            )
        hint = typing.get_type_hints(cls)[part]
        doc, default = field_docs(cls).get(part, ""), getattr(default, part)
        if not dataclasses.is_dataclass(hint):
            return f"{path}{part} ({_type_name(hint)}, default {default!r}): {doc}"
        cls, path = hint, f"{path}{part}."
    lines = [f"{path.rstrip('.') or 'top level'}: {_summary(cls)}"]
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = "section" if dataclasses.is_dataclass(hints[f.name]) else _type_name(hints[f.name])
        shown = "" if kind == "section" else f", default {getattr(default, f.name)!r}"
        lines.append(f"  {path}{f.name} ({kind}{shown}): {docs.get(f.name, '')}")
    return "\n".join(lines)


def _summary(cls) -> str:
    """The first paragraph of a class docstring (it may span lines), whitespace collapsed."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())


def _near(name: str, names) -> list[str]:
    """Keys `name` may have meant: those it begins, then close spellings."""
    return [n for n in names if n.startswith(name)][:3] or difflib.get_close_matches(name, list(names), n=3)


def _all_keys(cls, path: str = ""):
    """(dotted key, field) of every leaf field under dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _all_keys(hints[f.name], f"{path}{f.name}.")
        else:
            yield f"{path}{f.name}", f


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _coerce(hint, value, path: str):
    origin = typing.get_origin(hint)
    if hint in (int, float) and isinstance(value, bool):  # bools are ints in Python: never a number here
        raise ValueError(f"config {path}: expected {hint.__name__}, got {value!r}")
    if hint is float and isinstance(value, int):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as text
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    if origin is tuple and Ellipsis not in typing.get_args(hint):
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"config {path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is tuple and isinstance(value, list):  # tuple[X, ...]
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"config {path}: expected a mapping of names to values, got {_short(value)}")
        check_size(value, path)
        return value
    if hint is Any or origin in (typing.Union, types.UnionType, typing.Literal):
        check_size(value, path)
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ValueError(f"config {path}: expected {hint.__name__}, got {_short(value)}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def find_config(path: str | Path) -> Path | None:
    """`path` if it is a file, else the file of that name under configs/; None where neither is."""
    for p in (Path(path), REPO_CONFIGS / path):
        if p.is_file():
            return p
    return None


def load(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (or the defaults when None) + `a.b=value` overrides -> RunConfig.

    Every problem (missing file, YAML syntax, unknown key, wrong type, bad value) is a ValueError
    whose one-line message names the file, key or value."""
    data: dict = {}
    if path is not None:
        found = find_config(path)
        if found is None:
            raise ValueError(f"config file {str(path)!r} not found")
        data = read_mapping(found, f"config file {str(path)!r}")
    for item in overrides:
        set_dotted(data, *parse_override(item))
    return from_dict(data)


def from_dict(data: dict) -> RunConfig:
    """A run config as a plain dict (a parsed YAML file with its overrides set) -> RunConfig."""
    return _build(RunConfig, data, "")


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML (written into every run folder), the Redis password masked."""
    cfg = dataclasses.replace(cfg, redis_url=redact_url(cfg.redis_url))

    def plain(o):
        if isinstance(o, tuple):
            return [plain(v) for v in o]
        if isinstance(o, dict):
            return {k: plain(v) for k, v in o.items()}
        return o

    return yaml.safe_dump(plain(cfg.to_dict()), sort_keys=False)
