"""Qwen3-MoE-style decoder in one file: config, modules, full-sequence and KV-cache forward.

One layer: RMSNorm -> grouped-query attention (q/k RMSNorm per head, RoPE) -> residual -> RMSNorm ->
MoE block (softmax router, top-k, routed SwiGLU experts with a fused gate_up projection, optional
always-on shared expert) or a dense SwiGLU MLP (Qwen3 dense; Qwen3-MoE's `mlp_only_layers` /
`decoder_sparse_step`) -> residual. Final RMSNorm and an LM head, untied unless
`tie_word_embeddings`. Parameter names are the policy contract's canonical ones (HF Qwen3-MoE style).
Generation (prefill, decode, sampling) is the rollout engine's: `rollout/engine.py`.

Rules: quantization is not in this file: every matmul and non-matmul parameter goes through the
model's `QuantHook` (plain by default; `policy.qat` installs QAT and packed-weight hooks), which sees
each matmul's site (the weight name without ".weight"; the activation site adds ".input"). A row's
result does not depend on the rest of the batch (per-token routing, per-row masks, no batch
statistics) up to last-bit float differences between batch shapes; in exact mode (the hook's `exact`,
`policy.exact`) bit for bit. MoE dispatch: `MoE`; routing
replay: `MoE.routed` takes forced expert ids per token and returns the ids it used (the forward's
`routes` / `return_routes`). No dropout, biases, router auxiliary loss, capacity limit or sliding
windows (why: docs/design-decisions.md)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from policy import compute, exact
from policy.fields import is_int, is_number
from policy.hashing import sha256_json

__all__ = [
    "PRESETS",
    "KVCache",
    "ModelConfig",
    "QuantHook",
    "Transformer",
    "activation_sites",
    "causal_mask",
    "parameter_shapes",
    "rms_norm",
    "rope",
    "rope_inv_freq",
]


# --------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of the decoder. Frozen and validated; `fingerprint()` is the manifest's model hash.

    `dim` need not equal `n_heads * head_dim` (Qwen3-30B-A3B: 2048 vs 32*128). `shared_expert_ffn_dim`
    0 means no shared expert. Layer i is an MoE layer when `n_experts > 0`, i is not in
    `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step` (Qwen3-MoE's rule); every
    other layer has a dense SwiGLU MLP of width `ffn_dim`. `n_experts` 0 is a dense model (Qwen3): then
    `top_k` and `expert_ffn_dim` are 0 too. `tie_word_embeddings`: no `lm_head.weight`; the logits are
    x @ embed_tokens.weight.T. `norm_topk_prob` renormalizes the top-k router probabilities to sum 1
    (Qwen3-MoE does). `max_seq_len` bounds generation (prompt + new tokens); RoPE has no table, so it
    is a guard, not an allocation.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    shared_expert_ffn_dim: int = 0
    ffn_dim: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        errors = []
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "decoder_sparse_step",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not is_int(value, lo=1):
                errors.append(f"{name}={value!r} must be a positive int")
        for name in ("n_experts", "top_k", "expert_ffn_dim", "shared_expert_ffn_dim", "ffn_dim"):
            value = getattr(self, name)
            if not is_int(value, lo=0):
                errors.append(f"{name}={value!r} must be an int >= 0")
        for name in ("norm_topk_prob", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name}={getattr(self, name)!r} must be a bool")
        layers = self.mlp_only_layers
        if not isinstance(layers, (tuple, list)) or not all(is_int(i) for i in layers):
            errors.append(f"mlp_only_layers={layers!r} must be a list of layer indices")
        else:
            object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < math.inf:
                errors.append(f"{name}={value!r} must be a finite number > 0")
        if not errors:
            if self.n_heads % self.n_kv_heads:
                errors.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
            if self.head_dim % 2:
                errors.append(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
            if self.top_k > self.n_experts:
                errors.append(f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
            if self.n_experts and not (self.top_k and self.expert_ffn_dim):
                errors.append(f"n_experts={self.n_experts} needs top_k > 0 and expert_ffn_dim > 0")
            if not self.n_experts and (self.top_k or self.expert_ffn_dim or self.shared_expert_ffn_dim):
                errors.append("a dense model (n_experts=0) has top_k, expert_ffn_dim and shared_expert_ffn_dim 0")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
            if bad:
                errors.append(f"mlp_only_layers {bad} outside 0..{self.n_layers - 1}")
            if not all(self.is_moe_layer(i) for i in range(self.n_layers)) and not self.ffn_dim:
                errors.append("ffn_dim must be > 0: some layers have a dense MLP")
        if errors:
            raise ValueError("invalid ModelConfig: " + "; ".join(errors))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "norm_eps", float(self.norm_eps))

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named preset (see `PRESETS`), optionally with fields replaced (validated again)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown} in overrides for preset {name!r}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {unknown}")
        return cls(**d)

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of every field (policy.hashing, as the manifest's)."""
        return sha256_json(self.to_dict())

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_ffn_dim > 0

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE's rule: sparse unless in mlp_only_layers or off the decoder_sparse_step grid."""
        return self.n_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in parameter_shapes(self).values())


