"""Export a published policy version as a Hugging Face folder that serving engines load.

    export_policy(out, cfg, tensors, "nvfp4", recipe="nvfp4_moe", fingerprint=fp, version=7)

`tensors` is canonical name -> quantized object (policy.formats), exactly what the trainer published
for that version (or a TP=1 fetch of it). Formats (`export_policy` describes each layout): `hf`
(dequantized bf16), `compressed-tensors` (int4 W4A16 `pack-quantized`), `fp8-block` (DeepSeek-V3
style) and `nvfp4` (NVIDIA ModelOpt).

Rules: the bytes written are the published bytes, never re-quantized. Weights the recipe left in
another format are written dequantized in bf16 and listed as not quantized; a format the version has
no weight in is refused. Fused gate_up_proj tensors are split back by rows (refused where the split
would cut an fp8 block). No nvfp4 `input_scale` is written (activations have one scale per token).
Every safetensors file carries `tandem_contract_fingerprint`, `tandem_version` and `tandem_recipe`
in its metadata, and config.json a `tandem` section. Why: docs/design-decisions.md."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from policy import formats
from policy.checkpoint import ShardWriter, hf_config, save_hf
from policy.model import ModelConfig, parameter_shapes

__all__ = ["EXPORT_FORMATS", "export_policy"]

EXPORT_FORMATS = ("hf", "compressed-tensors", "fp8-block", "nvfp4")
_TARGET = {"compressed-tensors": "int4", "fp8-block": "fp8_block", "nvfp4": "nvfp4"}
_GATE_UP = re.compile(r"^(.*)\.gate_up_proj\.weight$")
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
MODELOPT_VERSION = "0.29.0"  # the ModelOpt export layout this writer follows


def _dequantized(tensors: Mapping, shapes: dict):
    for name in shapes:
        yield name, formats.dequantize(tensors[name]).view(shapes[name])


def _split_rows(q, fmt: str, rows: slice):
    """The quantized object of rows `rows` of q (whole scale rows/blocks only)."""
    m, k = q.shape
    n = rows.stop - rows.start
    if fmt == "int4":
        return formats.int4.INT4Tensor(q.codes[rows], q.scales[rows], q.group_size, (n, k))
    if fmt == "nvfp4":
        return formats.nvfp4.NVFP4Tensor(q.codes[rows], q.block_scales[rows], q.global_scale, (n, k), q.scope)
    if fmt == "fp8_block":
        bm = q.block[0]
        if rows.start % bm or (n % bm and rows.stop != m):
            raise ValueError(
                f"fp8-block: cannot split rows {rows.start}:{rows.stop} of a {m}x{k} tensor at {bm}-row block "
                "boundaries (gate/up width must be a multiple of the block rows)"
            )
        b = slice(rows.start // bm, -(-rows.stop // bm))
        return formats.fp8_block.FP8BlockTensor(q.codes[rows], q.scale_inv[b], q.block, (n, k))
    raise AssertionError(fmt)


def _quantized_parts(q, fmt: str) -> dict[str, torch.Tensor]:
    """The module's tensors (suffixes after the module name) in the target engine's layout."""
    if fmt == "int4":
        return {
            "weight_packed": q.packed(),
            "weight_scale": q.scales,
            "weight_shape": torch.tensor(q.shape, dtype=torch.int64),
        }
    if fmt == "fp8_block":
        return {"weight": q.codes, "weight_scale_inv": q.scale_inv}
    return {"weight": q.codes, "weight_scale": q.block_scales, "weight_scale_2": q.global_scale.reshape(())}


def _check(name: str, q, fmt: str, options: dict) -> None:
    if fmt == "int4":
        options.setdefault("group_size", q.group_size)
        if q.group_size != options["group_size"]:
            raise ValueError(
                f"compressed-tensors: {name} has int4 group {q.group_size}, others {options['group_size']}"
            )
    elif fmt == "fp8_block":
        if tuple(q.block) != (128, 128):
            raise ValueError(f"fp8-block: {name} has blocks {tuple(q.block)}; the format needs [128, 128]")
    elif q.scope != "tensor":
        raise ValueError(f"nvfp4: {name} has a {q.scope}-scope weight scale; ModelOpt NVFP4 needs one per tensor")


def _quant_config(export_format: str, options: dict, ignore: list[str]) -> tuple[dict, dict | None]:
    """(config.json quantization_config, hf_quant_config.json or None)."""
    if export_format == "compressed-tensors":
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": options["group_size"],
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        scheme = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": scheme},
            "ignore": ignore,
            "kv_cache_scheme": None,
        }, None
    if export_format == "fp8-block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ignore,
        }, None
    quantization = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ignore}
    hf_quant = {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": quantization}
    return {"quant_method": "modelopt", **quantization}, hf_quant


def _write_generation_config(out: Path, token_ids: Mapping[str, int] | None) -> None:
    if token_ids:
        out.mkdir(parents=True, exist_ok=True)
        (out / "generation_config.json").write_text(json.dumps(dict(token_ids), indent=2) + "\n")


def _checked_shapes(cfg: ModelConfig, tensors: Mapping[str, object], export_format: str, token_ids) -> dict:
    """The model's parameter shapes, once the format is known, the tensors are exactly the model's
    and `token_ids` holds only bos/eos/pad_token_id."""
    if export_format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {export_format!r}; known: {', '.join(EXPORT_FORMATS)}")
    shapes = parameter_shapes(cfg)
    missing = sorted(set(shapes) - set(tensors))
    unknown = sorted(set(tensors) - set(shapes))
    if missing or unknown:
        raise ValueError(f"export: tensors do not match the model: missing {missing[:3]}, unknown {unknown[:3]}")
    bad = sorted(set(token_ids or {}) - {"bos_token_id", "eos_token_id", "pad_token_id"})
    if bad:
        raise ValueError(f"export: token_ids {bad}: expected bos_token_id, eos_token_id, pad_token_id")
    return shapes


def _write_weights(writer: ShardWriter, shapes: dict, tensors: Mapping[str, object], target: str) -> list[str]:
    """Every weight into `writer`: the `target` ones as their quantized parts, the others in bf16
    (gate_up_proj split into gate_proj / up_proj). Returns the linear modules written in bf16."""
    ignore: list[str] = []
    for name, shape in shapes.items():
        q = tensors[name]
        m = _GATE_UP.match(name)
        if m:
            half = shape[0] // 2
            pieces = [(f"{m.group(1)}.gate_proj", slice(0, half)), (f"{m.group(1)}.up_proj", slice(half, shape[0]))]
        else:
            pieces = [(name[: -len(".weight")], None)]
        is_linear = len(shape) == 2 and name != "model.embed_tokens.weight"
        if formats.format_of(q) == target:
            for module, rows in pieces:
                part = q if rows is None else _split_rows(q, target, rows)
                for suffix, t in _quantized_parts(part, target).items():
                    writer.add(f"{module}.{suffix}", t)
            continue
        w = formats.dequantize(q).view(shape).to(torch.bfloat16)
        for module, rows in pieces:
            writer.add(f"{module}.weight", w if rows is None else w[rows])
            if is_linear:
                ignore.append(module)
    return ignore


def _quantized_weights(export_format: str, shapes: dict, tensors: Mapping, target: str, what: str):
    """(names of the weights in `target`, the format options they agree on); ValueError when there
    are none or one of them is not a linear layer's weight."""
    quantized = [n for n in shapes if formats.format_of(tensors[n]) == target]
    if not quantized:
        have = sorted({formats.format_of(t) for t in tensors.values()})
        raise ValueError(
            f"{export_format}: {what} has no {target} weights (it has {have}); "
            f"export --format hf, or train under a recipe that uses {target}"
        )
    options: dict = {}
    for n in quantized:
        _check(n, tensors[n], target, options)
        if len(shapes[n]) != 2 or n == "model.embed_tokens.weight":
            raise ValueError(f"{export_format}: {n} is {target} but is not a linear layer's weight")
    return quantized, options


