"""`tandem plan RECIPE --model PRESET|HF_DIR [--json]`: the format and scope of every parameter and site.

Nothing is allocated: the plan is computed from the model config (a preset, or the config.json of a
Hugging Face folder), so the 30B and 235B presets plan in well under a second. The text output groups names that differ only in layer or expert index;
--json prints every parameter and activation site individually.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections import defaultdict
from pathlib import Path

from policy.model import PRESETS, ModelConfig
from policy.recipe import BUILTINS, Recipe


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help=f"built-in ({', '.join(BUILTINS)}) or a YAML file")
    p.add_argument(
        "--model", default="tiny", help=f"model preset ({', '.join(PRESETS)}; default tiny) or a Hugging Face folder"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: {recipe, model, ..., parameters: [{name, format, scope, numel, ...}], "
        "activations: [...], summary, warnings}",
    )


def _ranges(values: list[int]) -> str:
    values = sorted(set(values))
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def _grouped(entries) -> list[tuple[str, str, str, int, int, str]]:
    """(pattern, format, scope, count, numel, layers) with layer/expert indices folded into '*'."""
    groups: dict[tuple, list] = defaultdict(list)
    for e in entries:
        pattern = re.sub(r"\.(\d+)\.", ".*.", re.sub(r"\.(\d+)\.", ".*.", e.name))
        groups[(pattern, e.format, e.scope)].append(e)
    rows = []
    for (pattern, fmt, scope), es in groups.items():
        layers = [e.layer for e in es if e.layer is not None]
        rows.append((pattern, fmt, scope, len(es), sum(e.numel for e in es), _ranges(layers) if layers else "-"))
    return rows


def model_config(model: str) -> ModelConfig:
    """A preset by name, or the config of a Hugging Face folder (config.json only)."""
    if model not in PRESETS and Path(model).is_dir():
        from policy.checkpoint import read_config

        return read_config(model)
    return ModelConfig.preset(model)


def make_plan(recipe_name: str, cfg: ModelConfig):
    recipe = Recipe.load(recipe_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reported in the output, once
        return recipe, recipe.plan(cfg)


def all_bf16_note(plan) -> str | None:
    """Why a recipe with rules quantizes nothing in this model (say so rather than look broken)."""
    if not plan.recipe.rules or any(e.format != "bf16" for e in plan.params):
        return None
    moe = any(plan.config.is_moe_layer(i) for i in range(plan.config.n_layers))
    why = "" if moe else " (a dense model: it has no routed experts, the only weights some recipes quantize)"
    return f"note: recipe {plan.recipe.name} leaves every parameter of this model in bf16{why}"


def main(args) -> int:
    try:
        cfg = model_config(args.model)
        recipe, plan = make_plan(args.recipe, cfg)
    except ValueError as e:
        print(f"tandem plan: {e}", file=sys.stderr)
        return 2
    render(recipe, plan, args.model, args.json)
    return 0


def render(recipe, plan, model_name: str, as_json: bool) -> None:
    note = all_bf16_note(plan)
    if as_json:
        print(json.dumps(_plan_json(recipe, plan, model_name, note), indent=1))
        return
    _print_summary(recipe, plan, model_name)
    _print_tensors(plan)
    for w in plan.warnings:
        print(f"warning: {w}")
    if note:
        print(note)


def _plan_json(recipe, plan, model_name: str, note: str | None) -> dict:
    """What `tandem plan --json` prints: the fingerprints, the totals and every entry of the plan."""
    cfg = plan.config
    return {
        "recipe": recipe.name,
        "recipe_fingerprint": recipe.fingerprint(),
        "model": model_name,
        "model_fingerprint": cfg.fingerprint(),
        "bf16_layers": list(plan.bf16_layers),
        "summary": {
            "numel_total": sum(e.numel for e in plan.params),
            "numel_by_format": plan.numel_by_format(),
            "tensors_by_format": plan.count_by_format("param"),
            "activation_sites_by_format": plan.count_by_format("activation"),
        },
        "parameters": [
            {
                "name": e.name,
                "format": e.format,
                "scope": e.scope,
                "numel": e.numel,
                "shape": list(e.shape),
                **e.to_dict()["kwargs"],
            }
            for e in plan.params
        ],
        "activations": [
            {"name": e.name, "format": e.format, "scope": e.scope, **e.to_dict()["kwargs"]} for e in plan.activations
        ],
        "warnings": list(plan.warnings) + ([note] if note else []),
    }


def _print_summary(recipe, plan, model_name: str) -> None:
    """The recipe and model, the layers kept in bf16, and a table of parameters per format/scope."""
    cfg = plan.config
    total = sum(e.numel for e in plan.params)
    print(
        f"recipe {recipe.name} ({recipe.fingerprint()[:12]}) on {model_name} "
        f"({cfg.n_layers} layers, {total:,} parameters, model {cfg.fingerprint()[:12]})"
    )
    kept = plan.bf16_layers
    print(
        f"layers kept whole in bf16: {_ranges(list(kept)) if kept else 'none'} "
        f"(last_fraction={recipe.keep_bf16_last_fraction}, first={recipe.keep_bf16_first})"
    )
    print(f"\n{'format':<12}{'tensors':>9}{'parameters':>18}{'share':>8}")
    counts: dict[str, int] = defaultdict(int)
    numels: dict[str, int] = defaultdict(int)
    for e in plan.params:
        key = e.format if e.format == "bf16" else f"{e.format}/{e.scope}"
        counts[key] += 1
        numels[key] += e.numel
    for key in sorted(counts, key=lambda k: -numels[k]):
        print(f"{key:<12}{counts[key]:>9}{numels[key]:>18,}{100 * numels[key] / total:>7.1f}%")


def _print_tensors(plan) -> None:
    """Activation sites per format, then the plan's names with their layer indices folded."""
    acts = plan.count_by_format("activation")
    print("activation sites: " + ", ".join(f"{k}: {v}" for k, v in sorted(acts.items())))
    print(f"\n{'name (indices folded)':<58}{'format':<11}{'scope':<8}{'count':>7}{'parameters':>16}  layers")
    for pattern, fmt, scope, count, numel, layers in _grouped(plan.params + plan.activations):
        print(f"{pattern:<58}{fmt:<11}{scope:<8}{count:>7}{numel:>16,}  {layers}")
