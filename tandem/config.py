"""One YAML file per run plus `key=value` overrides -> one frozen, validated RunConfig.

Each component owns its section's dataclass (`trainer.config.TrainerConfig`,
`rollout.config.RolloutConfig`, `rollout.tasks.TaskConfig`); this module only composes them, applies overrides
(`trainer.max_steps=20`, `model.dim=64`; values parse as YAML scalars) and rejects unknown
keys by their full dotted path, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import yaml

from policy.fields import is_int, is_number
from policy.loop import AsyncConfig
from rollout.config import RolloutConfig
from rollout.tasks import TaskConfig
from trainer.config import LoggingConfig, TrainerConfig

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
    """Names the run's Redis keys (tandem:{run_id}:...); letters, digits, '-', '_' and '.'."""
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
        if not self.run_id or not all(c.isalnum() or c in "-_." for c in self.run_id):
            errors.append(f"run_id={self.run_id!r} (letters, digits, '-', '_' and '.' only)")
        if not 0 <= self.num_rollout_workers <= 64:
            errors.append(f"num_rollout_workers={self.num_rollout_workers} (want 0..64)")
        if not 0 <= self.redis_outage_s <= 3600:
            errors.append(f"redis_outage_s={self.redis_outage_s} (want 0..3600 seconds)")
        if self.trainer.eval_every and not (self.task.heldout_fraction or self.task.heldout_path):
            errors.append(
                f"trainer.eval_every={self.trainer.eval_every} needs held-out prompts: set task.heldout_fraction "
                "(or task.heldout_path for a jsonl task)"
            )
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
        _check_size(value, path)
        return value
    if hint is Any or origin in (typing.Union, types.UnionType, typing.Literal):
        _check_size(value, path)
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ValueError(f"config {path}: expected {hint.__name__}, got {_short(value)}")
    return value


MAX_VALUE_NODES, MAX_VALUE_DEPTH = 1000, 8  # an override value is a scalar or a small mapping/list