def _with_fused_modules(cfg: ModelConfig, ignore: list) -> list:
    """The unquantized modules `ignore` plus those engines look up by another name: the tied head
    and, per MoE layer whose experts are all unquantized, the fused experts module."""
    if cfg.tie_word_embeddings:
        ignore.append("lm_head")  # the head is the (unquantized) embedding: engines must not expect scales
    # Engines that fuse a layer's experts into one MoE module look the layer up by that module's name.
    for i in range(cfg.n_layers):
        experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(cfg.n_experts) for p in _EXPERT_PROJ]
        if cfg.is_moe_layer(i) and set(experts) <= set(ignore):
            ignore.append(f"model.layers.{i}.mlp.experts")
    return ignore


def export_policy(
    out: str | Path,
    cfg: ModelConfig,
    tensors: Mapping[str, object],
    export_format: str,
    *,
    recipe: str,
    fingerprint: str,
    version: int,
    token_ids: Mapping[str, int] | None = None,
    max_shard_bytes: int = 4 << 30,
) -> dict:
    """Write version `version` of a policy to `out` in `export_format`; returns a summary dict
    {format, version, quantized: tensors written quantized, bf16: linear modules written in bf16}.

      hf                  every tensor dequantized, rounded to bf16 (the effective weights of version v)
      compressed-tensors  int4 W4A16 weights in the `pack-quantized` layout (`weight_packed` int32,
                          `weight_scale` bf16, `weight_shape`), group size from the recipe (32), symmetric;
                          decompressing it with the compressed-tensors library gives bf16(q * s), which is
                          Tandem's int4 operand (DESIGN.md, Compute contract), bit for bit
      fp8-block           DeepSeek-V3 style: `weight` e4m3 + `weight_scale_inv` fp32 [ceil(M/128), K/128];
                          quantization_config {"quant_method": "fp8", "weight_block_size": [128, 128]}
      nvfp4               NVIDIA ModelOpt NVFP4: `weight` uint8 (two E2M1 codes per byte, element 2j in the
                          low nibble), `weight_scale` e4m3 [M, K/16], `weight_scale_2` fp32 scalar (Tandem's
                          tensor-scope S_dec), hf_quant_config.json and quantization_config quant_algo NVFP4

    Weights not quantized are listed in `ignore` / `modules_to_not_convert` / `exclude_modules`.
    gate_up_proj splits into gate_proj / up_proj exactly for row-wise scales (int4, nvfp4) and for
    fp8 blocks when F is a multiple of 128; nvfp4 gate and up share one global scale, so both get
    the same `weight_scale_2`, as engines that fuse them expect. No `input_scale`: an engine must
    quantize each token's activation row itself (`S_dec_x[row] = 1 / min(2688 / amax(row),
    FLT_MAX)`, then E4M3 block scales per 16 elements) and apply `S_dec_x[row] * weight_scale_2` to
    the accumulator, as Tandem's rollout does. `token_ids` (bos/eos/pad_token_id of the run's
    tokenizer) go into config.json and generation_config.json, so that `generate` stops at eos."""
    shapes = _checked_shapes(cfg, tensors, export_format, token_ids)
    config = hf_config(cfg)  # refuses a model without an HF equivalent before writing anything
    meta = {"tandem_contract_fingerprint": fingerprint, "tandem_version": str(version), "tandem_recipe": recipe}
    extra = {"tandem": {"contract_fingerprint": fingerprint, "version": version, "recipe": recipe}, **(token_ids or {})}
    out = Path(out)
    if export_format == "hf":
        _write_generation_config(out, token_ids)
        weights = _dequantized(tensors, shapes)
        save_hf(out, cfg, weights, max_shard_bytes=max_shard_bytes, metadata=meta, extra_config=extra)
        return {"format": "hf", "version": version, "quantized": 0, "bf16": len(shapes)}

    target = _TARGET[export_format]
    quantized, options = _quantized_weights(
        export_format, shapes, tensors, target, f"version {version} (recipe {recipe})"
    )
    _write_generation_config(out, token_ids)
    writer = ShardWriter(out, max_shard_bytes=max_shard_bytes, metadata=meta)
    ignore = _with_fused_modules(cfg, _write_weights(writer, shapes, tensors, target))
    writer.finish()
    qconfig, hf_quant = _quant_config(export_format, options, ignore)
    if hf_quant is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    config.update(quantization_config=qconfig, **extra)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"format": export_format, "version": version, "quantized": len(quantized), "bf16": len(ignore)}
