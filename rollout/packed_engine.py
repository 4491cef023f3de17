"""The packed rollout engine: packed weights, a preallocated KV cache, on-device sampling; CUDA graphs on a GPU.

`PackedEngine(cfg, plan, tensors, device=..., engine=EngineConfig(...))` serves one policy from its
published tensors (`rollout.packed_weights`) without dequantizing the 4-bit ones. Rules:
- every matmul follows DESIGN.md's Compute contract (packed_weights says how);
- numerics follow `policy.model.Transformer` op for op (its `rms_norm` and `rope` themselves, in
  `rollout.fused_glue`), so the trainer's QAT recompute differs from the engine's behavior
  log-probs only by accumulation order;
- the decode step has no host synchronization and is one CUDA graph per batch bucket;
- a request that does not fit the slotted KV cache is refused with a ValueError naming the numbers;
  NaN/Inf logits raise NonFinite once the sequences are done;
- a new version of the same layout is copied into the live engine (`update`).
The same code runs on the CPU (reference matmuls, torch sampling and attention, no graphs), which is
how the unit tests check its logic against `rollout.engine.generate`.
Routing replay (`EngineConfig.record_routes`): the expert ids of the top-k the router already
computes are written, on the device and inside the decode graph, into a per-slot buffer
`out_routes` [max_batch, max_seq_len, n MoE layers, k] (uint8 for <= 256 experts, else int16) at
the column of the token those logits sample, as `out_tok` is: no host sync per step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from policy.formats import NonFinite
from policy.model import ModelConfig, rope_inv_freq
from policy.recipe import Plan
from rollout import sampling
from rollout.engine import Generation, check_request
from rollout.fused_glue import Ops
from rollout.packed_weights import LayerWeights, WeightLoader, copy_into, layout_of, matmul_triton

__all__ = ["EngineConfig", "PackedEngine", "resolve_device"]


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
    layer), "torch" (two batched matmuls over the whole slot, masked), or "auto" (triton on CUDA).
    record_routes: record each token's expert ids per MoE layer (routing replay, `out_routes`)."""

    max_batch: int = 64
    max_seq_len: int = 1024
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    use_graphs: bool = True
    top_k: int = 0
    top_p: float = 1.0
    check_every: int = 16
    fuse: bool = True
    attention: str = "auto"
    record_routes: bool = False

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
# Engine