def _check_size(value, path: str) -> None:
    """Refuse values with more than MAX_VALUE_NODES nodes (counting every YAML alias again, as
    dump() would expand it) or nested deeper than MAX_VALUE_DEPTH; stops counting at the bound."""
    budget = [MAX_VALUE_NODES]

    def visit(v, depth: int) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"config {path}: value too large (over {MAX_VALUE_NODES} items)")
        if depth > MAX_VALUE_DEPTH:
            raise ValueError(f"config {path}: value nested deeper than {MAX_VALUE_DEPTH} levels")
        for child in v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ():
            visit(child, depth + 1)

    visit(value, 0)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _set_dotted(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def load(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (or the defaults when None) + `a.b=value` overrides -> RunConfig.

    Every problem (missing file, YAML syntax, unknown key, wrong type, bad value) is a ValueError
    whose one-line message names the file, key or value."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not os.path.exists(p) and os.path.isfile(REPO_CONFIGS / p):
            p = REPO_CONFIGS / p
        if not os.path.isfile(p):
            raise ValueError(f"config file {str(path)!r} not found")
        data = _yaml(p.read_text(), f"config file {str(path)!r}")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r}: expected a mapping at the top, got {type(data).__name__}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        value = _yaml(raw, f"override {key.strip()}")
        _check_size(value, key.strip())
        _set_dotted(data, key.strip(), value)
    return _build(RunConfig, data, "")


def _yaml(text: str, what: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what}: YAML syntax error{where}: {problem}") from None
    except RecursionError:
        raise ValueError(f"{what}: YAML nested too deeply") from None


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


# What a deployment provides per pod, through the environment (Kubernetes: Secrets, ConfigMaps,
# mounted files): variable -> config key. Applied after the YAML file, before command-line overrides.
# The commands themselves read TANDEM_CONFIG, TANDEM_RUN_DIR and TANDEM_WORKER_ID.
ENV_KEYS = {
    "TANDEM_RUN_ID": "run_id",
    "TANDEM_REDIS_URL": "redis_url",  # plus TANDEM_REDIS_PASSWORD / TANDEM_REDIS_CA_FILE, merged in
    "TANDEM_RUN_SECRET_FILE": "run_secret_file",  # a mounted Secret (or TANDEM_RUN_SECRET, read directly)
    "TANDEM_TRAINER_TLS_CERT": "trainer.tls.cert",
    "TANDEM_TRAINER_TLS_KEY": "trainer.tls.key",
    "TANDEM_TRAINER_TLS_CLIENT_CA": "trainer.tls.client_ca",
    "TANDEM_ROLLOUT_TLS_CA": "rollout.tls.ca",
    "TANDEM_ROLLOUT_TLS_CERT": "rollout.tls.cert",
    "TANDEM_ROLLOUT_TLS_KEY": "rollout.tls.key",
    "TANDEM_ROLLOUT_TLS_SERVER_NAME": "rollout.tls.server_name",
    "TANDEM_TRAINER_HEALTH_HOST": "trainer.health.host",  # the pod IP (downward API status.podIP)
    "TANDEM_ROLLOUT_HEALTH_HOST": "rollout.health.host",
    "TANDEM_TRAINER_METRICS_HOST": "trainer.metrics_host",  # the pod IP, where Prometheus scrapes
    "TANDEM_ROLLOUT_METRICS_HOST": "rollout.metrics_host",
}
REDIS_URL_PARTS = ("TANDEM_REDIS_PASSWORD", "TANDEM_REDIS_CA_FILE", "TANDEM_REDIS_CERT_FILE", "TANDEM_REDIS_KEY_FILE")


def env_overrides(environ: dict | None = None) -> list[str]:
    """`key=value` overrides from the environment (`os.environ` by default), per ENV_KEYS.

    The Redis password comes apart from the URL, so that the URL can live in a ConfigMap and only
    the password in a Secret: TANDEM_REDIS_PASSWORD (and TANDEM_REDIS_CA_FILE, the CA of a
    rediss:// server) are merged into TANDEM_REDIS_URL, which they therefore require.
    """
    env = os.environ if environ is None else environ
    out = []
    for name, key in ENV_KEYS.items():
        value = env.get(name, "")
        if name == "TANDEM_REDIS_URL":
            if not value and any(env.get(n) for n in REDIS_URL_PARTS):
                raise ValueError(f"{' / '.join(n for n in REDIS_URL_PARTS if env.get(n))} set without TANDEM_REDIS_URL")
            value = value and redis_url_with(
                value,
                password=env.get("TANDEM_REDIS_PASSWORD", ""),
                ca_file=env.get("TANDEM_REDIS_CA_FILE", ""),
                cert_file=env.get("TANDEM_REDIS_CERT_FILE", ""),
                key_file=env.get("TANDEM_REDIS_KEY_FILE", ""),
            )
        if value:
            out.append(f"{key}={json.dumps(value)}")  # a JSON string is a YAML string: "2024" stays text
    return out


def redis_url_with(url: str, *, password: str = "", ca_file: str = "", cert_file: str = "", key_file: str = "") -> str:
    """`url` with `password` as its password (replacing any; the user name is kept), `ca_file` as the
    CA that verifies a rediss:// server (redis-py's `ssl_ca_certs` URL parameter), and `cert_file` +
    `key_file` as the client certificate a server with `tls-auth-clients yes` requires."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"TANDEM_REDIS_URL has scheme {parts.scheme!r}: want redis://, rediss:// or unix://")
    netloc, query = parts.netloc, parts.query
    if password:
        userinfo, at, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0] if at else ""
        netloc = f"{user}:{quote(password, safe='')}@{hostport}"
    if ca_file:
        if parts.scheme != "rediss":
            raise ValueError(
                f"TANDEM_REDIS_CA_FILE={ca_file!r} needs a rediss:// TANDEM_REDIS_URL, not {parts.scheme}://"
            )
        query = "&".join(q for q in (query, urlencode({"ssl_ca_certs": ca_file})) if q)
    if cert_file or key_file:
        if parts.scheme != "rediss" or not (cert_file and key_file):
            raise ValueError(
                f"TANDEM_REDIS_CERT_FILE={cert_file!r}, TANDEM_REDIS_KEY_FILE={key_file!r}: set both, "
                f"with a rediss:// TANDEM_REDIS_URL (not {parts.scheme}://)"
            )
        query = "&".join(q for q in (query, urlencode({"ssl_certfile": cert_file, "ssl_keyfile": key_file})) if q)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`: what may be written to disk or logs."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hostport}", parts.path, parts.query, parts.fragment))
