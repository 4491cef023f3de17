"""The one hasher of the contract: sha256 over one canonical JSON form.

`ModelConfig.fingerprint()`, `Recipe.fingerprint()`, the manifest's `model_config_sha256` and
`recipe_sha256`, and the contract fingerprint are all `sha256_json(...)` of a plain-data form, so
`tandem plan` and `tandem inspect` print the same hash for one recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(obj: Any) -> str:
    """Sorted keys, no spaces, ASCII, no NaN; tuples become lists, dataclasses and objects with
    `to_dict()` their dicts. The one JSON form that gets hashed."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_json(obj: Any) -> str:
    """sha256 hex of `canonical_json(obj)`."""
    return sha256_hex(canonical_json(obj))


def _plain(obj: Any) -> Any:
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return _plain(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _plain(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise ValueError(f"canonical JSON needs string keys, got {bad[:5]}")
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ValueError(f"cannot put a {type(obj).__name__} into canonical JSON: {obj!r}")