PRESETS: dict[str, ModelConfig] = {
    # CPU demo: ~3.9M parameters (3.1M in routed experts). Every K is a multiple of 128 so every
    # built-in recipe (fp8_block 128x128 included) applies.
    "tiny": ModelConfig(
        vocab_size=512,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        n_experts=8,
        top_k=2,
        expert_ffn_dim=256,
        shared_expert_ffn_dim=256,
        rope_theta=10_000.0,
        max_seq_len=1024,
    ),
    # ~0.74B parameters: GPU smoke tests and TP planning at a realistic shape.
    "small": ModelConfig(
        vocab_size=32768,
        dim=1024,
        n_layers=12,
        n_heads=16,
        n_kv_heads=4,
        head_dim=64,
        n_experts=32,
        top_k=4,
        expert_ffn_dim=512,
        shared_expert_ffn_dim=1024,
        max_seq_len=8192,
    ),
    # Dense Qwen3-style twin of "tiny" (tied embeddings): the dense MLP and tied-head paths.
    "tiny-dense": ModelConfig(
        vocab_size=512,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        n_experts=0,
        top_k=0,
        expert_ffn_dim=0,
        ffn_dim=512,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
        max_seq_len=1024,
    ),
    # Qwen/Qwen3-30B-A3B (config.json of the HF release).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        n_experts=128,
        top_k=8,
        expert_ffn_dim=768,
        shared_expert_ffn_dim=0,
        max_seq_len=40960,
    ),
    # Qwen/Qwen3-235B-A22B.
    "qwen3-235b-a22b": ModelConfig(
        vocab_size=151936,
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        n_experts=128,
        top_k=8,
        expert_ffn_dim=1536,
        shared_expert_ffn_dim=0,
        max_seq_len=40960,
    ),
}
# The demo's model: "tiny" without the shared expert, so that it is exactly a Hugging Face qwen3_moe
# (transformers' qwen2_moe has a shared expert, but gated by a sigmoid and without q/k norms).
PRESETS["demo"] = dataclasses.replace(PRESETS["tiny"], shared_expert_ffn_dim=0)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every parameter, in `named_parameters()` order, without allocating."""
    D, hd, F_, Fs = cfg.dim, cfg.head_dim, cfg.expert_ffn_dim, cfg.shared_expert_ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (D,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (cfg.n_heads * hd, D)
        shapes[f"{p}.self_attn.k_proj.weight"] = (cfg.n_kv_heads * hd, D)
        shapes[f"{p}.self_attn.v_proj.weight"] = (cfg.n_kv_heads * hd, D)
        shapes[f"{p}.self_attn.o_proj.weight"] = (D, cfg.n_heads * hd)
        shapes[f"{p}.self_attn.q_norm.weight"] = (hd,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (D,)
        if not cfg.is_moe_layer(i):
            shapes[f"{p}.mlp.gate_up_proj.weight"] = (2 * cfg.ffn_dim, D)
            shapes[f"{p}.mlp.down_proj.weight"] = (D, cfg.ffn_dim)
            continue
        shapes[f"{p}.mlp.gate.weight"] = (cfg.n_experts, D)
        for e in range(cfg.n_experts):
            shapes[f"{p}.mlp.experts.{e}.gate_up_proj.weight"] = (2 * F_, D)
            shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (D, F_)
        if Fs:
            shapes[f"{p}.mlp.shared_expert.gate_up_proj.weight"] = (2 * Fs, D)
            shapes[f"{p}.mlp.shared_expert.down_proj.weight"] = (D, Fs)
    shapes["model.norm.weight"] = (D,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    return shapes


def activation_sites(cfg: ModelConfig) -> dict[str, int]:
    """Activation site name ("<weight name minus .weight>.input") -> K, for every matmul input."""
    return {
        name[: -len(".weight")] + ".input": shape[1]
        for name, shape in parameter_shapes(cfg).items()
        if len(shape) == 2 and name != "model.embed_tokens.weight"
    }


# --------------------------------------------------------------------------------------------------
# Quantization hooks


class QuantHook:
    """How the model runs each matmul and reads each non-matmul parameter. The default is plain.

    `linear(site, x, weight, x_hat=None)`: y = x @ weight.T for the matmul at `site` (the weight
        name minus ".weight"). `x_hat`, when given, is x already activation-quantized by
        `quantize_inputs` (the MoE block quantizes all experts' inputs in one call); a hook with a
        high-precision backward still needs x itself.
    `quantize_inputs(sites, x, counts)`: activation quantization of x [sum(counts), K] whose rows
        come in chunks, chunk i feeding site sites[i]; returns x̂ (anything with `.split(counts)`
        giving each chunk's x_hat: policy.qat returns a Compute-contract operand), or None when
        no site quantizes. Rows are quantized independently, so one call over all chunks gives the
        same bits as one call per chunk, minus the per-call overhead.
    `can_group(sites)` / `grouped_linear(sites, x, weights, offs, groups)`: the matmuls of several
        sites at once (an MoE projection's experts): x [M, K] rows sorted by site, offs [E] int32
        where each site's rows end, groups [M] each row's site index; y [M, N] as `linear` per row,
        in one grouped GEMM (no host sync). The MoE uses it only where `can_group` says so.
    `param(name, p)`: the effective value of a non-matmul parameter (embeddings, norm weights).
    `exact`: the model computes in exact mode (`policy.exact`: batch-invariant matmuls, attention,
        norms and softmaxes; the MoE loops over experts); a hook's matmuls then use `exact.mm`.
    Implementations must treat rows independently (per-row scales only): no batch statistics.
    """

    def __init__(self, *, exact: bool = False):
        self.exact = exact

    def linear(self, site: str, x: Tensor, weight: Tensor, x_hat: Tensor | None = None) -> Tensor:
        x = x if x_hat is None else x_hat
        if self.exact:
            return exact.mm(x, weight).to(compute.compute_dtype(x))
        return F.linear(x, weight)

    def can_group(self, sites: Sequence[str]) -> bool:
        return True

    def grouped_linear(
        self, sites: Sequence[str], x: Tensor, weights: Sequence[Tensor], offs: Tensor, groups: Tensor
    ) -> Tensor:
        dtype = compute.compute_dtype(x)
        with torch.no_grad():
            w_op = compute.Operand(torch.stack([w.detach() for w in weights]).to(dtype))
        x_op = compute.plain(x.detach().to(dtype))
        if torch.is_grad_enabled() and (x.requires_grad or weights[0].requires_grad):
            return compute.GroupedLinear.apply(x, x_op, w_op, offs, groups, True, dtype, *weights)
        return compute.grouped_matmul(x_op, w_op, offs, groups, dtype)

    def quantize_inputs(self, sites: Sequence[str], x: Tensor, counts: Sequence[int]) -> Tensor | None:
        return None

    def param(self, name: str, p: Tensor) -> Tensor:
        return p


_PLAIN = QuantHook()


# --------------------------------------------------------------------------------------------------
# Modules


class Linear(nn.Module):
    """Bias-free linear whose matmul goes through the hook. Weight is [out, in] (K = in)."""

    def __init__(self, in_features: int, out_features: int, site: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.site = site

    def forward(self, x: Tensor, hook: QuantHook, x_hat: Tensor | None = None) -> Tensor:
        return hook.linear(self.site, x, self.weight, x_hat)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.name = name + ".weight"

    def forward(self, x: Tensor, hook: QuantHook) -> Tensor:
        return (exact.rms_norm if hook.exact else rms_norm)(x, hook.param(self.name, self.weight), self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: fp32 statistics per row (Qwen3 does the same), no cross-row
    reduction, the result in x's dtype. The rollout engines call it too."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def causal_mask(key_valid: Tensor, start: int) -> Tensor:
    """The attention mask [B, 1, T, S] (True = attend) of T new tokens after `start` cached slots,
    key_valid [B, S] (S = start + T) marking real tokens: query t (slot start + t) sees the real keys
    of slots <= its own. A query always sees its own slot, so that rows of padding have a
    well-defined (unused) output instead of a NaN softmax."""
    S = key_valid.shape[1]
    q_index = torch.arange(start, S, device=key_valid.device)
    k_index = torch.arange(S, device=key_valid.device)
    own = (k_index[None, :] == q_index[:, None])[None]
    return (((k_index[None, :] <= q_index[:, None])[None] & key_valid[:, None, :]) | own)[:, None]


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (HF/NeoX convention, as Qwen3) in fp32, the result in x's dtype.
    x [..., hd]; cos/sin broadcast to [..., hd/2] (here [B, T, 1, hd/2])."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, device=None) -> Tensor:
    """RoPE's inverse frequencies [hd/2] fp32: 1 / theta^(2i / hd)."""
    hd = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.dim, q_out, f"{prefix}.q_proj")
        self.k_proj = Linear(cfg.dim, kv_out, f"{prefix}.k_proj")
        self.v_proj = Linear(cfg.dim, kv_out, f"{prefix}.v_proj")
        self.o_proj = Linear(q_out, cfg.dim, f"{prefix}.o_proj")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, f"{prefix}.q_norm")
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, f"{prefix}.k_norm")

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        hook: QuantHook,
        kv: tuple[Tensor, Tensor] | None,
        start: int,
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x, hook).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x, hook).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x, hook).view(B, T, self.n_kv_heads, self.head_dim)
        q = rope(self.q_norm(q, hook), cos, sin).transpose(1, 2)
        k = rope(self.k_norm(k, hook), cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if kv is not None:
            k_buf, v_buf = kv
            k_buf[:, :, start : start + T] = k
            v_buf[:, :, start : start + T] = v
            k, v = k_buf[:, :, : start + T], v_buf[:, :, : start + T]
        if hook.exact:
            o = exact.attention(q, k, v, mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), hook)


