"""One YAML file per run plus `key=value` overrides -> one frozen, validated RunConfig.

Each component owns its section's dataclass (`trainer.config.TrainerConfig`,
`rollout.config.RolloutConfig`); this module only composes them, applies overrides
(`trainer.max_steps=20`, `model.dim=64`; values parse as YAML scalars) and rejects unknown
keys by their full dotted path, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollout.config import RolloutConfig
from trainer.config import TrainerConfig

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """The model preset plus field overrides (e.g. {"n_layers": 2}); vocab comes from the task."""

    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TaskSection:
    name: str = "addition"
    digits: int = 2

    def __post_init__(self):
        if self.name != "addition":
            raise ValueError(f"task.name={self.name!r}: the built-in task is 'addition'")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    run_id: str = "demo"
    redis_url: str = ""  # empty: `tandem run` starts a private redis-server
    num_rollout_workers: int = 2
    seed: int = 0
    recipe: str = "nvfp4_moe"
    # Samples more than this many versions behind the trainer are dropped by the trainer, and a
    # rollout never starts a group with a policy already this far behind.
    max_staleness: int = 2
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self):
        errors = []
        if not self.run_id or not all(c.isalnum() or c in "-_." for c in self.run_id):
            errors.append(f"run_id={self.run_id!r} (letters, digits, '-', '_' and '.' only)")
        if not 0 <= self.num_rollout_workers <= 64:
            errors.append(f"num_rollout_workers={self.num_rollout_workers} (want 0..64)")
        if self.max_staleness < 0:
            errors.append(f"max_staleness={self.max_staleness} (must be >= 0)")
        if errors:
            raise ValueError("RunConfig: " + "; ".join(errors))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, data: dict, path: str):
    """Build dataclass `cls` from a dict, recursing into dataclass-typed fields."""
    if not isinstance(data, dict):
        raise ValueError(f"config {path or '<root>'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"unknown config key(s) {', '.join(where + k for k in unknown)}; "
                         f"known: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        sub = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, sub)
        else:
            kwargs[name] = _coerce(hint, value, sub)
    return cls(**kwargs)


def _coerce(hint, value, path: str):
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (tuple,) and isinstance(value, list):
        return tuple(value)
    if origin is dict or hint is Any or origin in (typing.Union, types.UnionType, typing.Literal):
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ValueError(f"config {path}: expected {hint.__name__}, got {value!r}")
    return value


def _set_dotted(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def load(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (or the defaults when None) + `a.b=value` overrides -> RunConfig."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists() and (REPO_CONFIGS / p).exists():
            p = REPO_CONFIGS / p
        data = yaml.safe_load(p.read_text()) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    return _build(RunConfig, data, "")


def dump(cfg: RunConfig) -> str:
    """The resolved config as YAML (written into every run folder)."""
    def plain(o):
        if isinstance(o, tuple):
            return [plain(v) for v in o]
        if isinstance(o, dict):
            return {k: plain(v) for k, v in o.items()}
        return o
    return yaml.safe_dump(plain(cfg.to_dict()), sort_keys=False)


def env_overrides() -> list[str]:
    """Settings a deployment provides through the environment (Kubernetes Secrets/ConfigMaps):
    TANDEM_REDIS_URL, and TANDEM_RUN_ID; they override the YAML file."""
    import os

    out = []
    if os.environ.get("TANDEM_REDIS_URL"):
        out.append(f"redis_url={os.environ['TANDEM_REDIS_URL']}")
    if os.environ.get("TANDEM_RUN_ID"):
        out.append(f"run_id={os.environ['TANDEM_RUN_ID']}")
    return out
