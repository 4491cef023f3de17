"""Precision recipes: which format and scale scope every parameter and activation site gets.

A recipe is data (YAML in configs/recipes/; `Recipe.load("nvfp4_moe")` or `Recipe.load(path)`; the
schema: `Recipe`): whole layers kept in bf16 (`keep_bf16`), then rules, first match wins, unmatched
names stay bf16. Names are the canonical parameter names (".weight") and activation sites
(".input", the input of the matmul whose weight has the same prefix). `recipe.plan(model)` gives
each name's format and options (`Plan`). Built-in recipes are the YAML files in configs/recipes/
(`BUILTINS`).

Rules: a bf16 *weight* is rounded to bf16 (that is what gets published); a bf16 *activation site*
stays in the compute dtype. Rejected with ValueError: unknown format or option, options that do not
fit the format, int4 or tensor-scope nvfp4 or multi-row fp8 blocks at activation sites (a row's
result would depend on the rest of the batch), and, at plan time, a block or group that does not
divide K. A rule that matches nothing is a warning (`Plan.warnings`, and `warnings.warn`)."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import yaml

from policy import formats
from policy.configfile import read_mapping
from policy.fields import is_int, is_number
from policy.hashing import sha256_json
from policy.model import ModelConfig, Transformer, activation_sites, parameter_shapes

__all__ = ["BUILTINS", "RECIPE_DIR", "Plan", "PlanEntry", "Recipe", "Rule"]

RECIPE_DIR = Path(__file__).resolve().parent.parent / "configs" / "recipes"
BUILTINS = ("bf16", "fp8_block", "mxfp8", "nvfp4_moe", "int4_qat")

_RULE_KEYS = {"match", "format", "scope", "group_size", "block", "layers"}
_RECIPE_KEYS = {"name", "description", "keep_bf16", "rules"}
_KEEP_KEYS = {"last_fraction", "first"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Scope reported for formats whose scale granularity is fixed by the format itself.
_FIXED_SCOPE = {"bf16": "none", "mxfp8": "block", "fp8_block": "block", "int4": "group"}


def _glob_regex(pattern: str) -> re.Pattern:
    out = []
    for part in re.split(r"(\*\*|\*)", pattern):
        out.append(".*" if part == "**" else "[^.]+" if part == "*" else re.escape(part))
    return re.compile("^" + "".join(out) + "$")


def _layer_selection(spec, n_layers: int) -> set[int]:
    if isinstance(spec, str):
        m = re.fullmatch(r"\s*(-?\d+)?\s*:\s*(-?\d+)?\s*", spec)
        if not m:
            raise ValueError(f"layers {spec!r}: expected a slice like '0:40', '-8:' or a list of ints")
        a, b = (int(g) if g is not None else None for g in m.groups())
        return set(range(n_layers)[slice(a, b)])
    return {i if i >= 0 else n_layers + i for i in spec}


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One rule: names matching any glob in `match` (and in `layers`, if given) get `format`."""

    match: tuple[str, ...]
    format: str
    scope: str | None = None
    group_size: int | None = None
    block: tuple[int, int] | None = None
    layers: str | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        where = f"rule matching {list(self.match)!r}"
        errors = []
        if not self.match or not all(isinstance(m, str) and m for m in self.match):
            errors.append(f"match={self.match!r} must be a non-empty glob or list of globs")
        if self.format not in formats.FORMATS:
            errors.append(f"unknown format {self.format!r} (known: {', '.join(formats.FORMATS)})")
        if self.scope is not None and (self.format != "nvfp4" or self.scope not in formats.nvfp4.SCOPES):
            errors.append(f"scope={self.scope!r} is only valid for nvfp4, as one of {formats.nvfp4.SCOPES}")
        if self.group_size is not None and (self.format != "int4" or not is_int(self.group_size, lo=1)):
            errors.append(f"group_size={self.group_size!r} is only valid for int4, as a positive int")
        if self.block is not None and (
            self.format != "fp8_block" or len(self.block) != 2 or not all(is_int(b, lo=1) for b in self.block)
        ):
            errors.append(f"block={self.block!r} is only valid for fp8_block, as two positive ints")
        if self.layers is not None:
            if isinstance(self.layers, str):
                try:
                    _layer_selection(self.layers, 1)
                except ValueError as e:
                    errors.append(str(e))
            elif not all(is_int(i) for i in self.layers):
                errors.append(f"layers={self.layers!r} must be a slice string or a list of ints")
        if errors:
            raise ValueError(f"{where}: " + "; ".join(errors))
        object.__setattr__(self, "_regexes", tuple(_glob_regex(m) for m in self.match))

    @classmethod
    def from_dict(cls, d: dict, index: int) -> Rule:
        if not isinstance(d, dict):
            raise ValueError(f"rules[{index}]: expected a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - _RULE_KEYS)
        missing = sorted({"match", "format"} - set(d))
        if unknown or missing:
            raise ValueError(
                f"rules[{index}]: unknown key(s) {unknown}, missing key(s) {missing}; allowed: {sorted(_RULE_KEYS)}"
            )
        match = d["match"]
        layers = d.get("layers")
        block = d.get("block")
        try:
            return cls(
                match=(match,) if isinstance(match, str) else tuple(match),
                format=d["format"],
                scope=d.get("scope"),
                group_size=d.get("group_size"),
                block=None if block is None else tuple(block),
                layers=layers if layers is None or isinstance(layers, str) else tuple(layers),
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"rules[{index}]: {e}") from None

    def to_dict(self) -> dict:
        return {
            "match": list(self.match),
            "format": self.format,
            "scope": self.scope,
            "group_size": self.group_size,
            "block": None if self.block is None else list(self.block),
            "layers": self.layers if self.layers is None or isinstance(self.layers, str) else list(self.layers),
        }

    def matches(self, name: str, layer: int | None, selected_layers: set[int] | None) -> bool:
        if selected_layers is not None and (layer is None or layer not in selected_layers):
            return False
        return any(r.match(name) for r in self._regexes)

    def options(self, kind: str) -> tuple[str, dict]:
        """(scope, format kwargs) for a parameter (kind 'param') or activation site ('activation')."""
        if self.format == "nvfp4":
            scope = self.scope or ("tensor" if kind == "param" else "row")
            return scope, {"scope": scope}
        if self.format == "int4":
            return "group", {"group_size": self.group_size or formats.int4.DEFAULT_GROUP}
        if self.format == "fp8_block":
            block = self.block or (
                formats.fp8_block.WEIGHT_BLOCK if kind == "param" else formats.fp8_block.ACTIVATION_BLOCK
            )
            return "block", {"block": tuple(block)}
        return _FIXED_SCOPE[self.format], {}


@dataclass(frozen=True)
class PlanEntry:
    """Format of one parameter (kind 'param') or activation site (kind 'activation').

    shape: the parameter shape; for an activation site (-1, K) (rows = tokens). numel: parameter
    elements (0 for activation sites). kwargs: what to pass to the format's quantize/fake_quant.
    rule: index of the deciding rule; None = no rule matched (bf16 default); "keep_bf16" = the layer
    is kept whole in bf16.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    numel: int
    format: str
    scope: str
    kwargs: dict
    layer: int | None
    rule: int | str | None

    def to_dict(self) -> dict:
        kw = {k: list(v) if isinstance(v, tuple) else v for k, v in self.kwargs.items()}
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.shape),
            "numel": self.numel,
            "format": self.format,
            "scope": self.scope,
            "kwargs": kw,
            "layer": self.layer,
            "rule": self.rule,
        }


@dataclass(frozen=True)
class Plan:
    """A recipe resolved against one model config: an entry for every parameter and activation site."""

    recipe: Recipe
    config: ModelConfig
    params: tuple[PlanEntry, ...]
    activations: tuple[PlanEntry, ...]
    bf16_layers: tuple[int, ...]
    warnings: tuple[str, ...]
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update({e.name: e for e in self.params})
        self._index.update({e.name: e for e in self.activations})

    def __getitem__(self, name: str) -> PlanEntry:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"{name!r} is neither a parameter nor an activation site of this model") from None

    def numel_by_format(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.params:
            out[e.format] = out.get(e.format, 0) + e.numel
        return out

    def count_by_format(self, kind: str = "param") -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.params if kind == "param" else self.activations:
            key = e.format if e.format == "bf16" else f"{e.format}/{e.scope}"
            out[key] = out.get(key, 0) + 1
        return out

    def activation_scopes(self) -> dict[str, str]:
        """Quantized activation site -> scope (what the manifest records)."""
        return {e.name: e.scope for e in self.activations if e.format != "bf16"}

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe.name,
            "recipe_fingerprint": self.recipe.fingerprint(),
            "model_fingerprint": self.config.fingerprint(),
            "bf16_layers": list(self.bf16_layers),
            "parameters": [e.to_dict() for e in self.params],
            "activations": [e.to_dict() for e in self.activations],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A precision recipe. Frozen; compare by value. The YAML schema:

        name: nvfp4_moe
        description: free text, not part of the fingerprint
        keep_bf16:                 # whole layers forced to bf16, overriding every rule
          last_fraction: 0.15      #   the last ceil(0.15 * n_layers) layers
          first: 0                 #   and the first N layers
        rules:                     # first matching rule wins; unmatched names stay bf16
          - match: model.layers.*.mlp.experts.*.*.weight      # one glob or a list of globs
            format: nvfp4
            scope: tensor          # nvfp4 only: tensor | row
          - match: model.layers.*.mlp.experts.*.*.input
            format: nvfp4
            scope: row
            layers: "0:-1"         # optional: a list of layer indices or a Python slice "a:b" ("-8:" ...)

    In globs, `*` matches within one dotted component and `**` across components. Format options:
    `scope` (nvfp4; default tensor for weights, row for activations), `group_size` (int4; default
    32), `block` (fp8_block; default [128, 128] for weights, [1, 128] for activations). mxfp8 and
    bf16 take no options."""

    name: str
    rules: tuple[Rule, ...] = ()
    keep_bf16_last_fraction: float = 0.0
    keep_bf16_first: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        errors = []
        if not isinstance(self.name, str) or not self.name:
            errors.append(f"name={self.name!r} must be a non-empty string")
        f = self.keep_bf16_last_fraction
        if not is_number(f, 0, 1):
            errors.append(f"keep_bf16.last_fraction={f!r} must be a number in [0, 1]")
        n = self.keep_bf16_first
        if not is_int(n, lo=0):
            errors.append(f"keep_bf16.first={n!r} must be an int >= 0")
        if not all(isinstance(r, Rule) for r in self.rules):
            errors.append("rules must be Rule objects")
        if errors:
            raise ValueError(f"recipe {self.name!r}: " + "; ".join(errors))

    # ---- loading and serialization

    @classmethod
    def load(cls, name_or_path: str | Path) -> Recipe:
        """A built-in by name (configs/recipes/<name>.yaml) or a YAML file path."""
        s = str(name_or_path)
        path = RECIPE_DIR / f"{s}.yaml" if s in BUILTINS else Path(s)
        if not path.is_file():
            raise ValueError(f"unknown recipe {s!r}: not a built-in ({', '.join(BUILTINS)}) and no file {str(path)!r}")
        data = read_mapping(path, f"recipe file {str(path)!r}")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"recipe file {str(path)!r}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> Recipe:
        if not isinstance(d, dict):
            raise ValueError(f"a recipe must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - _RECIPE_KEYS)
        if unknown or "name" not in d:
            raise ValueError(
                f"unknown key(s) {unknown}{', missing key name' if 'name' not in d else ''}; "
                f"allowed: {sorted(_RECIPE_KEYS)}"
            )
        keep = d.get("keep_bf16") or {}
        if not isinstance(keep, dict) or set(keep) - _KEEP_KEYS:
            raise ValueError(f"keep_bf16 must be a mapping with keys {sorted(_KEEP_KEYS)}, got {keep!r}")
        rules = d.get("rules") or []
        if not isinstance(rules, list):
            raise ValueError(f"rules must be a list, got {type(rules).__name__}")
        return cls(
            name=d["name"],
            description=str(d.get("description") or "").strip(),
            keep_bf16_last_fraction=keep.get("last_fraction", 0.0),
            keep_bf16_first=keep.get("first", 0),
            rules=tuple(Rule.from_dict(r, i) for i, r in enumerate(rules)),
        )

    def to_dict(self) -> dict:
        """Every field, rules in full (defaults explicit): the manifest's copy of the recipe."""
        return {
            "name": self.name,
            "description": self.description,
            "keep_bf16": {"last_fraction": self.keep_bf16_last_fraction, "first": self.keep_bf16_first},
            "rules": [r.to_dict() for r in self.rules],
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of name, keep_bf16 and rules (description excluded):
        the manifest's `recipe_sha256` (policy.hashing)."""
        d = self.to_dict()
        d.pop("description")
        return sha256_json(d)

    # ---- planning

    def bf16_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers kept whole in bf16: the first `keep_bf16_first` and the last ceil(fraction * n)."""
        # Exact decimal arithmetic: 0.15 * 20 is 3.0000000000000004 in floats, which would ceil to 4.
        n_last = math.ceil(Fraction(repr(float(self.keep_bf16_last_fraction))) * n_layers)
        first = set(range(min(self.keep_bf16_first, n_layers)))
        return tuple(sorted(first | set(range(n_layers - min(n_last, n_layers), n_layers))))

    def plan(self, model_or_config: Transformer | ModelConfig) -> Plan:
        """Resolve the recipe for a model (any device, meta included) or a config (nothing allocated)."""
        if isinstance(model_or_config, Transformer):
            cfg = model_or_config.cfg
            shapes = {n: tuple(p.shape) for n, p in model_or_config.named_parameters()}
        elif isinstance(model_or_config, ModelConfig):
            cfg, shapes = model_or_config, parameter_shapes(model_or_config)
        else:
            raise ValueError(f"plan() needs a Transformer or a ModelConfig, got {type(model_or_config).__name__}")
        kept = set(self.bf16_layers(cfg.n_layers))
        selections = [None if r.layers is None else _layer_selection(r.layers, cfg.n_layers) for r in self.rules]
        hits = [0] * len(self.rules)
        wins = [0] * len(self.rules)
        errors: list[str] = []

        def resolve(name: str, kind: str, shape: tuple[int, ...], K: int) -> PlanEntry:
            m = _LAYER_RE.match(name)
            layer = int(m.group(1)) if m else None
            winner = None
            for i, rule in enumerate(self.rules):
                if rule.matches(name, layer, selections[i]):
                    hits[i] += 1
                    if winner is None:
                        winner = i
            numel = math.prod(shape) if kind == "param" else 0
            if winner is not None and layer not in kept:
                wins[winner] += 1
                rule = self.rules[winner]
                scope, kwargs = rule.options(kind)
                errors.extend(self._check_site(name, kind, rule, scope, kwargs, shape, K))
                return PlanEntry(name, kind, shape, numel, rule.format, scope, kwargs, layer, winner)
            decided = "keep_bf16" if winner is not None else None
            return PlanEntry(name, kind, shape, numel, "bf16", "none", {}, layer, decided)

        params = tuple(resolve(n, "param", s, s[-1]) for n, s in shapes.items())
        acts = tuple(resolve(n, "activation", (-1, K), K) for n, K in activation_sites(cfg).items())
        if errors:
            more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
            raise ValueError(f"recipe {self.name!r} does not fit the model: " + "; ".join(errors[:10]) + more)
        notes = []
        for i, rule in enumerate(self.rules):
            if hits[i] == 0:
                notes.append(
                    f"recipe {self.name!r} rule {i} (match {list(rule.match)}) matches no parameter or activation site"
                )
            elif wins[i] == 0:
                notes.append(
                    f"recipe {self.name!r} rule {i} (match {list(rule.match)}) never applies: "
                    f"earlier rules or keep_bf16 take all {hits[i]} names it matches"
                )
        for note in notes:
            warnings.warn(note, stacklevel=2)
        return Plan(self, cfg, params, acts, tuple(sorted(kept)), tuple(notes))

    @staticmethod
    def _check_site(name, kind, rule, scope, kwargs, shape, K) -> list[str]:
        errors = []
        if kind == "activation":
            if rule.format == "int4":
                errors.append(f"{name}: int4 is a weight-only format (W4A16); activations cannot use it")
            if rule.format == "nvfp4" and scope != "row":
                errors.append(f"{name}: nvfp4 activations need scope 'row' (per token), got {scope!r}")
            if rule.format == "fp8_block" and kwargs["block"][0] != 1:
                errors.append(f"{name}: fp8_block activation blocks must be one row, got {kwargs['block']}")
        elif len(shape) == 1 and rule.format != "bf16":
            errors.append(f"{name}: 1-D parameter {shape} can only be bf16, got {rule.format}")
        block = formats.get(rule.format).block_shape(**kwargs)[1]
        if K % block:
            errors.append(f"{name}: K={K} is not a multiple of the {rule.format} block size {block}")
        return errors
