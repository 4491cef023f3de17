"""The packed engine's weights: one policy version's published tensors on a device, as the decode step reads them.

`WeightLoader(cfg, plan, device, dtype)` builds `TopWeights` (embedding, final norm, LM head) and one
`LayerWeights` per layer from the published tensors, without dequantizing the 4-bit ones. Rules:
- every matmul follows DESIGN.md's Compute contract: its operands are `policy.formats.operand` of the
  published weights and of the per-token quantized activations (`ActQuant`, bitwise QAT's);
- an nvfp4 / int4 weight is packed for `rollout.kernels`' matmuls on CUDA when its activation has no
  per-K-block scales; any other weight is multiplied as its operand (bf16: the weight itself);
- `layout_of` says what a set of tensors looks like, values aside; two versions with equal layouts
  build pieces of the same structure, and `copy_into` copies one piece into another in place.
The norms and the embedding are dequantized to the engine dtype."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import policy.kernels as PK
from policy import compute
from policy.formats import Operand
from policy.model import ModelConfig
from policy.recipe import Plan
from rollout import kernels as RK

__all__ = ["ActQuant", "ExpertWeights", "LayerWeights", "LinearWeight", "TopWeights", "WeightLoader", "copy_into"]
__all__ += ["layout_of", "matmul_triton"]


def matmul_triton():
    """The Triton decode matmuls, imported on first use (CPU runs never import Triton)."""
    return importlib.import_module("rollout.kernels.matmul_triton")


class ActQuant:
    """Per-token activation quantization at one site -> its Compute-contract operand, bitwise QAT's
    (policy.kernels.quantize, then policy.formats' operand; nvfp4's values fused on CUDA). No
    host-side finite check: a NaN or Inf in the residual stream reaches the logits, whose finite
    flag `generate` reads once per call."""

    def __init__(self, fmt: str, kwargs: dict):
        self.fmt, self.kwargs = fmt, dict(kwargs)
        self.scaled = fmt in ("nvfp4", "fp8_block")  # operands with scales (not a plain matmul)

    def __call__(self, x2: Tensor, ops) -> Operand:
        fast = x2.device.type == "cuda" and PK.backend(x2) == "triton"
        q = PK.quantize(self.fmt, x2, check_finite=not fast, **self.kwargs)
        if self.fmt == "nvfp4":
            return Operand(ops.nvfp4_operand(q.codes, q.block_scales), scale=q.global_scale)
        return PK.formats.operand(q)


def _kernel_act(*acts) -> bool:
    """Whether the 4-bit kernels can take these sites' activation operands (no per-K-block scales)."""
    return all(a is None or a.fmt != "fp8_block" for a in acts)


def _x_operand(act, x2: Tensor, ops) -> Operand:
    """The activation operand of x2 [M, K] at a site: quantized, or x2 itself."""
    return compute.plain(x2) if act is None else act(x2, ops)


class LinearWeight:
    """y = matmul(x̂, Ŵ) for one weight: a PackedLinear for the 4-bit kernels, else its operand
    (`weight`: the operand's values in the engine dtype when it has no scales, for plain matmuls)."""

    def __init__(self, q, act, device, dtype):
        self.act = act
        self.packed = None
        self.weight = None
        self.w = None
        # The kernels take per-row activation scales (nvfp4), not per-K-block ones (fp8_block).
        if PK.formats.format_of(q) in ("nvfp4", "int4") and device.type == "cuda" and _kernel_act(act):
            p = RK.pack(PK.to_device(q, device))
            if RK._kernel_fmt(p, torch.empty(1, p.shape[1], dtype=torch.bfloat16, device=device)) is not None:
                self.packed = p
        if self.packed is None:
            self.w = PK.formats.operand(PK.to_device(q, device))
            if self.w.scale is None and self.w.block_scale is None:
                self.weight = self.w.values.to(dtype)

    def __call__(self, x: Tensor, ops) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.weight is not None and (self.act is None or not self.act.scaled):
            y = F.linear(_x_operand(self.act, x2, ops).values.to(x.dtype), self.weight)  # = compute.matmul
        elif self.packed is None:
            y = compute.matmul(_x_operand(self.act, x2, ops), self.w, x.dtype)
        else:
            p = self.packed
            mt = matmul_triton()
            fmt = mt.FMT_NVFP4 if p.fmt == "nvfp4" else mt.FMT_INT4
            xo = _x_operand(self.act, x2, ops)
            y = mt.w4a16_matmul(
                xo.values.to(x.dtype), p.codes, p.scales, p.global_scale, fmt, p.group_size, x_scale=xo.scale
            )
        return y.view(*x.shape[:-1], y.shape[-1])


