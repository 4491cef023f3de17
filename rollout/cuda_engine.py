"""The rollout engine for a GPU: packed weights, a preallocated KV cache, CUDA graphs, on-device sampling.

`PackedEngine(cfg, plan, tensors, device=..., engine=EngineConfig(...))` serves one policy from its
published tensors without dequantizing the 4-bit ones. Rules:
- every matmul follows DESIGN.md's Compute contract: its operands are `policy.formats.operand` of the
  published weights and of the per-token quantized activations at the sites the recipe quantizes;
- numerics follow `policy.model.Transformer` op for op, so the trainer's QAT recompute differs from
  the engine's behavior log-probs only by accumulation order;
- the decode step has no host synchronization and is one CUDA graph per batch bucket;
- a request that does not fit the slotted KV cache is refused with a ValueError naming the numbers;
  NaN/Inf logits raise ValueError once the sequences are done;
- a new version of the same layout is copied into the live engine (`update`).
The same code runs on the CPU (reference matmuls, torch sampling and attention, no graphs), which is
how the unit tests check its logic against `rollout.engine.generate`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import policy.kernels as PK
from policy import compute
from policy.formats import NonFinite, Operand
from policy.formats import nvfp4 as _nvfp4
from policy.model import ModelConfig
from policy.recipe import Plan
from rollout import kernels as RK
from rollout import sampling
from rollout.engine import Generation, check_request

__all__ = ["EngineConfig", "PackedEngine", "layout_of", "resolve_device"]


def _matmul_triton():
    """The Triton decode matmuls, imported on first use (CPU runs never import Triton)."""
    return importlib.import_module("rollout.kernels.matmul_triton")


def resolve_device(spec: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' -> torch.device; ValueError with the reason when unusable."""
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"rollout.device={spec!r}: no CUDA device is available here")
        dev = torch.device(spec)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"rollout.device={spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
        return dev
    raise ValueError(f"rollout.device={spec!r}: expected 'cpu', 'cuda' or 'cuda:N'")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """max_batch: rows per generate call (KV slots). max_seq_len: KV capacity per slot (prompt +
    new tokens). graph_buckets: batch sizes with a captured decode graph (CUDA only; buckets above
    max_batch are dropped, max_batch itself is always one). use_graphs: False runs the step eagerly.
    top_k (0 = off) and top_p (1 = off): truncation before sampling. check_every: decode steps
    between the host's looks at "are all rows finished" (one sync each). fuse: on CUDA, compile the
    elementwise glue of the decode step (norms, RoPE, attention softmax, routing, SwiGLU, the expert
    sum, nvfp4 dequantization) with torch.compile so each piece is one or two kernels; falls back
    to plain torch (with a warning) where compilation fails. attention: decode attention "triton"
    (rollout.kernels.attention_triton: KV write + attention over the live keys in one kernel per
    layer), "torch" (two batched matmuls over the whole slot, masked), or "auto" (triton on CUDA)."""

    max_batch: int = 64
    max_seq_len: int = 1024
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    use_graphs: bool = True
    top_k: int = 0
    top_p: float = 1.0
    check_every: int = 16
    fuse: bool = True
    attention: str = "auto"

    def __post_init__(self):
        errors = []
        if self.max_batch < 1 or self.max_seq_len < 2 or self.check_every < 1:
            errors.append(
                f"max_batch={self.max_batch}, max_seq_len={self.max_seq_len}, check_every={self.check_every} "
                "(need >= 1, >= 2, >= 1)"
            )
        if self.attention not in ("auto", "triton", "torch"):
            errors.append(f"attention={self.attention!r} (want 'auto', 'triton' or 'torch')")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            errors.append(f"top_k={self.top_k}, top_p={self.top_p} (need top_k >= 0, 0 < top_p <= 1)")
        if errors:
            raise ValueError("EngineConfig: " + "; ".join(errors))

    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted({b for b in self.graph_buckets if 0 < b < self.max_batch} | {self.max_batch}))


# --------------------------------------------------------------------------------------------------
# The decode step's glue: pure functions (the same arithmetic as policy.model), fused on CUDA


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()  # fp32 statistics per row, as policy.model.RMSNorm
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w.float()).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _qk_norm_rope(q, k, q_norm, k_norm, cos, sin, eps):
    return _rope(_rms(q, q_norm, eps), cos, sin), _rope(_rms(k, k_norm, eps), cos, sin)


