"""The policy-version contract: everything trainer and rollout must agree on, and its fingerprint.

A `Contract` holds the model config, the recipe (name + full rules), the quantizer spec version, the
activation sites (format, scope, TP scale mode) and the TP plan; `Contract.to_proto()` is a
manifest's `contract`. Its hashes are `policy.hashing.sha256_json` of canonical JSON forms:
`model_config_sha256` is `ModelConfig.fingerprint()`, `recipe_sha256` is `Recipe.fingerprint()`
(what `tandem plan` prints). `contract_fingerprint` is a sha256 over a canonical JSON form of the
Contract (not over protobuf bytes, so it cannot change with the protobuf library), holding nothing
that changes per version (version, time, checksums). The TP degree is in it only when an activation
site uses `shard` scale mode (`partition_tp_size`); with `global` mode trainer and rollout may
differ in TP degree and still agree on the fingerprint. A side refuses a policy whose fingerprint
is not its own contract's (FingerprintMismatch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from policy import formats
from policy.hashing import canonical_json, sha256_hex
from policy.tp import TP_SCALE_MODES, TPPlan, check_tp
from tandem.v1 import manifest_pb2 as pb

_FINGERPRINT_SCHEMA = 1  # the contract fingerprint's own form: unchanged by schema 2 (same contract, same hash)


class FingerprintMismatch(ValueError):
    """A policy's contract fingerprint differs from the one this side was configured for."""

    def __init__(self, *, expected: str, got: str, version: int | None = None):
        self.expected, self.got, self.version = expected, got, version
        what = f"policy version {version}" if version is not None else "policy"
        super().__init__(
            f"{what} has contract fingerprint {got} but this side expects {expected}: trainer and "
            f"rollout disagree on model config, recipe, quantizer spec, activation scale scopes or TP plan"
        )


@dataclass(frozen=True, kw_only=True)
class ActivationSite:
    """How one activation site is quantized per token, and how its scale behaves under TP."""

    name: str
    format: str
    scope: str = "row"
    tp_scale_mode: str = "global"

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.name, str) or not self.name.endswith(".input"):
            bad.append(f"name={self.name!r} must be a weight name with '.weight' replaced by '.input'")
        if self.format not in formats.FORMATS:
            bad.append(f"format={self.format!r} is not one of {formats.FORMATS}")
        if not isinstance(self.scope, str):
            bad.append(f"scope={self.scope!r} must be a string")
        if self.tp_scale_mode not in TP_SCALE_MODES:
            bad.append(f"tp_scale_mode={self.tp_scale_mode!r} is not one of {TP_SCALE_MODES}")
        if bad:
            raise ValueError("invalid ActivationSite: " + "; ".join(bad))


@dataclass(frozen=True, kw_only=True)
class Contract:
    """Everything trainer and rollout must agree on. Both sides build one from their own config;
    the rollout refuses a policy whose fingerprint differs from its own contract's.

    `model_config`: a mapping or an object with `to_dict()` (policy.model.ModelConfig).
    `recipe_rules`: the full rules (`Recipe.to_dict()`). `trainer_tp_size` matters only when an
    activation site uses `shard` scale mode: then it becomes the TP degree both sides must use.
    """

    model_config: Any
    recipe_name: str
    recipe_rules: Any
    activation_sites: Sequence[ActivationSite] = ()
    tp_plan: TPPlan = field(default_factory=TPPlan)
    trainer_tp_size: int = 1
    quantizer_spec_version: str = formats.SPEC_VERSION

    def __post_init__(self) -> None:
        bad = []
        for attr in ("model_config", "recipe_rules"):
            try:
                canonical_json(getattr(self, attr))
            except ValueError as e:
                bad.append(f"{attr}: {e}")
        if not isinstance(self.recipe_name, str) or not self.recipe_name:
            bad.append(f"recipe_name={self.recipe_name!r} must be a non-empty string")
        if not isinstance(self.quantizer_spec_version, str) or not self.quantizer_spec_version:
            bad.append(f"quantizer_spec_version={self.quantizer_spec_version!r} must be a non-empty string")
        sites = tuple(sorted(self.activation_sites, key=lambda s: s.name))
        if any(not isinstance(s, ActivationSite) for s in sites):
            bad.append("activation_sites must be ActivationSite objects")
        names = [s.name for s in sites]
        dup = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
        if dup:
            bad.append(f"activation sites named twice: {dup[:5]}")
        if not isinstance(self.tp_plan, TPPlan):
            bad.append(f"tp_plan must be a TPPlan, got {type(self.tp_plan).__name__}")
        try:
            check_tp(0, self.trainer_tp_size)
        except ValueError as e:
            bad.append(f"trainer_tp_size: {e}")
        if bad:
            raise ValueError("invalid Contract: " + "; ".join(bad))
        object.__setattr__(self, "activation_sites", sites)

    @property
    def partition_tp_size(self) -> int:
        """The TP degree both sides must use (0: any). Pinned by a `shard`-mode site whose format has
        a per-token scale spanning blocks (nvfp4); other formats' scales are block-local, so their
        bytes do not depend on the partition."""
        pinned = any(s.tp_scale_mode == "shard" and s.format == "nvfp4" for s in self.activation_sites)
        return self.trainer_tp_size if pinned else 0

    def to_proto(self) -> pb.Contract:
        model_json = canonical_json(self.model_config)
        rules_json = canonical_json(self.recipe_rules)
        return pb.Contract(
            model_config_json=model_json,
            model_config_sha256=sha256_hex(model_json),
            recipe_name=self.recipe_name,
            recipe_rules_json=rules_json,
            recipe_sha256=recipe_sha256(rules_json),
            quantizer_spec_version=self.quantizer_spec_version,
            activation_sites=[
                pb.ActivationSite(name=s.name, format=s.format, scope=s.scope, tp_scale_mode=s.tp_scale_mode)
                for s in self.activation_sites
            ],
            tp_plan=pb.TpPlan(
                rules=[pb.TpRule(pattern=p, style=s) for p, s in self.tp_plan.rules],
                partition_tp_size=self.partition_tp_size,
            ),
        )

    def fingerprint(self) -> str:
        return contract_fingerprint(self.to_proto())