class Expert(nn.Module):
    """SwiGLU FFN: gate_up_proj rows [0, F) are the gate, [F, 2F) the up projection. Also the dense MLP."""

    def __init__(self, dim: int, ffn_dim: int, prefix: str):
        super().__init__()
        self.ffn_dim = ffn_dim
        self.gate_up_proj = Linear(dim, 2 * ffn_dim, f"{prefix}.gate_up_proj")
        self.down_proj = Linear(ffn_dim, dim, f"{prefix}.down_proj")

    def hidden(self, x: Tensor, hook: QuantHook, x_hat: Tensor | None = None) -> Tensor:
        gate, up = self.gate_up_proj(x, hook, x_hat).split(self.ffn_dim, dim=-1)
        return (exact.silu if hook.exact else F.silu)(gate) * up

    def forward(self, x: Tensor, hook: QuantHook) -> Tensor:
        return self.down_proj(self.hidden(x, hook), hook)


class MoE(nn.Module):
    """The MoE block. Dispatch: the (token, slot) assignments sorted by expert, then either one grouped
    GEMM per projection for all experts (`policy.compute.grouped_matmul`, `torch._grouped_mm`: the
    default on CUDA in bf16, no host sync) or a loop over experts on gathered tokens (the reference;
    the default on the CPU, and wherever the hook cannot group, e.g. fp8_block's per-K-block scales).
    `MoE.grouped` forces either (None: that default). Both give the same function up to accumulation
    order; parameters stay per expert (canonical names), the grouped path stacks them per forward.
    The shared expert, when present, is added DeepSeek/GLM style (ungated)."""

    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = cfg.n_experts, cfg.top_k, cfg.norm_topk_prob
        self.gate = Linear(cfg.dim, cfg.n_experts, f"{prefix}.gate")
        self.experts = nn.ModuleList(
            Expert(cfg.dim, cfg.expert_ffn_dim, f"{prefix}.experts.{e}") for e in range(cfg.n_experts)
        )
        self.shared_expert = (
            Expert(cfg.dim, cfg.shared_expert_ffn_dim, f"{prefix}.shared_expert") if cfg.has_shared_expert else None
        )
        self.grouped: bool | None = None  # grouped GEMM (True) or the loop over experts; None: grouped on CUDA bf16
        self._sites = (
            [e.gate_up_proj.site for e in self.experts],
            [e.down_proj.site for e in self.experts],
        )

    def expert_groups(self) -> list[tuple[list[str], list[Tensor]]]:
        """(weight names, parameters) of the experts' gate_up_proj, then of their down_proj."""
        return [
            ([s + ".weight" for s in self._sites[0]], [e.gate_up_proj.weight for e in self.experts]),
            ([s + ".weight" for s in self._sites[1]], [e.down_proj.weight for e in self.experts]),
        ]

    def _use_grouped(self, x: Tensor, hook: QuantHook) -> bool:
        if hook.exact:
            return False  # exact mode: the loop over experts, with exact.mm per expert
        grouped = self.grouped
        if grouped is None:
            grouped = x.is_cuda and compute.compute_dtype(x) == torch.bfloat16
        return grouped and hook.can_group(self._sites[0]) and hook.can_group(self._sites[1])

    def _grouped_experts(self, xg: Tensor, flat: Tensor, order: Tensor, hook: QuantHook) -> Tensor:
        """All experts' outputs for the sorted rows xg, one grouped GEMM per projection: no host sync
        (the counts stay on the device)."""
        groups = flat.index_select(0, order)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # not bincount: on CUDA it syncs for max()
        offs = counts.cumsum(0).to(torch.int32)
        gu_sites, down_sites = self._sites
        gu = hook.grouped_linear(gu_sites, xg, [e.gate_up_proj.weight for e in self.experts], offs, groups)
        gate, up = gu.split(self.experts[0].ffn_dim, dim=-1)
        h = F.silu(gate) * up
        return hook.grouped_linear(down_sites, h, [e.down_proj.weight for e in self.experts], offs, groups)

    def forward(self, x: Tensor, hook: QuantHook) -> Tensor:
        return self.routed(x, hook)[0]

    def routed(self, x: Tensor, hook: QuantHook, route: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """-> (output like x, the expert ids used [..., k] long, the router's own top-k ids [..., k]).
        `route` [..., k] (x's leading shape): forced expert ids per token, -1 where the router picks
        (routing replay); the gate weights are then the router's own softmax probabilities gathered
        at the forced experts (renormalized over the k when norm_topk_prob), so the router stays
        differentiable. Without `route` the two id tensors are the same."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, k = x.shape[0], self.top_k
        if N == 0:
            none = torch.zeros(*shape[:-1], k, dtype=torch.long, device=x.device)
            return x.clone().view(shape), none, none
        ex = hook.exact
        logits = self.gate(x, hook).float()
        probs = exact.softmax(logits) if ex else logits.softmax(dim=-1)
        weights, experts = probs.topk(k, dim=-1)
        own = experts
        if route is not None:
            forced = route.reshape(N, k).to(device=x.device, dtype=torch.long)
            experts = torch.where(forced[:, :1] >= 0, forced, experts)
            weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / (exact.tree_sum(weights, keepdim=True) if ex else weights.sum(dim=-1, keepdim=True))
        # Dispatch: sort the N*k (token, slot) assignments by expert, run each expert once on its
        # gathered rows, scatter the results back to (token, slot) order, then sum the k slots per
        # token in slot order. A token's arithmetic depends only on its own routing. Activation
        # quantization of all experts' inputs is one hook call per matmul kind, not one per expert.
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        xg = x.index_select(0, order // k)
        if self._use_grouped(x, hook):
            ys = self._grouped_experts(xg, flat, order, hook)
        else:
            ys = self._loop_experts(xg, flat, hook)
        y = ys.new_empty(N * k, shape[-1])  # the experts' dtype: bf16 under autocast, x's otherwise
        y[order] = ys
        out = y.view(N, k, -1) * weights.unsqueeze(-1).to(y.dtype)
        out = exact.tree_sum(out, 1) if ex else out.sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x, hook)
        return out.view(shape), experts.view(*shape[:-1], k), own.view(*shape[:-1], k)

    def _loop_experts(self, xg: Tensor, flat: Tensor, hook: QuantHook) -> Tensor:
        """The reference: each expert once on its gathered rows (a host sync for the counts)."""
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        used = [e for e in range(self.n_experts) if counts[e]]
        sizes = [counts[e] for e in used]
        xs = xg.split(sizes)
        xg_hat = hook.quantize_inputs([self.experts[e].gate_up_proj.site for e in used], xg, sizes)
        xs_hat = xs if xg_hat is None else xg_hat.split(sizes)
        h = torch.cat([self.experts[e].hidden(xs[i], hook, xs_hat[i]) for i, e in enumerate(used)])
        hs = h.split(sizes)
        h_hat = hook.quantize_inputs([self.experts[e].down_proj.site for e in used], h, sizes)
        hs_hat = hs if h_hat is None else h_hat.split(sizes)
        return torch.cat([self.experts[e].down_proj(hs[i], hook, hs_hat[i]) for i, e in enumerate(used)])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        p = f"model.layers.{i}"
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, f"{p}.input_layernorm")
        self.self_attn = Attention(cfg, f"{p}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, f"{p}.post_attention_layernorm")
        self.mlp = MoE(cfg, f"{p}.mlp") if cfg.is_moe_layer(i) else Expert(cfg.dim, cfg.ffn_dim, f"{p}.mlp")

    def forward(self, x, cos, sin, mask, hook, kv, start, route=None):
        """-> (x, the MoE's (used, router's own) expert ids [B, T, k] each, or None for a dense MLP);
        route: see `MoE.routed`."""
        x = x + self.self_attn(self.input_layernorm(x, hook), cos, sin, mask, hook, kv, start)
        h = self.post_attention_layernorm(x, hook)
        if isinstance(self.mlp, MoE):
            y, used, own = self.mlp.routed(h, hook, route)
            return x + y, (used, own)
        return x + self.mlp(h, hook), None


class KVCache:
    """Per-layer key/value buffers [B, Hkv, capacity, hd] plus which slots hold real tokens.

    Rows advance in lockstep (`length` is shared); padding and finished rows are slots with
    `key_valid` False, which no query attends to. `next_pos[b]` is row b's next RoPE position (its
    count of real tokens so far), so left padding does not shift positions.
    """

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, *, dtype=torch.float32, device=None):
        if capacity > cfg.max_seq_len:
            raise ValueError(f"KV cache capacity {capacity} exceeds max_seq_len={cfg.max_seq_len}")
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.n_layers)
        ]
        self.key_valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.length = 0
        self.capacity = capacity


class TiedHead(nn.Module):
    """The LM head of a tied model: logits = x @ effective(embed_tokens.weight).T. It owns no parameter
    (the embedding is held outside the module tree, so names and state_dict stay canonical); `weight`
    is the embedding's, for code that asks the head for its device or dtype."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self._embed = (embed,)  # a tuple is not registered as a submodule

    @property
    def weight(self) -> Tensor:
        return self._embed[0].weight

    def forward(self, x: Tensor, hook: QuantHook) -> Tensor:
        w = hook.param("model.embed_tokens.weight", self.weight)
        return exact.mm(x, w).to(x.dtype) if hook.exact else F.linear(x, w)