class PackedEngine:
    """One policy version on one device; `generate` has the signature of `rollout.engine.generate`.

    - Weights (`rollout.packed_weights`): routed experts in nvfp4 / int4 are one `moe_w4a16_matmul`
      launch per projection over all routed experts, tokens grouped by expert on the device; bf16
      routed experts go through `torch._grouped_mm` over the expert-sorted tokens; other nvfp4 /
      int4 linears through `w4a16_matmul`; every other format is multiplied as its operand
      (`policy.compute.matmul`). nvfp4 global scales are applied to the fp32 accumulator.
    - Activation quantization skips the host-side finite check: the sampler flags NaN/Inf logits
      (where any NaN/Inf in the residual stream ends up) in one device word that `generate` reads
      once, after the sequences are done.
    - The decode step (embedding -> layers -> LM head -> sampling -> stop bookkeeping) is captured
      per batch bucket (`EngineConfig.graph_buckets`); a batch runs in the smallest bucket that holds
      it, the spare rows as dead padding; its elementwise glue is `rollout.fused_glue`
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
        self.ops = Ops(self.ecfg.fuse and self.device.type == "cuda")  # decode step (fixed shapes)
        self.plain = Ops(False)  # prefill (shapes vary per call)
        hd = cfg.head_dim
        self.triton_attention = (
            self.device.type == "cuda" and self.ecfg.attention != "torch" and hd & (hd - 1) == 0 and hd >= 16
        )
        self._loader = WeightLoader(cfg=cfg, plan=plan, device=self.device, dtype=dtype)
        self._load(tensors)
        self._alloc_state()
        self._graphs: dict = {}
        self._pool = None

    # ---------------------------------------------------------------- loading

    def _load(self, tensors: dict) -> None:
        missing = sorted(set(self.plan._index) - set(tensors) - {e.name for e in self.plan.activations})
        if missing:
            raise ValueError(f"PackedEngine: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
        self._layout = layout_of(tensors)
        self.top = self._loader.top(tensors)
        self.embed, self.norm, self.lm_head = self.top.embed, self.top.norm, self.top.lm_head
        self.layers = [self._loader.layer(i, tensors) for i in range(self.cfg.n_layers)]
        self.inv_freq = rope_inv_freq(self.cfg, self.device)

    @torch.no_grad()
    def update(self, tensors: dict) -> bool:
        """Serve another version of the same layout from now on, in place: each piece (the
        embedding, the final norm, the head, then one layer at a time) is built from `tensors` as
        `__init__` would and copied into this engine's device buffers, then dropped, so at most one
        piece of the new version sits on the device beside the old weights; a layer's routed experts
        are loaded in place, one expert at a time (`ExpertWeights.load`). The KV cache, the captured
        graphs and the compiled glue keep their addresses and stay valid: nothing is reallocated or
        recaptured. Rows in flight (loop.inflight_updates) continue on their KV under the new
        weights; draining on swap, none is, and the next `begin` / `prefill` starts from clean state.

        Returns False, changing nothing, when `tensors` do not have the layout this engine was
        built from (`layout_of`: names, formats, shapes, dtypes, format parameters): build a fresh
        engine then. On the CPU the engine's weights may be the tensors it was built from (no
        device copy), which this overwrites."""
        if layout_of(tensors) != self._layout:
            return False
        for name, field in self._loader.top_fields(tensors):
            copy_into(getattr(self.top, name), field, f"the {name}")
            del field  # before the next one is built
        for i, L in enumerate(self.layers):
            copy_into(L, self._loader.layer(i, tensors, experts=L.experts), f"layer {i}")
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
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        self.out_routes = (  # routing replay: the expert ids behind each sampled token
            torch.zeros(B, S, n_moe, cfg.top_k, dtype=torch.uint8 if cfg.n_experts <= 256 else torch.int16, device=dev)
            if e.record_routes and n_moe
            else None
        )
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self._temp_value = 1.0
        self.stop_ids = torch.full((8,), -1, dtype=torch.int64, device=dev)
        self.pad = torch.zeros(1, dtype=torch.int64, device=dev)
        self.slots = torch.arange(B, device=dev)
        self.key_index = torch.arange(S, device=dev)

    # ---------------------------------------------------------------- forward pieces

    def _qkv(self, L: LayerWeights, h: Tensor, ops):
        if L.qkv is not None:
            cfg = self.cfg
            q, k, v = F.linear(h, L.qkv).split(
                [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim], dim=-1
            )
            return q, k, v
        return L.q(h, ops), L.k(h, ops), L.v(h, ops)

    def _moe(self, L: LayerWeights, x: Tensor, ops, ids_out: list | None = None) -> Tensor:
        """The layer's MLP; an MoE layer appends its expert ids [rows, k] to ids_out when given."""
        cfg = self.cfg
        if L.dense is not None:
            return L.dense[1](ops.swiglu(L.dense[0](x, ops), cfg.ffn_dim), ops)
        weights, ids = ops.route(L.gate(x, ops), cfg.top_k, cfg.norm_topk_prob)
        if ids_out is not None:
            ids_out.append(ids)
        out = L.experts(x, ids, weights, ops)
        if L.shared is not None:
            out = out + L.shared[1](ops.swiglu(L.shared[0](x, ops), cfg.shared_expert_ffn_dim), ops)
        return out

    def _next_norm(self, i: int) -> Tensor:
        return self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.norm

    def _decode_forward(self, n: int, ids_out: list | None = None) -> Tensor:
        """Logits [n, V] (model dtype) for rows 0..n-1: token cur_tok[b] at position pos[b] (also its KV
        slot); each MoE layer's expert ids [n, k] appended to ids_out when given."""
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
            x, h = ops.add_rms(x, self._moe(L, h, ops, ids_out), self._next_norm(i), eps)
        return self.lm_head(h, ops)  # the sampler reads them as fp32

    def _prefill_forward(self, tokens: Tensor, lens: Tensor) -> tuple[Tensor, list, Tensor | None]:
        """Right-padded prompts [n, T] -> (logits [n, V] at each row's last real token, per layer
        (k, v) [n, Hkv, T, hd]: the prompts' KV, for the caller to place in slots, and with
        record_routes the last real token's expert ids [n, n MoE layers, k], else None)."""
        cfg, ops, eps = self.cfg, self.plain, self.cfg.norm_eps
        n, T = tokens.shape
        H, Hk, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        positions = torch.arange(T, device=self.device)
        angles = positions.float()[None, :, None] * self.inv_freq  # [1, T, hd/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        x = F.embedding(tokens, self.embed)
        h = ops.rms(x, self.layers[0].ln1, eps)
        kvs, ids = [], [] if self.out_routes is not None else None
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(L, h, ops)
            q, k = ops.qk_norm_rope(q.view(n, T, H, hd), k.view(n, T, Hk, hd), L.q_norm, L.k_norm, cos, sin, eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(n, T, Hk, hd).transpose(1, 2)
            kvs.append((k, v))
            # Right padding: a real token's causal window holds only real tokens.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hk)
            x, h = ops.add_rms(x, L.o(o.transpose(1, 2).reshape(n, T, H * hd), ops), L.ln2, eps)
            m = self._moe(L, h.reshape(n * T, -1), ops, ids).view(n, T, -1)
            x, h = ops.add_rms(x, m, self._next_norm(i), eps)
        rows = torch.arange(n, device=self.device)
        last = h[rows, lens - 1]
        routes = None if ids is None else torch.stack([r.view(n, T, -1)[rows, lens - 1] for r in ids], dim=1)
        return self.lm_head(last, ops), kvs, routes

    # ---------------------------------------------------------------- sampling + bookkeeping

    def _sample_update(self, logits: Tensor, rows: slice | Tensor, routes: Tensor | None = None) -> None:
        """Sample the next token of `rows` (a slice of slots, or slot indices), each at its own token
        index (`lengths`: the RNG counter and the output column, so a row's draws do not depend on
        when it joined the batch), record it (and `routes` [rows, n MoE layers, k], the expert ids
        behind these logits, when recording), stop rows on a stop id or at their max_new; no host sync."""
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
        if routes is not None and self.out_routes is not None:
            self.out_routes.index_put_((slots, col), routes.to(self.out_routes.dtype))
        count = index + alive.long()
        hit = alive & (tok[:, None] == self.stop_ids[None, :]).any(dim=1)
        self.stopped[rows] = self.stopped[rows] | hit
        alive = alive & ~hit & (count < self.max_new[rows])
        self.lengths[rows] = count
        self.alive[rows] = alive
        self.cur_tok[rows] = torch.where(alive, tok, self.pad)

    def _decode_step(self, n: int) -> None:
        ids = [] if self.out_routes is not None else None
        logits = self._decode_forward(n, ids)
        self._sample_update(logits, slice(0, n), None if ids is None else torch.stack(ids, dim=1))
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
            *([] if self.out_routes is None else [self.out_routes]),
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
        self._workspaces = dict(getattr(matmul_triton(), "_WORKSPACE", {}))

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
        B = len(prompts) * n_samples
        n = self.bucket(B)
        lens = [len(p) for p in prompts]
        T = max(lens)
        tokens = _right_padded(prompts, pad_id)
        row_lens = [x for x in lens for _ in range(n_samples)]
        lens_t = torch.tensor(row_lens + [1] * (n - B), dtype=torch.int64)
        dev = self.device
        self.begin(temperature=temperature, stop=stop, pad_id=pad_id)
        self._start_rows(B, seeds, self.ecfg.max_seq_len - T if max_new_tokens is None else max_new_tokens)
        logits, kvs, routes = self._prefill_forward(tokens.to(dev), torch.tensor(lens, device=dev))
        self._place_kv(kvs, B, n_samples)
        if n_samples > 1:
            logits = logits.repeat_interleave(n_samples, 0)
            routes = None if routes is None else routes.repeat_interleave(n_samples, 0)
        if n > B:  # spare rows of the bucket: dead padding
            logits = torch.cat([logits, logits.new_zeros(n - B, logits.shape[1])])
            routes = None if routes is None else torch.cat([routes, routes.new_zeros(n - B, *routes.shape[1:])])
        self._sample_update(logits, slice(0, n), routes)
        self.pos[:n] = lens_t.to(dev)
        return n

    def _start_rows(self, B: int, seeds, max_new: int | Sequence[int]) -> None:
        """Rows 0..B-1 alive, with their seeds and token budgets (one for all rows or one per row)."""
        self.seeds[:B] = torch.tensor([int(s) & (2**63 - 1) for s in seeds], dtype=torch.int64)
        self.alive[:B] = True
        if isinstance(max_new, int):
            self.max_new[:B] = max_new
        else:
            self.max_new[:B] = torch.tensor(list(max_new), dtype=torch.int64)

    def _place_kv(self, kvs: list, B: int, n_samples: int) -> None:
        """Each prompt's prefilled KV (per layer (k, v) [P, Hkv, T, hd]) into its samples' slots 0..B-1."""
        for i, (k, v) in enumerate(kvs):
            T = k.shape[2]
            self.k_cache[i][:B, :, :T] = k if n_samples == 1 else k.repeat_interleave(n_samples, 0)
            self.v_cache[i][:B, :, :T] = v if n_samples == 1 else v.repeat_interleave(n_samples, 0)

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
        [Hkv, len, hd] as k and v lists, its last logits [V], its last token's expert ids [n MoE
        layers, k] or None), to `admit` into slots."""
        lens = [len(p) for p in prompts]
        tokens = _right_padded(prompts, int(self.pad.item()))
        logits, kvs, routes = self._prefill_forward(tokens.to(self.device), torch.tensor(lens, device=self.device))
        return [
            (
                [k[b, :, :n].clone() for k, _ in kvs],
                [v[b, :, :n].clone() for _, v in kvs],
                logits[b].clone(),
                None if routes is None else routes[b].clone(),
            )
            for b, n in enumerate(lens)
        ]

    @torch.no_grad()
    def admit(self, prefix, slots: Sequence[int], seeds: Sequence[int], max_new_tokens: Sequence[int]) -> None:
        """Start rows in `slots` (free ones) from a prefix of `prefixes`: its KV copied into each
        slot, each row's first token sampled with its own seed, each stopping after its
        max_new_tokens; the other rows are untouched."""
        ks, vs, logits, routes = prefix
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
        self._sample_update(
            logits[None].expand(r, -1), rows, None if routes is None else routes[None].expand(r, -1, -1)
        )
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
        stop, seeds = self._checked_request(
            prompts, n_samples, max_new_tokens, temperature, seeds, generator, eos_id, stop_ids, pad_id
        )
        B = len(prompts) * n_samples
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
        out = [
            t.to("cpu", copy=True)
            for t in (self.out_tok[:B, :N], self.out_logp[:B, :N], self.lengths[:B], self.stopped[:B])
        ]
        routes = None
        if self.out_routes is not None:  # as rollout.engine.generate's: long, 0 past a row's end
            routes = self.out_routes[:B, :N].to("cpu", torch.long)
            routes *= (torch.arange(N)[None, :] < out[2][:, None])[:, :, None, None]
        return Generation(*out, routes)

    def _checked_request(
        self, prompts, n_samples, max_new_tokens, temperature, seeds, generator, eos_id, stop_ids, pad_id
    ):
        """`generate`'s checks (one ValueError line naming what is wrong) -> (stop ids, one seed per row)."""
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
        return stop, seeds


def _right_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> Tensor:
    """The prompts as [P, T] int64 on the CPU, T the longest, each row right-padded with pad_id."""
    tokens = torch.full((len(prompts), max(len(p) for p in prompts)), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
    return tokens