def contract_from_recipe(
    *, model_config, recipe, tp_scale_mode: str = "global", trainer_tp_size: int = 1, tp_plan: TPPlan | None = None
) -> Contract:
    """The contract of a model config under a policy.recipe.Recipe: its quantized activation sites
    get `tp_scale_mode`; the rules are `recipe.to_dict()` without the free-text description."""
    rules = dict(recipe.to_dict())
    rules.pop("description", None)
    sites = [
        ActivationSite(name=e.name, format=e.format, scope=e.scope, tp_scale_mode=tp_scale_mode)
        for e in recipe.plan(model_config).activations
        if e.format != "bf16"
    ]
    return Contract(
        model_config=model_config,
        recipe_name=recipe.name,
        recipe_rules=rules,
        activation_sites=sites,
        tp_plan=tp_plan or TPPlan(),
        trainer_tp_size=trainer_tp_size,
    )


def recipe_sha256(rules_json: str) -> str:
    """`Recipe.fingerprint()`: the hash of the rules' canonical JSON (the contract fingerprint
    covers the recipe name on its own)."""
    return sha256_hex(rules_json)


_fingerprints: dict[bytes, str] = {}  # sha256 of a serialized Contract -> its fingerprint


def contract_fingerprint(contract: pb.Contract) -> str:
    """sha256 hex over a canonical JSON of the contract's parts (see the module docstring).

    Memoized by the sha256 of the contract's deterministic serialization (equal bytes, equal fields):
    every version of a run carries the same contract, and its canonical JSON (one entry per activation
    site: 12,288 for Qwen3-30B-A3B) took ~60 ms per manifest built or verified."""
    key = hashlib.sha256(contract.SerializeToString(deterministic=True)).digest()
    fp = _fingerprints.get(key)
    if fp is None:
        fp = _contract_fingerprint(contract)
        if len(_fingerprints) >= 64:
            _fingerprints.clear()
        _fingerprints[key] = fp
    return fp


def _contract_fingerprint(contract: pb.Contract) -> str:
    doc = {
        "schema": _FINGERPRINT_SCHEMA,
        "model_config_sha256": sha256_hex(contract.model_config_json),
        "recipe_name": contract.recipe_name,
        "recipe_sha256": recipe_sha256(contract.recipe_rules_json),
        "quantizer_spec_version": contract.quantizer_spec_version,
        "activation_sites": [[s.name, s.format, s.scope, s.tp_scale_mode] for s in contract.activation_sites],
        "tp_plan": {
            "rules": [[r.pattern, r.style] for r in contract.tp_plan.rules],
            "partition_tp_size": contract.tp_plan.partition_tp_size,
        },
    }
    return sha256_hex(canonical_json(doc))


def check_fingerprint(manifest: pb.Manifest, expected: str) -> None:
    """Raise FingerprintMismatch (naming both) unless the manifest's fingerprint is `expected`."""
    if manifest.contract_fingerprint != expected:
        raise FingerprintMismatch(expected=expected, got=manifest.contract_fingerprint, version=manifest.version)
