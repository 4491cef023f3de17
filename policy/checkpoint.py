"""Hugging Face checkpoints in and out: Qwen3 (dense) and Qwen3-MoE folders <-> canonical tensors.

    cfg, tensors = load_hf("path/to/Qwen3-30B-A3B")        # config.json + safetensors (sharded or not)
    save_hf("out/", cfg, tensors)                           # AutoModelForCausalLM.from_pretrained("out/")

Names: Tandem's canonical names are Hugging Face's, except that each SwiGLU MLP (routed expert, shared
expert, dense MLP) has one fused `gate_up_proj.weight` [2F, D] = cat(gate_proj, up_proj) along rows
(the recipe quantizes gate and up as one tensor); `load_hf` fuses, `save_hf` splits.
Refused with a ValueError naming the field (`config_from_hf`): anything Tandem cannot represent, any
config key this module does not know, and tensors missing, unexpected or of the wrong shape. A tied
checkpoint loads tied (a stored `lm_head.weight` beside it is not used, as in HF).
Memory: tensors are read one at a time from memory-mapped files, so `load_hf` holds one copy plus a
tensor in flight; `iter_hf` streams; `read_config` / `read_shapes` read no weight; `save_hf` writes
shard by shard from a dict or any iterable, config.json last (an interrupted save is not loadable)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from policy.model import ModelConfig, parameter_shapes

__all__ = [
    "ShardWriter",
    "hf_config",
    "hf_names",
    "iter_hf",
    "load_hf",
    "load_hf_into",
    "read_config",
    "read_shapes",
    "save_hf",
]

_GATE_UP = re.compile(r"^(.*)\.gate_up_proj\.weight$")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Config keys that change nothing this model computes (training-only, generation defaults, bookkeeping).
_HARMLESS_KEYS = {
    "architectures",
    "attention_dropout",  # dropout: training only, 0 in every release
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "initializer_range",
    "max_window_layers",  # only read with use_sliding_window
    "output_router_logits",
    "router_aux_loss_coef",
    "transformers_version",
    "use_cache",
    "_name_or_path",
    "tandem",  # our own export metadata
}
_MAPPED_KEYS = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
    "tie_word_embeddings",
    "quantization_config",
    # qwen3_moe
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
}


def _refuse(path, field: str, why: str) -> ValueError:
    return ValueError(f"{path}: config.json field {field!r} {why}")


def _rope_theta(d: dict, where) -> float:
    theta = float(d.get("rope_theta", 10_000.0))
    for key in ("rope_scaling", "rope_parameters"):  # every spelling is checked; rope_parameters wins
        rp = d.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise _refuse(where, key, f"must be a mapping, got {rp!r}")
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind != "default":
            raise _refuse(where, key, f"has rope_type {kind!r}: only 'default' RoPE is implemented")
        extra = sorted(set(rp) - {"rope_type", "type", "rope_theta"})
        if extra:
            raise _refuse(where, key, f"has {extra}, which default RoPE does not use")
        theta = float(rp.get("rope_theta", theta))
    return theta


def config_from_hf(d: dict, where: str | Path = "config.json") -> ModelConfig:
    """A ModelConfig from a parsed config.json, or ValueError naming the field it cannot represent:
    a `model_type` other than qwen3 / qwen3_moe, sliding-window attention (`use_sliding_window`,
    `layer_types`), RoPE scaling of any type but "default", attention or MLP biases
    (`attention_bias`, `mlp_bias`, `*.bias` tensors), an activation other than SiLU, an already
    quantized checkpoint (`quantization_config`), or any config key this module does not know (so
    nothing is silently ignored)."""
    _refuse_unsupported(d, where)
    model_type = d["model_type"]
    fields = _common_fields(d, where)
    if model_type == "qwen3":
        fields.update(n_experts=0, top_k=0, expert_ffn_dim=0, ffn_dim=d.get("intermediate_size", 0))
    else:
        fields.update(_moe_fields(d))
    try:
        if model_type == "qwen3_moe":
            probe = ModelConfig(**{**fields, "ffn_dim": 1})
            dense = any(not probe.is_moe_layer(i) for i in range(probe.n_layers))
            # intermediate_size is only used by dense layers; keep it out of the fingerprint otherwise.
            fields["ffn_dim"] = d.get("intermediate_size", 0) if dense else 0
        return ModelConfig(**fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def _refuse_unsupported(d: dict, where) -> None:
    """ValueError naming the first field of config.json that Tandem's model cannot represent."""
    model_type = d.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise _refuse(where, "model_type", f"is {model_type!r}: supported are 'qwen3' and 'qwen3_moe'")
    unknown = sorted(set(d) - _HARMLESS_KEYS - _MAPPED_KEYS)
    if unknown:
        raise _refuse(
            where, unknown[0], f"is not understood by Tandem (unknown keys: {unknown}); refusing to ignore it"
        )
    if d.get("quantization_config") is not None:
        raise _refuse(where, "quantization_config", "is set: load a bf16/fp32 checkpoint, not a quantized one")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if d.get(key):
            raise _refuse(where, key, "is true: not supported (Tandem's model has no biases and no sliding window)")
    kinds = set(d.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise _refuse(where, "layer_types", f"has {sorted(kinds)}: only full attention is supported")
    if d.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", f"is {d['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if key not in d:
            raise _refuse(where, key, "is missing")


def _common_fields(d: dict, where) -> dict:
    """The ModelConfig fields of dense and MoE models alike."""
    heads = d["num_attention_heads"]
    return dict(
        vocab_size=d["vocab_size"],
        dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=_rope_theta(d, where),
        norm_eps=d.get("rms_norm_eps", 1e-6),
        max_seq_len=d.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def _moe_fields(d: dict) -> dict:
    """The routed-expert fields of a qwen3_moe config."""
    n_experts = d.get("num_experts", d.get("num_local_experts", 0))
    return dict(
        n_experts=n_experts,
        top_k=d.get("num_experts_per_tok", 0) if n_experts else 0,
        expert_ffn_dim=d.get("moe_intermediate_size", 0) if n_experts else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),  # HF's default for qwen3_moe
        decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
    )


def hf_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config.json of `cfg` (qwen3 when it has no experts, else qwen3_moe), readable by transformers
    4.x and 5.x (both the `rope_theta` and `rope_parameters` spellings, `num_experts`)."""
    if cfg.has_shared_expert:
        raise ValueError(
            f"shared_expert_ffn_dim={cfg.shared_expert_ffn_dim}: neither Hugging Face qwen3_moe (no shared expert) "
            "nor qwen2_moe (a sigmoid-gated shared expert, no q/k norms) computes Tandem's shared expert, so this "
            "model has no Hugging Face equivalent; a model without one (the demo preset) exports"
        )
    dtype_name = {v: k for k, v in _DTYPES.items()}[dtype]
    d = {
        "architectures": ["Qwen3MoeForCausalLM" if cfg.n_experts else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if cfg.n_experts else "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim or cfg.expert_ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": dtype_name,  # transformers 5
        "torch_dtype": dtype_name,  # transformers 4
        "use_cache": True,
    }
    if cfg.n_experts:
        d.update(
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.expert_ffn_dim,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    return d


def hf_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical name -> the Hugging Face tensor name(s) it is made of (two for a fused gate_up_proj)."""
    out = {}
    for name in parameter_shapes(cfg):
        m = _GATE_UP.match(name)
        out[name] = (f"{m.group(1)}.gate_proj.weight", f"{m.group(1)}.up_proj.weight") if m else (name,)
    return out


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder, from config.json alone (no weights read)."""
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise ValueError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{f}: expected a JSON object")
    return config_from_hf(d, f)


def _weight_files(path: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        files = {}
        for name, file in weight_map.items():
            f = (path / file).resolve()
            if f.parent != path.resolve() or not f.is_file():
                raise ValueError(f"{index}: shard {file!r} of {name!r} is not a file in {path}")
            files[name] = f
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class _Files:
    """Open safetensors files on demand (memory-mapped), closed together."""

    def __init__(self):
        self.handles = {}

    def get(self, file: Path):
        h = self.handles.get(file)
        if h is None:
            h = self.handles[file] = safe_open(file, framework="pt")
        return h

    def close(self):
        for h in self.handles.values():
            h.__exit__(None, None, None)
        self.handles.clear()


def _check_names(path: Path, cfg: ModelConfig, stored: Iterable[str]) -> None:
    expected = {n for names in hf_names(cfg).values() for n in names}
    stored = set(stored)
    if cfg.tie_word_embeddings:
        stored.discard("lm_head.weight")  # tied: HF ignores a stored head too
    biases = sorted(n for n in stored if n.endswith(".bias"))
    if biases:
        raise ValueError(f"{path}: biases are not supported, found {len(biases)} bias tensors ({biases[0]}, ...)")
    unknown, missing = sorted(stored - expected), sorted(expected - stored)
    if unknown or missing:
        raise ValueError(
            f"{path}: tensors do not match config.json: unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}, "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
        )


def read_shapes(path: str | Path) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """(config, canonical name -> shape) from config.json and the safetensors headers: no weight is read."""
    path = Path(path)
    cfg = read_config(path)
    files = _weight_files(path)
    _check_names(path, cfg, files)
    handles = _Files()
    try:
        shapes = {}
        for name, parts in hf_names(cfg).items():
            dims = [tuple(handles.get(files[p]).get_slice(p).get_shape()) for p in parts]
            shapes[name] = (sum(d[0] for d in dims), *dims[0][1:])
    finally:
        handles.close()
    expected = parameter_shapes(cfg)
    bad = [f"{n}: {shapes[n]} != {s}" for n, s in expected.items() if shapes[n] != s]
    if bad:
        raise ValueError(f"{path}: tensor shapes do not match config.json: {bad[:5]}")
    return cfg, shapes


def iter_hf(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every parameter, read one at a time, in `parameter_shapes` order.

    Tensors keep their stored dtype. Names and shapes are checked against config.json before any
    weight is read."""
    path = Path(path)
    cfg, _ = read_shapes(path)
    files = _weight_files(path)
    handles = _Files()
    try:
        for name, parts in hf_names(cfg).items():
            ts = [handles.get(files[p]).get_tensor(p) for p in parts]
            yield name, ts[0] if len(ts) == 1 else torch.cat(ts)
    finally:
        handles.close()


def load_hf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face qwen3 / qwen3_moe folder: (ModelConfig, canonical name -> tensor)."""
    return read_config(path), dict(iter_hf(path))


@torch.no_grad()
def load_hf_into(model, path: str | Path) -> None:
    """Copy a Hugging Face folder's weights into `model` (a policy.model.Transformer of the same config;
    its max_seq_len may differ, the one field a run may override) one tensor at a time (cast to the
    parameter dtype): peak memory is the model plus one tensor."""
    cfg = dataclasses.replace(read_config(path), max_seq_len=model.cfg.max_seq_len)
    if cfg != model.cfg:
        raise ValueError(f"{path}: its config.json does not describe this model ({_differences(cfg, model.cfg)})")
    params = dict(model.named_parameters())
    for name, t in iter_hf(path):
        params[name].copy_(t)


def _differences(a: ModelConfig, b: ModelConfig) -> str:
    da, db = a.to_dict(), b.to_dict()
    return ", ".join(f"{k}: {da[k]!r} vs {db[k]!r}" for k in da if da[k] != db[k])


class ShardWriter:
    """Writes safetensors shards of at most `max_shard_bytes` (a tensor larger than that gets its own
    shard) into `path`, then the index. One shard is named model.safetensors (no index)."""

    def __init__(self, path: str | Path, *, max_shard_bytes: int = 4 << 30, metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.shard and self.shard_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        t = t.contiguous()
        # A view (gate or up rows of a fused tensor) is copied: safetensors refuses tensors sharing memory.
        self.shard[name] = t.clone() if t._base is not None else t
        self.shard_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        tmp = self.path / f"model-tmp-{len(self.files):05d}.safetensors"
        save_file(self.shard, tmp, metadata=self.metadata)
        self.files.append((tmp, list(self.shard)))
        self.shard, self.shard_bytes = {}, 0

    def finish(self) -> None:
        if self.shard or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            self.files[0][0].replace(self.path / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp.replace(self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes, **self.metadata}, "weight_map": weight_map}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _pairs(tensors) -> Iterable[tuple[str, torch.Tensor]]:
    return tensors.items() if isinstance(tensors, Mapping) else tensors


def save_hf(
    path: str | Path,
    model_config: ModelConfig,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 4 << 30,
    metadata: Mapping[str, str] | None = None,
    extra_config: Mapping | None = None,
) -> None:
    """Write `tensors` (canonical names; a dict or an iterable of pairs, consumed once) as a Hugging
    Face folder that `AutoModelForCausalLM.from_pretrained` loads unchanged, in `dtype`, shard by shard.

    `metadata` goes into every safetensors header (strings); `extra_config` is merged into config.json.
    """
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype={dtype}: expected one of {', '.join(_DTYPES)}")
    config = hf_config(model_config, dtype=dtype)  # refuses a model without an HF equivalent first
    shapes = parameter_shapes(model_config)
    seen = set()
    writer = ShardWriter(path, max_shard_bytes=max_shard_bytes, metadata=metadata)
    for name, t in _pairs(tensors):
        if name not in shapes:
            raise ValueError(f"save_hf: {name!r} is not a parameter of this model config")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"save_hf: {name} has shape {tuple(t.shape)}, the config says {shapes[name]}")
        seen.add(name)
        m = _GATE_UP.match(name)
        t = t.detach().to(device="cpu", dtype=dtype)
        if m:
            gate, up = t.chunk(2)
            writer.add(f"{m.group(1)}.gate_proj.weight", gate)
            writer.add(f"{m.group(1)}.up_proj.weight", up)
        else:
            writer.add(name, t)
    missing = sorted(set(shapes) - seen)
    if missing:
        raise ValueError(f"save_hf: missing {len(missing)} tensors ({missing[0]}, ...)")
    writer.finish()
    (Path(path) / "config.json").write_text(json.dumps({**config, **(extra_config or {})}, indent=2) + "\n")