def _attn_decode(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """q [n, Hkv, G, hd], k / v [n, Hkv, S, hd], bias [n, 1, 1, S] (0 or -inf) -> [n, Hkv, G, hd]."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    return torch.matmul(s.softmax(dim=-1).to(q.dtype), v)


def _add_rms(x: Tensor, y: Tensor, w: Tensor, eps: float):
    x = x + y
    return x, _rms(x, w, eps)


def _route(logits: Tensor, k: int, norm: bool):
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _swiglu(gu: Tensor, ffn: int) -> Tensor:
    gate, up = gu.split(ffn, dim=-1)
    return F.silu(gate) * up


def _combine(h: Tensor, weights: Tensor) -> Tensor:
    n, k = weights.shape
    return (h.view(n, k, -1) * weights.unsqueeze(-1).to(h.dtype)).sum(dim=1)


def _nvfp4_operand(codes: Tensor, block_scales: Tensor) -> Tensor:
    """policy.formats.nvfp4.operand_values: e2m1 x sf in bf16 (the activation operand's values)."""
    return _nvfp4.operand_values(codes, block_scales)


_OPS = ("rms", "qk_norm_rope", "attn_decode", "add_rms", "route", "swiglu", "combine", "nvfp4_operand")


class _Fused:
    """torch.compile(fn) (static shapes, one graph), falling back to fn for good on the first error."""

    def __init__(self, fn):
        # One compiled variant per batch bucket (static shapes): room for every bucket of a few engines.
        dynamo = torch._dynamo.config
        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo, key):
                setattr(dynamo, key, max(getattr(dynamo, key), 64))
        self.fn, self.compiled, self.failed = fn, torch.compile(fn, dynamic=False, fullgraph=True), False

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: run the plain function
                self.failed = True
                warnings.warn(
                    f"cuda_engine: torch.compile of {self.fn.__name__} failed, running it unfused: {e}", stacklevel=2
                )
        return self.fn(*args)


class _Ops:
    """The glue functions, fused (torch.compile) or plain."""

    def __init__(self, fuse: bool):
        for name in _OPS:
            fn = globals()["_" + name]
            setattr(self, name, _Fused(fn) if fuse else fn)


# --------------------------------------------------------------------------------------------------
# Weights


class _ActQuant:
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


class _Linear:
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
            mt = _matmul_triton()
            fmt = mt.FMT_NVFP4 if p.fmt == "nvfp4" else mt.FMT_INT4
            xo = _x_operand(self.act, x2, ops)
            y = mt.w4a16_matmul(
                xo.values.to(x.dtype), p.codes, p.scales, p.global_scale, fmt, p.group_size, x_scale=xo.scale
            )
        return y.view(*x.shape[:-1], y.shape[-1])


class _Experts:
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
                mt = _matmul_triton()
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
        mt = _matmul_triton()
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


class _Layer:
    pass


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
    elif isinstance(obj, (_Layer, _Linear, _Experts, _ActQuant)):
        _leaves(vars(obj), out)
    return out


def _copy_into(dst, src, what: str) -> None:
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


# --------------------------------------------------------------------------------------------------
# Engine


class PackedEngine:
    """One policy version on one device; `generate` has the signature of `policy.model.generate`.

    - Routed experts in nvfp4 / int4: one `moe_w4a16_matmul` launch per projection over all routed
      experts (gate_up, then down), tokens grouped by expert on the device (`moe_align_fast`); bf16
      routed experts: `torch._grouped_mm` over the expert-sorted tokens (the fair bf16 baseline).
    - Other quantized linears in nvfp4 / int4: `w4a16_matmul`; every other format is multiplied as
      its dequantization (bf16: the published bf16 weight itself), or through
      `policy.compute.matmul` when it has no kernel. The kernels read the operands' values from the
      packed codes (tests/gpu checks them bitwise); activations are quantized by
      `policy.kernels.quantize` (bitwise QAT's); nvfp4 global scales are applied to the fp32
      accumulator (`acc * S_dec_x[row] * S_dec_w`, in the kernels' epilogue).
    - Activation quantization skips the host-side finite check: the sampler flags NaN/Inf logits
      (where any NaN/Inf in the residual stream ends up) in one device word that `generate` reads
      once, after the sequences are done.
    - The decode step (embedding -> layers -> LM head -> sampling -> stop bookkeeping) is captured
      per batch bucket (`EngineConfig.graph_buckets`); a batch runs in the smallest bucket that holds
      it, the spare rows as dead padding; its elementwise glue is fused by torch.compile
      (`EngineConfig.fuse`) and its attention is one Triton kernel per layer that also writes the
      new K/V (`rollout.kernels.attention_triton`, live keys only). Prefill uses SDPA and the decode
      matmul (16 tokens per tile).
    - `generate(prompts, n_samples=...)`: each prompt is prefilled once, its KV copied to its samples.
    - Continuous batching (`rollout.batching.PackedBackend` with `rollout.scheduler`): `begin`, then
      `prefixes` (prompts prefilled once per group) and `admit` (a prefix copied into free slots,
      those rows started) between graph replays, while the other rows keep decoding; every row
      samples at its own token index (`lengths`) and stops at its own `max_new`.
    - The KV cache: [max_batch, n_kv_heads, max_seq_len, head_dim] per layer, allocated once.
    - Sampling is `rollout.sampling` (counter-based RNG keyed by (row seed, step), Gumbel-max,
      temperature, optional top-k / top-p), log-probs in fp32 from the same logits.
    - Numerics: fp32 RMSNorm statistics, fp32 RoPE, bf16 SwiGLU and expert-weighted sum, fp32
      softmax router, matmuls on the operands QAT's use (policy.qat follows the same contract).
    - `update` copies a version in one piece at a time: no reallocation, graphs and KV cache kept,
      so a version swap costs its host-to-device copy.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        plan: Plan,
        tensors: dict,
        *,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        engine: EngineConfig | None = None,
    ):
        if plan.config != cfg:
            raise ValueError("PackedEngine: the plan was made for a different model config")
        self.cfg, self.plan = cfg, plan
        self.device = torch.device(device) if isinstance(device, str) else device
        self.dtype = dtype
        self.ecfg = engine or EngineConfig()
        if self.ecfg.max_seq_len > cfg.max_seq_len:
            raise ValueError(f"EngineConfig.max_seq_len={self.ecfg.max_seq_len} > model max_seq_len={cfg.max_seq_len}")
        self._finite_bad = torch.zeros(1, dtype=torch.int32, device=self.device)  # 1: NaN/Inf logits seen
        self.ops = _Ops(self.ecfg.fuse and self.device.type == "cuda")  # decode step (fixed shapes)
        self.plain = _Ops(False)  # prefill (shapes vary per call)
        hd = cfg.head_dim
        self.triton_attention = (
            self.device.type == "cuda" and self.ecfg.attention != "torch" and hd & (hd - 1) == 0 and hd >= 16
        )
        self._load(tensors)
        self._alloc_state()
        self._graphs: dict = {}
        self._pool = None

    # ---------------------------------------------------------------- loading

    def _act(self, site: str):
        e = self.plan[site]
        return None if e.format == "bf16" else _ActQuant(e.format, e.kwargs)

    def _dense(self, tensors, name: str) -> Tensor:
        return PK.dequantize(PK.to_device(tensors[name], self.device)).to(self.dtype).reshape(self.plan[name].shape)

    def _load(self, tensors: dict) -> None:
        missing = sorted(set(self.plan._index) - set(tensors) - {e.name for e in self.plan.activations})
        if missing:
            raise ValueError(f"PackedEngine: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
        self._layout = layout_of(tensors)
        top = self._top(tensors)
        self.embed, self.norm, self.lm_head = top.embed, top.norm, top.lm_head
        self.layers = [self._layer(i, tensors) for i in range(self.cfg.n_layers)]
        hd = self.cfg.head_dim
        self.inv_freq = 1.0 / (
            self.cfg.rope_theta ** (torch.arange(0, hd, 2, device=self.device, dtype=torch.float32) / hd)
        )

    def _top(self, tensors: dict) -> _Layer:
        """The embedding, the final norm and the LM head, on the device."""
        cfg, dev, dt = self.cfg, self.device, self.dtype
        top = _Layer()
        top.embed = self._dense(tensors, "model.embed_tokens.weight")
        top.norm = self._dense(tensors, "model.norm.weight")
        if cfg.tie_word_embeddings:  # logits = x @ embed_tokens.weight.T, as policy.model.TiedHead
            top.lm_head = _Linear(tensors["model.embed_tokens.weight"], None, dev, dt)
        else:
            top.lm_head = _Linear(tensors["lm_head.weight"], self._act("lm_head.input"), dev, dt)
        return top

    def _layer(self, i: int, tensors: dict) -> _Layer:
        """Layer i's weights on the device, in the layout the decode step reads."""
        cfg, dev, dt = self.cfg, self.device, self.dtype
        p = f"model.layers.{i}"
        L = _Layer()
        L.ln1 = self._dense(tensors, f"{p}.input_layernorm.weight")
        L.ln2 = self._dense(tensors, f"{p}.post_attention_layernorm.weight")
        L.q_norm = self._dense(tensors, f"{p}.self_attn.q_norm.weight")
        L.k_norm = self._dense(tensors, f"{p}.self_attn.k_norm.weight")
        L.q, L.k, L.v, L.o = (
            _Linear(tensors[f"{p}.self_attn.{n}_proj.weight"], self._act(f"{p}.self_attn.{n}_proj.input"), dev, dt)
            for n in "qkvo"
        )
        if all(x.weight is not None and x.act is None for x in (L.q, L.k, L.v)):  # one matmul for q, k, v
            L.qkv = torch.cat([L.q.weight, L.k.weight, L.v.weight])
        else:
            L.qkv = None
        L.gate = L.experts = L.shared = L.dense = None
        if not cfg.is_moe_layer(i):  # a dense SwiGLU MLP (Qwen3 dense, mlp_only_layers)
            L.dense = (
                _Linear(tensors[f"{p}.mlp.gate_up_proj.weight"], self._act(f"{p}.mlp.gate_up_proj.input"), dev, dt),
                _Linear(tensors[f"{p}.mlp.down_proj.weight"], self._act(f"{p}.mlp.down_proj.input"), dev, dt),
            )
            return L
        L.gate = _Linear(tensors[f"{p}.mlp.gate.weight"], self._act(f"{p}.mlp.gate.input"), dev, dt)
        E = range(cfg.n_experts)
        L.experts = _Experts(
            [tensors[f"{p}.mlp.experts.{e}.gate_up_proj.weight"] for e in E],
            [tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] for e in E],
            self._act(f"{p}.mlp.experts.0.gate_up_proj.input"),
            self._act(f"{p}.mlp.experts.0.down_proj.input"),
            dev,
            dt,
        )
        if cfg.has_shared_expert:
            s = f"{p}.mlp.shared_expert"
            L.shared = (
                _Linear(tensors[f"{s}.gate_up_proj.weight"], self._act(f"{s}.gate_up_proj.input"), dev, dt),
                _Linear(tensors[f"{s}.down_proj.weight"], self._act(f"{s}.down_proj.input"), dev, dt),
            )
        return L

    @torch.no_grad()
    def update(self, tensors: dict) -> bool:
        """Serve another version of the same layout from now on, in place: each piece (the
        embedding + head, then one layer at a time) is built from `tensors` as `__init__` would
        and copied into this engine's device buffers, then dropped, so at most one piece of the new
        version sits on the device beside the old weights. The KV cache, the captured graphs and
        the compiled glue keep their addresses and stay valid: nothing is reallocated or
        recaptured. Rows in flight (loop.inflight_updates) continue on their KV under the new
        weights; draining on swap, none is, and the next `begin` / `prefill` starts from clean state.

        Returns False, changing nothing, when `tensors` do not have the layout this engine was
        built from (`layout_of`: names, formats, shapes, dtypes, format parameters): build a fresh
        engine then. On the CPU the engine's weights may be the tensors it was built from (no
        device copy), which this overwrites."""
        if layout_of(tensors) != self._layout:
            return False
        top = self._top(tensors)
        _copy_into((self.embed, self.norm, self.lm_head), (top.embed, top.norm, top.lm_head), "the embedding / head")
        del top
        for i, L in enumerate(self.layers):
            _copy_into(L, self._layer(i, tensors), f"layer {i}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return True

    def _alloc_state(self) -> None:
        cfg, e, dev = self.cfg, self.ecfg, self.device
        shape = (e.max_batch, cfg.n_kv_heads, e.max_seq_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(cfg.n_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(cfg.n_layers)]
        B, S = e.max_batch, e.max_seq_len
        self.cur_tok = torch.zeros(B, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self.seeds = torch.zeros(B, dtype=torch.int64, device=dev)
        self.alive = torch.zeros(B, dtype=torch.bool, device=dev)
        self.stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        self.lengths = torch.zeros(B, dtype=torch.int64, device=dev)
        self.out_tok = torch.zeros(B, S, dtype=torch.int64, device=dev)
        self.out_logp = torch.zeros(B, S, dtype=torch.float32, device=dev)
        self.max_new = torch.zeros(B, dtype=torch.int64, device=dev)  # a row stops after this many tokens
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self._temp_value = 1.0
        self.stop_ids = torch.full((8,), -1, dtype=torch.int64, device=dev)
        self.pad = torch.zeros(1, dtype=torch.int64, device=dev)
        self.slots = torch.arange(B, device=dev)
        self.key_index = torch.arange(S, device=dev)

    # ---------------------------------------------------------------- forward pieces

    def _qkv(self, L, h: Tensor, ops):
        if L.qkv is not None:
            cfg = self.cfg
            q, k, v = F.linear(h, L.qkv).split(
                [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim], dim=-1
            )
            return q, k, v
        return L.q(h, ops), L.k(h, ops), L.v(h, ops)

    def _moe(self, L, x: Tensor, ops) -> Tensor:
        cfg = self.cfg
        if L.dense is not None:
            return L.dense[1](ops.swiglu(L.dense[0](x, ops), cfg.ffn_dim), ops)
        weights, ids = ops.route(L.gate(x, ops), cfg.top_k, cfg.norm_topk_prob)
        out = L.experts(x, ids, weights, ops)
        if L.shared is not None:
            out = out + L.shared[1](ops.swiglu(L.shared[0](x, ops), cfg.shared_expert_ffn_dim), ops)
        return out

    def _next_norm(self, i: int) -> Tensor:
        return self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm

    def _decode_forward(self, n: int) -> Tensor:
        """Logits [n, V] (model dtype) for rows 0..n-1: token cur_tok[b] at position pos[b] (also its KV slot)."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.norm_eps
        H, Hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pos, rows = self.pos[:n], self.slots[:n]
        angles = pos.float()[:, None] * self.inv_freq
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [n, 1, hd/2]
        if not self.triton_attention:
            mask = self.key_index[None, :] <= pos[:, None]  # [n, S]
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=self.device).masked_fill_(~mask, float("-inf"))
            bias = bias[:, None, None, :]
        x = F.embedding(self.cur_tok[:n], self.embed)
        h = ops.rms(x, self.layers[0].ln1, eps)
        scale = 1.0 / math.sqrt(hd)
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, h, ops)
            q, k = ops.qk_norm_rope(q.view(n, H, hd), k.view(n, Hk, hd), L.q_norm, L.k_norm, cos, sin, eps)
            kc, vc = self.k_cache[i], self.v_cache[i]
            if self.triton_attention:
                from rollout.kernels import attention_triton

                o = attention_triton.decode_attention(q, k, v.view(n, Hk, hd), kc, vc, pos, scale).view(n, H * hd)
            else:
                kc[rows, :, pos] = k
                vc[rows, :, pos] = v.view(n, Hk, hd)
                o = ops.attn_decode(q.view(n, Hk, H // Hk, hd), kc[:n], vc[:n], bias, scale).reshape(n, H * hd)
            x, h = ops.add_rms(x, L.o(o, ops), L.ln2, eps)
            x, h = ops.add_rms(x, self._moe(L, h, ops), self._next_norm(i), eps)
        return self.lm_head(h, ops)  # the sampler reads them as fp32

    def _prefill_forward(self, tokens: Tensor, lens: Tensor) -> tuple[Tensor, list]:
        """Right-padded prompts [n, T] -> (logits [n, V] at each row's last real token, per layer
        (k, v) [n, Hkv, T, hd]: the prompts' KV, for the caller to place in slots)."""
        cfg, ops, eps = self.cfg, self.plain, self.cfg.norm_eps
        n, T = tokens.shape
        H, Hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        positions = torch.arange(T, device=self.device)
        angles = positions.float()[None, :, None] * self.inv_freq  # [1, T, hd/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        x = F.embedding(tokens, self.embed)
        h = ops.rms(x, self.layers[0].ln1, eps)
        kvs = []
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, h, ops)
            q, k = ops.qk_norm_rope(q.view(n, T, H, hd), k.view(n, T, Hk, hd), L.q_norm, L.k_norm, cos, sin, eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(n, T, Hk, hd).transpose(1, 2)
            kvs.append((k, v))
            # Right padding: a real token's causal window holds only real tokens.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hk)
            x, h = ops.add_rms(x, L.o(o.transpose(1, 2).reshape(n, T, H * hd), ops), L.ln2, eps)
            m = self._moe(L, h.reshape(n * T, -1), ops).view(n, T, -1)
            x, h = ops.add_rms(x, m, self._next_norm(i), eps)
        last = h[torch.arange(n, device=self.device), lens - 1]
        return self.lm_head(last, ops), kvs

    # ---------------------------------------------------------------- sampling + bookkeeping

    def _sample_update(self, logits: Tensor, rows: slice | Tensor) -> None:
        """Sample the next token of `rows` (a slice of slots, or slot indices), each at its own token
        index (`lengths`: the RNG counter and the output column, so a row's draws do not depend on
        when it joined the batch), record it, stop rows on a stop id or at their max_new; no host sync."""
        e = self.ecfg
        temp = self._temp_value if (e.top_k > 0 or e.top_p < 1.0) else self.temperature
        index = self.lengths[rows]
        tok, lp = sampling.sample(
            logits, self.seeds[rows], index, temp, top_k=e.top_k, top_p=e.top_p, nonfinite=self._finite_bad
        )
        alive = self.alive[rows]
        slots = self.slots[rows] if isinstance(rows, slice) else rows
        col = index.clamp(max=self.out_tok.shape[1] - 1)
        self.out_tok.index_put_((slots, col), torch.where(alive, tok, self.pad))
        self.out_logp.index_put_((slots, col), torch.where(alive, lp, 0.0))
        count = index + alive.long()
        hit = alive & (tok[:, None] == self.stop_ids[None, :]).any(dim=1)
        self.stopped[rows] = self.stopped[rows] | hit
        alive = alive & ~hit & (count < self.max_new[rows])
        self.lengths[rows] = count
        self.alive[rows] = alive
        self.cur_tok[rows] = torch.where(alive, tok, self.pad)

    def _decode_step(self, n: int) -> None:
        logits = self._decode_forward(n)
        self._sample_update(logits, slice(0, n))
        self.pos[:n] += self.alive[:n].long()  # a finished row stays put: its (free) slot keeps in range

    def _graph(self, n: int):
        key = (n, self._temp_key())
        g = self._graphs.get(key)
        if g is None:
            # Warm-up steps run for real: keep the state of the batch in flight (KV included).
            saved = [t.clone() for t in self._state()]
            if not self._graphs:
                self._capture_all()
            else:
                self._graphs[key] = self._capture(n)
            for t, v in zip(self._state(), saved):
                t.copy_(v)
            g = self._graphs[key]
        return g

    def _state(self) -> list[Tensor]:
        return [
            *self.k_cache,
            *self.v_cache,
            self.cur_tok,
            self.pos,
            self.seeds,
            self.alive,
            self.stopped,
            self.lengths,
            self.out_tok,
            self.out_logp,
            self.max_new,
            self._finite_bad,
        ]

    def _temp_key(self):
        e = self.ecfg
        return self._temp_value if (e.top_k > 0 or e.top_p < 1.0) else None

    def _capture_all(self) -> None:
        """Warm every bucket up (largest first, so the kernels' shared workspaces reach their final
        size before any graph records their addresses), then capture each."""
        buckets = sorted(self.ecfg.buckets(), reverse=True)
        for n in buckets:
            self._warm(n)
        for n in buckets:
            self._graphs[(n, self._temp_key())] = self._capture(n)
        # The graphs hold the addresses of the matmuls' split-K workspaces: keep those tensors alive
        # even if a later (larger) eager call replaces them in the kernels' cache.
        self._workspaces = dict(getattr(_matmul_triton(), "_WORKSPACE", {}))

    def _warm(self, n: int) -> None:
        self.lengths.zero_()  # warm-up steps index the output buffers and the KV slots: keep them in range
        self.pos.zero_()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._decode_step(n)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)

    def _capture(self, n: int):
        self._warm(n)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._decode_step(n)
        torch.cuda.synchronize(self.device)
        return g

    @torch.no_grad()
    def capture(self) -> None:
        """Capture the decode graphs now (otherwise the first decode does)."""
        if self.device.type == "cuda" and self.ecfg.use_graphs and not self._graphs:
            self._graph(self.ecfg.max_batch)

    def bucket(self, n: int) -> int:
        return next(b for b in self.ecfg.buckets() if b >= n)

    # ---------------------------------------------------------------- public

    @torch.no_grad()
    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        seeds,
        temperature: float,
        stop,
        pad_id: int,
        n_samples: int = 1,
        max_new_tokens: int | Sequence[int] | None = None,
    ) -> int:
        """Reset the state, prefill the prompts (each once) into slots 0..B*n_samples-1 (row
        b * n_samples + i: sample i of prompt b) and sample their first token; rows stop after
        max_new_tokens (one for all rows or one per row; default: what fits the slot). Returns the bucket the batch decodes in."""
        P = len(prompts)
        B = P * n_samples
        n = self.bucket(B)
        lens = [len(p) for p in prompts]
        T = max(lens)
        tokens = torch.full((P, T), pad_id, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        row_lens = [x for x in lens for _ in range(n_samples)]
        lens_t = torch.tensor(row_lens + [1] * (n - B), dtype=torch.int64)
        dev = self.device
        self.begin(temperature=temperature, stop=stop, pad_id=pad_id)
        self.seeds[:B] = torch.tensor([int(s) & (2**63 - 1) for s in seeds], dtype=torch.int64)
        self.alive[:B] = True
        if max_new_tokens is None or isinstance(max_new_tokens, int):
            self.max_new[:B] = self.ecfg.max_seq_len - T if max_new_tokens is None else max_new_tokens
        else:
            self.max_new[:B] = torch.tensor(list(max_new_tokens), dtype=torch.int64)
        logits, kvs = self._prefill_forward(tokens.to(dev), torch.tensor(lens, device=dev))
        for i, (k, v) in enumerate(kvs):  # each prompt's KV copied to its samples' slots
            self.k_cache[i][:B, :, :T] = k if n_samples == 1 else k.repeat_interleave(n_samples, 0)
            self.v_cache[i][:B, :, :T] = v if n_samples == 1 else v.repeat_interleave(n_samples, 0)
        if n_samples > 1:
            logits = logits.repeat_interleave(n_samples, 0)
        if n > B:  # spare rows of the bucket: dead padding
            logits = torch.cat([logits, logits.new_zeros(n - B, logits.shape[1])])
        self._sample_update(logits, slice(0, n))
        self.pos[:n] = lens_t.to(dev)
        return n

    # ---------------------------------------------------------------- continuous batching (rollout.batching)

    @torch.no_grad()
    def begin(self, *, temperature: float, stop, pad_id: int) -> None:
        """Every slot free (dead), these sampling settings for every row from now on."""
        self._temp_value = float(temperature)
        self.temperature.fill_(float(temperature))
        self.stop_ids.fill_(-1)
        self.stop_ids[: len(stop)] = torch.tensor(sorted(stop), dtype=torch.int64)
        self.pad.fill_(pad_id)
        for t in (self.seeds, self.alive, self.stopped, self.lengths, self.out_logp, self.max_new, self.pos):
            t.zero_()
        self.out_tok.fill_(pad_id)
        self._finite_bad.zero_()

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len + max_new_tokens > self.ecfg.max_seq_len:
            raise ValueError(
                f"prompt {prompt_len} + max_new_tokens {max_new_tokens} > KV capacity "
                f"max_seq_len={self.ecfg.max_seq_len} per slot"
            )

    @torch.no_grad()
    def prefixes(self, prompts: Sequence[Sequence[int]]) -> list:
        """Each prompt through the model once (one batched prefill): per prompt (its KV per layer
        [Hkv, len, hd] as k and v lists, its last logits [V]), to `admit` into slots."""
        lens = [len(p) for p in prompts]
        T = max(lens)
        tokens = torch.full((len(prompts), T), int(self.pad.item()), dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        logits, kvs = self._prefill_forward(tokens.to(self.device), torch.tensor(lens, device=self.device))
        return [
            (
                [k[b, :, :n].clone() for k, _ in kvs],
                [v[b, :, :n].clone() for _, v in kvs],
                logits[b].clone(),
            )
            for b, n in enumerate(lens)
        ]

    @torch.no_grad()
    def admit(self, prefix, slots: Sequence[int], seeds: Sequence[int], max_new_tokens: Sequence[int]) -> None:
        """Start rows in `slots` (free ones) from a prefix of `prefixes`: its KV copied into each
        slot, each row's first token sampled with its own seed, each stopping after its
        max_new_tokens; the other rows are untouched."""
        ks, vs, logits = prefix
        T, r = ks[0].shape[1], len(slots)
        rows = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        for i in range(len(ks)):
            self.k_cache[i][rows, :, :T] = ks[i][None].expand(r, -1, -1, -1)
            self.v_cache[i][rows, :, :T] = vs[i][None].expand(r, -1, -1, -1)
        self.seeds[rows] = torch.tensor([int(s) & (2**63 - 1) for s in seeds], dtype=torch.int64, device=self.device)
        self.lengths[rows] = 0
        self.stopped[rows] = False
        self.alive[rows] = True
        self.max_new[rows] = torch.tensor(list(max_new_tokens), dtype=torch.int64, device=self.device)
        self.out_tok[rows] = self.pad
        self.out_logp[rows] = 0.0
        self._sample_update(logits[None].expand(r, -1), rows)
        self.pos[rows] = T

    @torch.no_grad()
    def decode(self, n: int, steps: int, *, check_every: int | None = None, graphs: bool | None = None) -> int:
        """Up to `steps` decode steps of bucket n (graph replays on CUDA unless graphs=False or the
        config says so); stops early, checked every `check_every` steps, once no row is alive.
        Returns the steps run."""
        every = check_every or self.ecfg.check_every
        use = self.ecfg.use_graphs if graphs is None else graphs
        graph = self._graph(n) if self.device.type == "cuda" and use else None
        done = 0
        while done < steps:
            chunk = min(every, steps - done)
            for _ in range(chunk):
                if graph is not None:
                    graph.replay()
                else:
                    self._decode_step(n)
            done += chunk
            if done < steps and not bool(self.alive[:n].any()):
                break
        return done

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n_samples: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        seeds: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        eos_id: int | None = None,
        stop_ids: Sequence[int] = (),
        pad_id: int = 0,
    ) -> Generation:
        """As `rollout.engine.generate` (same arguments and result, row b * n_samples + i is sample i
        of prompt b), on this engine."""
        cfg, e = self.cfg, self.ecfg
        lens = check_request(prompts, n_samples=n_samples, max_new_tokens=max_new_tokens, temperature=temperature)
        B = len(prompts) * n_samples
        if B > e.max_batch:
            raise ValueError(
                f"{B} rows ({len(prompts)} prompts x {n_samples} samples) > engine max_batch={e.max_batch}"
            )
        self.check_fits(max(lens), max_new_tokens)
        stop = set(stop_ids) | ({eos_id} if eos_id is not None else set())
        if len(stop) > self.stop_ids.numel():
            raise ValueError(f"{len(stop)} stop ids; the engine takes at most {self.stop_ids.numel()}")
        for t in stop | {pad_id}:
            if not 0 <= t < cfg.vocab_size:
                raise ValueError(f"token id {t} (stop/eos/pad) outside vocab of size {cfg.vocab_size}")
        for b, p in enumerate(prompts):
            if min(p) < 0 or max(p) >= cfg.vocab_size:
                raise ValueError(f"prompt {b}: token ids must be in [0, vocab_size={cfg.vocab_size})")
        if seeds is None:
            seeds = torch.randint(0, 2**62, (B,), generator=generator).tolist()
        elif len(seeds) != B:
            raise ValueError(f"seeds has {len(seeds)} entries for {B} rows")
        n = self.prefill(
            prompts,
            seeds=seeds,
            temperature=temperature,
            stop=stop,
            pad_id=pad_id,
            n_samples=n_samples,
            max_new_tokens=max_new_tokens,
        )
        if max_new_tokens > 1:
            self.decode(n, max_new_tokens - 1)
        if bool(self._finite_bad):
            raise NonFinite("PackedEngine: non-finite activations or logits (NaN/Inf) in this batch")
        N = max_new_tokens
        # copy=True: on the CPU .cpu() would alias the engine's buffers, which the next call reuses.
        return Generation(
            *(
                t.to("cpu", copy=True)
                for t in (self.out_tok[:B, :N], self.out_logp[:B, :N], self.lengths[:B], self.stopped[:B])
            )
        )
