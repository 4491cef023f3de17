"""Config files as data: YAML text and `key=value` overrides -> plain dicts, every problem one line.

One loader for every YAML config: run configs (tandem.config), study configs (tandem.study) and
recipe files (policy.recipe). Rules:
- YAML is read with `yaml.safe_load` only; a syntax error is a ValueError naming the file (or the
  override) and the line and column, a document nested too deeply one naming the file.
- An override is `a.b.c=value`; the value parses as YAML (`3`, `true`, `[1, 2]`, `{n_layers: 2}`) and
  may hold at most MAX_VALUE_NODES items (YAML aliases counted again, as a dump would expand them),
  nested at most MAX_VALUE_DEPTH deep.
- `set_dotted` creates the sections a dotted key names, and refuses to descend into a non-mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_VALUE_NODES, MAX_VALUE_DEPTH = 1000, 8  # an override value is a scalar or a small mapping/list


def parse_yaml(text: str, what: str) -> Any:
    """`text` as YAML; ValueError "{what}: YAML syntax error (line L, column C): problem"."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what}: YAML syntax error{where}: {problem}") from None
    except RecursionError:
        raise ValueError(f"{what}: YAML nested too deeply") from None


def read_mapping(path: str | Path, what: str) -> dict:
    """The YAML file at `path` as a mapping (an empty file: {}); `what` names it in every error."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: cannot read it ({e.__class__.__name__}: {e})") from None
    data = parse_yaml(text, what)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a mapping at the top, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`"a.b=value"` -> ("a.b", the value parsed as YAML, its size checked)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {item!r} is not key=value")
    value = parse_yaml(raw, f"override {key}")
    check_size(value, key)
    return key, value


def set_dotted(data: dict, dotted: str, value) -> None:
    """data[a][b][c] = value for dotted "a.b.c", creating the sections a and a.b where missing."""
    keys = dotted.split(".")
    for k in keys[:-1]:
        data = data.setdefault(k, {})
        if not isinstance(data, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    data[keys[-1]] = value


def check_size(value, path: str) -> None:
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
