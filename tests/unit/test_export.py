"""policy.export: every format re-read by something that is not Tandem's own code.

compressed-tensors: decompressed by the compressed-tensors library itself == Tandem's int4 operand
bf16(q * s), bit for bit. fp8-block and nvfp4: the weights are quantized again here by an independent
re-implementation of the published formulas (DeepSeek-V3 block FP8; NVFP4 with E4M3 block scales and an
FP32 per-tensor scale), whose bytes must equal the exported ones; the exported layout is decoded here
too. hf: transformers loads the folder and computes the logits of the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from policy import formats
from policy.export import export_policy
from policy.model import ModelConfig, Transformer
from policy.qat import quantize_weights
from policy.recipe import Recipe

transformers = pytest.importorskip("transformers")

# qwen3_moe with one dense layer; F = 128 so that fp8 128-row blocks split gate | up exactly.
CFG = ModelConfig(
    vocab_size=96, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=4, top_k=2,
    expert_ffn_dim=128, ffn_dim=256, mlp_only_layers=(1,), rope_theta=10_000.0, max_seq_len=128,
)  # fmt: skip
FP = "f" * 64


def _export(tmp_path, recipe: str, fmt: str, *, cfg=CFG, seed=0):
    model = Transformer(cfg, seed=seed)
    with torch.no_grad():
        for p in model.parameters():  # make the dynamic range differ between blocks and rows
            p.mul_(torch.exp(torch.randn_like(p)))
    packed = quantize_weights(model, Recipe.load(recipe))
    out = tmp_path / fmt
    summary = export_policy(out, cfg, packed, fmt, recipe=recipe, fingerprint=FP, version=7, max_shard_bytes=200_000)
    return model, packed, out, summary


def _read(out) -> tuple[dict, dict, dict]:
    tensors, metas = {}, []
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            metas.append(h.metadata())
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    assert all(m["tandem_contract_fingerprint"] == FP and m["tandem_version"] == "7" for m in metas)
    config = json.loads((out / "config.json").read_text())
    assert config["tandem"] == {"contract_fingerprint": FP, "version": 7, "recipe": config["tandem"]["recipe"]}
    return tensors, config, metas


def _rows(name: str, F: int):
    """(canonical name, row slice) of an exported module name."""
    for part, rows in (("gate_proj", slice(0, F)), ("up_proj", slice(F, 2 * F))):
        if name.endswith(f".{part}"):
            return name[: -len(part)] + "gate_up_proj.weight", rows
    return name + ".weight", slice(None)


def _ffn(name: str) -> int:
    return CFG.expert_ffn_dim if ".experts." in name else CFG.ffn_dim


def test_compressed_tensors_decompresses_to_tandems_int4_operand(tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    _, packed, out, summary = _export(tmp_path, "int4_qat", "compressed-tensors")
    tensors, config, _ = _read(out)
    qc = QuantizationConfig.model_validate(config["quantization_config"])  # the library parses our config
    scheme = qc.config_groups["group_0"]
    assert scheme.weights.group_size == 32 and scheme.weights.symmetric and scheme.weights.num_bits == 4
    modules = sorted(k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed"))
    int4_names = [n for n, q in packed.items() if formats.format_of(q) == "int4"]
    assert len(int4_names) == summary["quantized"]
    assert len(modules) == sum(2 if "gate_up" in n else 1 for n in int4_names)  # gate_up -> gate + up
    assert not set(modules) & set(config["quantization_config"]["ignore"])
    for module in modules:
        state = {s: tensors[f"{module}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
        w = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        name, rows = _rows(module, _ffn(module))
        expected = formats.dequantize(packed[name])[rows].to(torch.bfloat16)
        assert w.dtype == torch.bfloat16
        assert torch.equal(w.view(torch.int16), expected.view(torch.int16)), module
    assert "model.layers.0.self_attn.q_proj" in config["quantization_config"]["ignore"]  # bf16 under int4_qat


def _fp8_block_reference(x: torch.Tensor, bm=128, bk=128):
    """DeepSeek-V3 block quantization, written from the formula: S = 448 / amax per 128x128 block."""
    x = x.float()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(-(-m // bm), k // bk)
    for i in range(0, m, bm):
        for j in range(0, k, bk):
            blk = x[i : i + bm, j : j + bk]
            amax = blk.abs().max()
            s = (
                torch.tensor(1.0)
                if amax == 0
                else torch.clamp(torch.tensor(448.0) / amax, max=torch.finfo(torch.float32).max)
            )
            codes[i : i + bm, j : j + bk] = torch.clamp(blk * s, -448, 448).to(torch.float8_e4m3fn)
            scale_inv[i // bm, j // bk] = torch.tensor(1.0) / s
    return codes, scale_inv


def test_fp8_block_export_matches_an_independent_quantizer(tmp_path):
    model, packed, out, _ = _export(tmp_path, "fp8_block", "fp8-block")
    tensors, config, _ = _read(out)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    params = dict(model.named_parameters())
    modules = sorted(k[: -len(".weight_scale_inv")] for k in tensors if k.endswith(".weight_scale_inv"))
    assert any(".experts." in m for m in modules) and any(".mlp.gate_proj" in m for m in modules)
    for module in modules:
        name, rows = _rows(module, _ffn(module))
        codes, scale_inv = _fp8_block_reference(params[name].detach()[rows])
        got = tensors[f"{module}.weight"]
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8)), module
        assert torch.equal(tensors[f"{module}.weight_scale_inv"], scale_inv), module
        # decoded as an engine does (codes x scale_inv per block) == Tandem's dequantization
        s = scale_inv.repeat_interleave(128, 0)[: got.shape[0]].repeat_interleave(128, 1)
        assert torch.equal(got.float() * s, formats.dequantize(packed[name])[rows])


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_code(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to E2M1, ties to even, by the boundaries of the 8 magnitudes; sign in bit 3."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    # a tie goes to the even code: up at 0.75, 1.75, 3.5 (to codes 2, 4, 6), down at 0.25, 1.25, 2.5, 5
    for bound, tie_up in [
        (0.25, False),
        (0.75, True),
        (1.25, False),
        (1.75, True),
        (2.5, False),
        (3.5, True),
        (5.0, False),
    ]:
        mag += ((a >= bound) if tie_up else (a > bound)).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def _nvfp4_reference(x: torch.Tensor):
    """NVFP4 with one FP32 global scale per tensor, written from the ModelOpt/DESIGN formulas."""
    x = x.float()
    m, k = x.shape
    amax = x.abs().max()
    fmax = torch.finfo(torch.float32).max
    s_enc = torch.tensor(1.0) if amax == 0 else torch.clamp(torch.tensor(2688.0) / amax, max=fmax)
    s_dec = torch.tensor(1.0) / s_enc
    kk = s_enc * (torch.tensor(1.0) / torch.tensor(6.0))
    xb = x.view(m, k // 16, 16)
    sf = torch.clamp(xb.abs().amax(-1) * kk, max=448.0).to(torch.float8_e4m3fn)
    enc = torch.clamp(torch.tensor(1.0) / (sf.float() * s_dec), max=fmax)
    codes = _e2m1_code(torch.clamp(xb * enc.unsqueeze(-1), -6, 6)).view(m, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, sf, s_dec.reshape(())


def test_nvfp4_export_matches_an_independent_quantizer(tmp_path):
    model, packed, out, _ = _export(tmp_path, "nvfp4_moe", "nvfp4")
    tensors, config, _ = _read(out)
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert not any(k.endswith("input_scale") for k in tensors)  # per-token scales: see policy/export.py
    params = dict(model.named_parameters())
    modules = sorted(k[: -len(".weight_scale_2")] for k in tensors if k.endswith(".weight_scale_2"))
    assert modules and all(".experts." in m for m in modules)
    for module in modules:
        name, rows = _rows(module, _ffn(module))
        # the global scale is computed on the whole gate_up tensor: quantize it whole, then cut rows
        codes, sf, s_dec = _nvfp4_reference(params[name].detach())
        assert tensors[f"{module}.weight"].dtype == torch.uint8
        assert torch.equal(tensors[f"{module}.weight"], codes[rows]), module
        assert torch.equal(tensors[f"{module}.weight_scale"].view(torch.uint8), sf[rows].view(torch.uint8))
        assert torch.equal(tensors[f"{module}.weight_scale_2"], s_dec)
        # decoded from the ModelOpt layout == Tandem's dequantization
        w = tensors[f"{module}.weight"]
        nib = torch.stack([w & 0xF, w >> 4], -1).view(w.shape[0], -1).long()
        vals = torch.where(nib >= 8, -_E2M1[nib % 8], _E2M1[nib % 8])
        scale = tensors[f"{module}.weight_scale"].float() * tensors[f"{module}.weight_scale_2"]
        got = (vals.view(w.shape[0], -1, 16) * scale.unsqueeze(-1)).view(w.shape[0], -1)
        assert torch.equal(got, formats.dequantize(packed[name])[rows])


def test_hf_export_loads_in_transformers_with_the_dequantized_weights(tmp_path):
    model, packed, out, _ = _export(tmp_path, "int4_qat", "hf")
    _read(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = Transformer(CFG, seed=None)
    ref.load_weights(
        {n: formats.dequantize(q).view(p.shape).bfloat16() for (n, q), p in zip(packed.items(), ref.parameters())}
    )
    tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(tokens).logits.float(), ref(tokens).float()
    assert ((a - b).norm() / b.norm()).item() <= 1e-5


def test_export_refuses_a_format_the_version_does_not_use(tmp_path):
    with pytest.raises(ValueError, match="has no int4 weights"):
        _export(tmp_path, "nvfp4_moe", "compressed-tensors")
    # gate | up at row 64 would cut a 128-row fp8 block in two
    recipe = tmp_path / "gate_up_fp8.yaml"
    recipe.write_text(
        "name: gate_up_fp8\nrules:\n  - match: model.layers.*.mlp.experts.*.gate_up_proj.weight\n    format: fp8_block\n"
    )
    with pytest.raises(ValueError, match="multiple of the block rows"):
        _export(tmp_path, str(recipe), "fp8-block", cfg=ModelConfig(**{**CFG.to_dict(), "expert_ffn_dim": 64}))


def test_transformers_runs_the_compressed_tensors_export_like_the_bf16_one(tmp_path):
    """transformers decompresses the int4 folder (compressed-tensors installed) to exactly the weights
    of the hf export of the same version: identical logits."""
    _, packed, out, _ = _export(tmp_path, "int4_qat", "compressed-tensors")
    export_policy(tmp_path / "hf", CFG, packed, "hf", recipe="int4_qat", fingerprint=FP, version=7)
    int4 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(int4(tokens).logits, bf16(tokens).logits)


def test_a_tied_head_is_never_quantized(tmp_path):
    tied = ModelConfig(**{**CFG.to_dict(), "tie_word_embeddings": True})
    _, packed, out, _ = _export(tmp_path, "int4_qat", "compressed-tensors", cfg=tied)
    assert "lm_head" in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    export_policy(tmp_path / "hf", tied, packed, "hf", recipe="int4_qat", fingerprint=FP, version=7)
    int4 = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    tokens = torch.randint(0, CFG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(int4(tokens).logits, bf16(tokens).logits)


def test_kept_bf16_expert_layers_are_excluded_by_their_moe_module_name(tmp_path):
    _, _, out, _ = _export(tmp_path, "nvfp4_moe", "nvfp4")  # keeps the last layer (2) in bf16
    excluded = json.loads((out / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.2.mlp.experts" in excluded and "model.layers.2.mlp.experts.3.down_proj" in excluded
    assert "model.layers.0.mlp.experts" not in excluded