class _Body(nn.Module):
    """Holds the `model.` prefix of the canonical names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, "model.norm")


class Transformer(nn.Module):
    """The policy model. Parameters carry the canonical names; see `parameter_shapes`.

    forward(tokens [B, T], attention_mask=None, cache=None, last_only=False) -> logits [B, T|1, V]
      attention_mask [B, T] bool, True = real token; any padding pattern (left or right) is fine:
      positions count real tokens only and padded keys are never attended to. With `cache`, the
      tokens are appended to it (incremental decoding).
    token_logprobs(tokens, targets, attention_mask=None, temperature=1.0) -> [B, T] fp32
    token_logprobs_by_layer(tokens, targets, chunks, ...): the same per chunk of rows, layer by layer
    load_weights({canonical name: tensor}) copies effective weights in (e.g. dequantized packed ones).
    quant_hook: a `QuantHook` or None (plain). `exact` (read-only): the hook's exact mode (policy.exact).
    routes / return_routes (forward and token_logprobs): routing replay, forced expert ids per token
      and MoE layer [B, T, n MoE layers, k] (-1 = the router's choice), and the ids used, returned;
      with router_own=True the ids returned are the router's own top-k instead (router agreement).

    On the meta device (`with torch.device("meta"): Transformer(cfg)`) nothing is allocated or
    initialized, which is how planning code inspects the 30B model.
    """

    def __init__(self, cfg: ModelConfig, *, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = (
            TiedHead(self.model.embed_tokens) if cfg.tie_word_embeddings else Linear(cfg.dim, cfg.vocab_size, "lm_head")
        )
        self.quant_hook: QuantHook | None = None
        self.activation_checkpointing = False  # recompute each layer in the backward (training only)
        if self.model.embed_tokens.weight.device.type != "meta":
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int | None = 0) -> None:
        """Normal(0, 0.02) matrices, output projections scaled by 1/sqrt(2 n_layers), unit norms."""
        g = torch.Generator(device=self.model.embed_tokens.weight.device)
        g.manual_seed(0 if seed is None else seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.normal_(0.0, std, generator=g)

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, Tensor], *, strict: bool = True) -> None:
        """Copy canonical-name tensors into the parameters (cast to the parameter dtype).

        strict: every parameter must be given, and no unknown names. Shapes must match exactly.
        """
        params = dict(self.named_parameters())
        unknown = sorted(set(tensors) - set(params))
        missing = sorted(set(params) - set(tensors)) if strict else []
        bad = [
            f"{n}: {tuple(t.shape)} != {tuple(params[n].shape)}"
            for n, t in tensors.items()
            if n in params and tuple(t.shape) != tuple(params[n].shape)
        ]
        if unknown or missing or bad:
            raise ValueError(
                f"load_weights: unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''}, "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"bad shapes {bad[:5]}"
            )
        for n, t in tensors.items():
            params[n].copy_(t)

    def forward(
        self,
        tokens: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        routes: Tensor | None = None,
        return_routes: bool = False,
        router_own: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        hook = self.quant_hook or _PLAIN
        x, args = self._inputs(tokens, attention_mask, cache, hook)
        x, ids = self._layers(x, args, routes)
        if cache is not None:
            cache.length += tokens.shape[1]
        if last_only:
            x = x[:, -1:]
        logits = self._head(x, hook)
        if not return_routes:
            return logits
        B, T = tokens.shape
        k, which = self.cfg.top_k, 1 if router_own else 0
        ids = (
            torch.stack([i[which] for i in ids], dim=2)
            if ids
            else torch.zeros(B, T, 0, k, dtype=torch.long, device=tokens.device)
        )
        return logits, ids[:, -1:] if last_only else ids

    def _inputs(self, tokens: Tensor, attention_mask: Tensor | None, cache: KVCache | None, hook: QuantHook):
        """The embedded tokens and the layers' arguments (cos, sin, mask, hook, cache, start); with
        `cache`, its positions and key mask advanced past the tokens (its length is the caller's)."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        device = tokens.device
        valid = (
            torch.ones(B, T, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.bool)
        )
        if valid.shape != tokens.shape:
            raise ValueError(f"attention_mask shape {tuple(valid.shape)} != tokens shape {tuple(tokens.shape)}")
        rank = (valid.cumsum(dim=1) - 1).clamp(min=0)  # index among the row's real tokens
        if cache is None:
            start, positions, key_valid = 0, rank, valid
        else:
            start = cache.length
            if start + T > cache.capacity:
                raise ValueError(f"KV cache full: {start} + {T} tokens > capacity {cache.capacity}")
            positions = cache.next_pos[:, None] + rank
            cache.key_valid[:, start : start + T] = valid
            cache.next_pos += valid.sum(dim=1)
            key_valid = cache.key_valid[:, : start + T]
        mask = causal_mask(key_valid, start)  # [B, 1, T, S]
        angles = positions.float()[..., None] * rope_inv_freq(self.cfg, device)  # [B, T, hd/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        emb = hook.param("model.embed_tokens.weight", self.model.embed_tokens.weight)
        return F.embedding(tokens, emb), (cos, sin, mask, hook, cache, start)

    def _head(self, x: Tensor, hook: QuantHook) -> Tensor:
        return self.lm_head(self.model.norm(x, hook), hook)

    def _layers(self, x: Tensor, args: tuple, routes: Tensor | None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The decoder layers on x [B, T, D] -> (x, each MoE layer's (used, router's own) expert ids,
        [B, T, k] each); routes: forced ids [B, T, n MoE layers, k] (-1: the router's), or None."""
        cos, sin, mask, hook, cache, start = args
        B, T, k = x.shape[0], x.shape[1], self.cfg.top_k
        moe = self.moe_layers()
        if routes is not None and tuple(routes.shape) != (B, T, len(moe), k):
            raise ValueError(f"routes shape {tuple(routes.shape)} != {(B, T, len(moe), k)} (B, T, MoE layers, k)")
        ckpt = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        routed = []
        for i, layer in enumerate(self.model.layers):
            route = None if routes is None or i not in moe else routes[:, :, moe.index(i)]
            if ckpt:  # non-reentrant: autocast and the hook replay as they ran
                x, ids = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, mask, hook, None, start, route, use_reentrant=False
                )
            else:
                x, ids = layer(x, cos, sin, mask, hook, None if cache is None else cache.layers[i], start, route)
            if ids is not None:
                routed.append(ids)
        return x, routed

    @property
    def exact(self) -> bool:
        """Exact mode (`policy.exact`): set by the hook installed (`QuantHook(exact=True)`, or
        `policy.qat`'s with exact=True)."""
        return bool(self.quant_hook is not None and self.quant_hook.exact)

    def moe_layers(self) -> list[int]:
        """The indices of the MoE layers (the routes' third axis, in this order)."""
        return [i for i in range(self.cfg.n_layers) if self.cfg.is_moe_layer(i)]

    def token_logprobs(
        self,
        tokens: Tensor,
        targets: Tensor,
        *,
        attention_mask: Tensor | None = None,
        temperature: float = 1.0,
        routes: Tensor | None = None,
        return_routes: bool = False,
        router_own: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """log p(targets[b, t] | tokens[b, :t+1]) in fp32, [B, T], from logits / temperature.

        Positions masked out by `attention_mask` get garbage values; the caller masks them.
        routes [B, T, n MoE layers, k] long: forced expert ids (-1: the router's own), see
        `MoE.routed`; return_routes: also return the ids every MoE layer used (same shape), or with
        router_own the router's own top-k ids.
        """
        if targets.shape != tokens.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
        out = self(
            tokens, attention_mask=attention_mask, routes=routes, return_routes=return_routes, router_own=router_own
        )
        logits, used = out if return_routes else (out, None)
        logp = self._target_logprobs(logits, targets, temperature)
        return (logp, used) if return_routes else logp

    @torch.no_grad()
    def token_logprobs_by_layer(
        self,
        tokens: Tensor,
        targets: Tensor,
        chunks: Sequence[Tensor],
        *,
        attention_mask: Tensor | None = None,
        temperature: float = 1.0,
        routes: Tensor | None = None,
    ) -> Tensor:
        """`token_logprobs` of rows `r` for each row-index tensor r of `chunks`, concatenated in
        that order: the same values bit for bit (every chunk runs the same ops as a call of its
        own), computed layer by layer, each layer on every chunk before the next layer starts. A
        hook that builds a weight's operand at its first use and keeps only the current layer's
        (trainer.versions) builds each once per call, not once per chunk. No autograd, no cache;
        holds the hidden states of every chunk."""
        if targets.shape != tokens.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != tokens shape {tuple(tokens.shape)}")
        moe, (B, T), k = self.moe_layers(), tokens.shape, self.cfg.top_k
        if routes is not None and tuple(routes.shape) != (B, T, len(moe), k):
            raise ValueError(f"routes shape {tuple(routes.shape)} != {(B, T, len(moe), k)} (B, T, MoE layers, k)")
        hook = self.quant_hook or _PLAIN
        mask = attention_mask if attention_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
        xs, inputs = map(list, zip(*(self._inputs(tokens[r], mask[r], None, hook) for r in chunks)))
        for i, layer in enumerate(self.model.layers):
            for c, (r, (cos, sin, m, _, _, start)) in enumerate(zip(chunks, inputs)):
                route = None if routes is None or i not in moe else routes[r][:, :, moe.index(i)]
                xs[c] = layer(xs[c], cos, sin, m, hook, None, start, route)[0]
        return torch.cat(
            [self._target_logprobs(self._head(x, hook), targets[r], temperature) for x, r in zip(xs, chunks)]
        )

    def _target_logprobs(self, logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
        """[B, T] fp32 log-probs of `targets` from logits / temperature (exact mode: policy.exact's)."""
        if self.exact:
            return exact.scaled_log_softmax(logits, temperature).gather(-1, targets[..., None]).squeeze(-1)
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(dim=-1)