class ExpertWeights:
    """The routed experts of one layer: gate_up [E, 2F, D] and down [E, D, F], packed or dense."""

    def __init__(self, gate_up: list, down: list, act_gu, act_dn, device, dtype):
        self.act_gu, self.act_dn, self.dtype = act_gu, act_dn, dtype
        fmts = {PK.formats.format_of(q) for q in gate_up + down}
        self.kernel = None
        self.plain = False
        if device.type == "cuda" and fmts <= {"nvfp4", "int4"} and len(fmts) == 1 and _kernel_act(act_gu, act_dn):
            gu = RK.pack_experts([PK.to_device(q, device) for q in gate_up])
            dn = RK.pack_experts([PK.to_device(q, device) for q in down])
            probe = torch.empty(1, 1, dtype=torch.bfloat16, device=device)
            ok_gu = RK._kernel_fmt(gu, probe.expand(1, gu.shape[1])) is not None
            if ok_gu and RK._kernel_fmt(dn, probe.expand(1, dn.shape[1])) is not None:
                mt = matmul_triton()
                self.kernel = mt.FMT_NVFP4 if gu.fmt == "nvfp4" else mt.FMT_INT4
                self.gu, self.dn = gu, dn
        if self.kernel is None:
            self.op_gu = [PK.formats.operand(PK.to_device(q, device)) for q in gate_up]
            self.op_dn = [PK.formats.operand(PK.to_device(q, device)) for q in down]
            acts = [a for a in (act_gu, act_dn) if a is not None]
            self.plain = all(o.scale is None and o.block_scale is None for o in self.op_gu + self.op_dn)
            self.plain = self.plain and not any(a.scaled for a in acts)
            if self.plain:  # [E, N, K] values; grouped_mm reads them as [E, K, N] through a transposed view
                self.w_gu = torch.stack([o.values.to(dtype) for o in self.op_gu])
                self.w_dn = torch.stack([o.values.to(dtype) for o in self.op_dn])
                del self.op_gu, self.op_dn
        self.n_experts = len(gate_up)
        self.ffn, self.dim = gate_up[0].shape[0] // 2, down[0].shape[0]
        self.device = device

    @torch.no_grad()
    def load(self, gate_up: list, down: list) -> None:
        """Overwrite these experts with another version's of the same layout, one expert at a time, so
        the device never holds a second copy of the layer's experts (`PackedEngine.update`). Each
        expert's bytes are those `__init__` would have stacked."""
        dev = self.device
        for e, (gu, dn) in enumerate(zip(gate_up, down, strict=True)):
            if self.kernel is not None:
                _copy_expert(self.gu, e, RK.pack(PK.to_device(gu, dev)))
                _copy_expert(self.dn, e, RK.pack(PK.to_device(dn, dev)))
            elif self.plain:  # copy_ rounds to the engine's dtype as .to(dtype) does
                self.w_gu[e].copy_(PK.formats.operand(PK.to_device(gu, dev)).values)
                self.w_dn[e].copy_(PK.formats.operand(PK.to_device(dn, dev)).values)
            else:
                copy_into(self.op_gu[e], PK.formats.operand(PK.to_device(gu, dev)), f"expert {e}")
                copy_into(self.op_dn[e], PK.formats.operand(PK.to_device(dn, dev)), f"expert {e}")

    def __call__(self, x: Tensor, ids: Tensor, weights: Tensor, ops) -> Tensor:
        """x [N, D], ids / weights [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x) in x.dtype."""
        if self.kernel is not None:
            h = self._kernel(x, ids, ops)
        elif self.plain and x.device.type == "cuda" and hasattr(torch, "_grouped_mm"):
            h = self._grouped(x, ids, ops)
        else:
            h = self._loop(x, ids, ops)
        return ops.combine(h, weights)

    def _kernel(self, x: Tensor, ids: Tensor, ops) -> Tensor:
        mt = matmul_triton()
        N, k = ids.shape
        align = mt.moe_align_fast(ids, self.n_experts)
        xq = _x_operand(self.act_gu, x, ops)
        gu, dn = self.gu, self.dn
        h = mt.moe_w4a16_matmul(
            xq.values.to(x.dtype),
            gu.codes,
            gu.scales,
            gu.global_scale,
            ids,
            self.kernel,
            gu.group_size,
            align=align,
            x_scale=xq.scale,
        )
        a = _x_operand(self.act_dn, ops.swiglu(h.view(N * k, -1), self.ffn), ops)
        y = mt.moe_w4a16_matmul(
            a.values.to(x.dtype),
            dn.codes,
            dn.scales,
            dn.global_scale,
            ids.reshape(-1, 1),
            self.kernel,
            dn.group_size,
            align=align,
            x_scale=a.scale,
        )
        return y.view(N * k, -1)

    def _grouped(self, x: Tensor, ids: Tensor, ops) -> Tensor:
        N, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.n_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        xs = _x_operand(self.act_gu, x.index_select(0, order // k), ops).values.to(x.dtype)
        a = ops.swiglu(torch._grouped_mm(xs, self.w_gu.transpose(1, 2), offs=offs), self.ffn)
        a = _x_operand(self.act_dn, a, ops).values.to(x.dtype)
        ys = torch._grouped_mm(a, self.w_dn.transpose(1, 2), offs=offs)
        return torch.empty_like(ys).index_copy_(0, order, ys)

    def _loop(self, x: Tensor, ids: Tensor, ops) -> Tensor:
        """One expert at a time (rows are quantized independently: per-expert chunks give the same bits)."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.index_select(0, torch.arange(N * k, device=x.device) // k)
        out = torch.empty(N * k, self.dim, dtype=x.dtype, device=x.device)
        for e in torch.unique(flat).tolist():
            rows = (flat == e).nonzero().squeeze(-1)
            if self.plain:
                w_gu, w_dn = compute.plain(self.w_gu[e]), compute.plain(self.w_dn[e])
            else:
                w_gu, w_dn = self.op_gu[e], self.op_dn[e]
            a = ops.swiglu(compute.matmul(_x_operand(self.act_gu, xs[rows], ops), w_gu, x.dtype), self.ffn)
            out[rows] = compute.matmul(_x_operand(self.act_dn, a, ops), w_dn, x.dtype)
        return out


@dataclass(frozen=True, kw_only=True)
class TopWeights:
    """The embedding [V, D], the final norm [D] and the LM head (the embedding itself when tied)."""

    embed: Tensor
    norm: Tensor
    lm_head: LinearWeight


@dataclass(frozen=True, kw_only=True)
class LayerWeights:
    """One decoder layer: its norms, attention projections (`qkv`: q, k and v stacked for one matmul
    when all three are plain and unquantized), and either a dense SwiGLU MLP (`dense`: gate_up, down)
    or the router `gate`, the routed `experts` and an optional `shared` expert (gate_up, down)."""

    ln1: Tensor
    ln2: Tensor
    q_norm: Tensor
    k_norm: Tensor
    q: LinearWeight
    k: LinearWeight
    v: LinearWeight
    o: LinearWeight
    qkv: Tensor | None
    dense: tuple[LinearWeight, LinearWeight] | None = None
    gate: LinearWeight | None = None
    experts: ExpertWeights | None = None
    shared: tuple[LinearWeight, LinearWeight] | None = None


@dataclass(frozen=True, kw_only=True)
class WeightLoader:
    """Builds the engine's pieces of one version on `device`: `top(tensors)`, `layer(i, tensors)`."""

    cfg: ModelConfig
    plan: Plan
    device: torch.device
    dtype: torch.dtype

    def act(self, site: str) -> ActQuant | None:
        e = self.plan[site]
        return None if e.format == "bf16" else ActQuant(e.format, e.kwargs)

    def dense(self, tensors: dict, name: str) -> Tensor:
        return PK.dequantize(PK.to_device(tensors[name], self.device)).to(self.dtype).reshape(self.plan[name].shape)

    def linear(self, tensors: dict, module: str) -> LinearWeight:
        """`module`.weight with the activation quantization of `module`.input."""
        return LinearWeight(tensors[f"{module}.weight"], self.act(f"{module}.input"), self.device, self.dtype)

    def top(self, tensors: dict) -> TopWeights:
        """The embedding, the final norm and the LM head, on the device."""
        return TopWeights(**dict(self.top_fields(tensors)))

    def top_fields(self, tensors: dict):
        """`top`'s fields one at a time, (name, value): an update holds one of them at once."""
        yield "embed", self.dense(tensors, "model.embed_tokens.weight")
        yield "norm", self.dense(tensors, "model.norm.weight")
        if self.cfg.tie_word_embeddings:  # logits = x @ embed_tokens.weight.T, as policy.model.TiedHead
            yield "lm_head", LinearWeight(tensors["model.embed_tokens.weight"], None, self.device, self.dtype)
        else:
            yield "lm_head", self.linear(tensors, "lm_head")

    def layer(self, i: int, tensors: dict, experts: ExpertWeights | None = None) -> LayerWeights:
        """Layer i's weights on the device, in the layout the decode step reads. With `experts` (layer
        i's of an engine being updated), the routed experts are loaded into those in place."""
        p = f"model.layers.{i}"
        norms = {
            "ln1": self.dense(tensors, f"{p}.input_layernorm.weight"),
            "ln2": self.dense(tensors, f"{p}.post_attention_layernorm.weight"),
            "q_norm": self.dense(tensors, f"{p}.self_attn.q_norm.weight"),
            "k_norm": self.dense(tensors, f"{p}.self_attn.k_norm.weight"),
        }
        q, k, v, o = (self.linear(tensors, f"{p}.self_attn.{n}_proj") for n in "qkvo")
        fused = all(x.weight is not None and x.act is None for x in (q, k, v))  # one matmul for q, k, v
        qkv = torch.cat([q.weight, k.weight, v.weight]) if fused else None
        return LayerWeights(**norms, q=q, k=k, v=v, o=o, qkv=qkv, **self._mlp(i, tensors, experts))

    def _mlp(self, i: int, tensors: dict, experts: ExpertWeights | None) -> dict:
        """Layer i's MLP fields of LayerWeights: `dense`, or `gate`, `experts` and `shared`."""
        p = f"model.layers.{i}.mlp"
        if not self.cfg.is_moe_layer(i):  # a dense SwiGLU MLP (Qwen3 dense, mlp_only_layers)
            return {"dense": (self.linear(tensors, f"{p}.gate_up_proj"), self.linear(tensors, f"{p}.down_proj"))}
        gate = self.linear(tensors, f"{p}.gate")
        E = range(self.cfg.n_experts)
        gate_up = [tensors[f"{p}.experts.{e}.gate_up_proj.weight"] for e in E]
        down = [tensors[f"{p}.experts.{e}.down_proj.weight"] for e in E]
        if experts is not None:
            experts.load(gate_up, down)
        else:
            experts = ExpertWeights(
                gate_up,
                down,
                self.act(f"{p}.experts.0.gate_up_proj.input"),
                self.act(f"{p}.experts.0.down_proj.input"),
                self.device,
                self.dtype,
            )
        shared = None
        if self.cfg.has_shared_expert:
            s = f"{p}.shared_expert"
            shared = (self.linear(tensors, f"{s}.gate_up_proj"), self.linear(tensors, f"{s}.down_proj"))
        return {"gate": gate, "experts": experts, "shared": shared}


def layout_of(tensors: dict) -> tuple:
    """What a set of published tensors looks like to the engine, values aside: per name (sorted),
    each field of its format object: (field, dtype, shape) for a tensor, the value otherwise
    (scope, group size, ...). Two versions with equal layouts build identical engine structures
    (PackedEngine.update relies on it; the contract fingerprint guarantees it for one run)."""

    def fields(q):
        out = []
        for f in dataclasses.fields(q):
            v = getattr(q, f.name)
            out.append((f.name, str(v.dtype), tuple(v.shape)) if isinstance(v, Tensor) else (f.name, repr(v)))
        return tuple(out)

    return tuple((n, type(tensors[n]).__name__, fields(tensors[n])) for n in sorted(tensors))


def _leaves(obj, out: list) -> list:
    """The device tensors of a piece of the engine's weights, in a fixed order."""
    if isinstance(obj, Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _leaves(x, out)
    elif isinstance(obj, dict):
        for k in sorted(obj):
            _leaves(obj[k], out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _leaves(getattr(obj, f.name), out)
    elif isinstance(obj, (LinearWeight, ExpertWeights, ActQuant)):
        _leaves(vars(obj), out)
    return out


def _copy_expert(stack: RK.PackedLinear, e: int, one: RK.PackedLinear) -> None:
    """Expert e of a `RK.pack_experts` stack <- one expert's `RK.pack`."""
    stack.codes[e].copy_(one.codes)
    stack.scales[e].copy_(one.scales)
    if stack.global_scale is not None:
        stack.global_scale[e : e + 1].copy_(one.global_scale.reshape(1))


def copy_into(dst, src, what: str) -> None:
    """Copy every tensor of piece `src` into the same-placed tensor of `dst` (same structure)."""
    a, b = _leaves(dst, []), _leaves(src, [])
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b)):
        raise RuntimeError(f"PackedEngine.update: {what} was built with another structure")  # a bug: layouts matched
    done = set()  # a buffer reachable twice (an operand's values that are also the plain weight) is copied once
    for x, y in zip(a, b):
        key = (x.data_ptr(), x.shape, x.stride())
        if key not in done and x.data_ptr() != y.data_ptr():
            x.copy_(y)
            done.add(key)
