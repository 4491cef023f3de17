"""The megatron-core trainer backend: the policy model as a megatron-core `GPTModel`, its weights under
the canonical names, and QAT on its linears with policy.qat's quantizers.

- `build_gpt_model(cfg)`: the same decoder as `policy.model.Transformer` from the local
  (non-TransformerEngine) layer spec: no biases, dropout, auxiliary loss or capacity limit; routed
  experts weight their outputs by the router probability; `norm_topk_prob` maps onto megatron's
  `moe_router_pre_softmax`. RoPE positions are 0..T-1, so batches must be right-padded.
- `to_megatron` / `from_megatron`: megatron names <-> canonical names, full tensors (TP=1, EP=1);
  `shard` / `unshard`: one (TP rank, EP rank)'s local state, for any TP and EP size.
- `apply_qat(model, cfg, recipe, backward)`: a `MegatronQATHook` (policy.qat's QATHook, aware of the
  fused qkv) on every linear, norm, router gate and the embedding; `hook.quantized_params(model)`
  gives the canonical QuantizedParams to publish. TP=1 only (any EP).
- megatron-core needs torch.distributed and its parallel state (`init_parallel`); its forward needs
  CUDA. Construction, the mapping and the QAT hooks run on CPU (the CPU tests point the forward's
  two device queries at the CPU). Why these choices: docs/design-decisions.md."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policy import compute
from policy.formats import Operand
from policy.model import ModelConfig, QuantHook, parameter_shapes
from policy.qat import QATHook
from policy.recipe import Plan, Recipe

__all__ = [
    "MegatronQATHook",
    "apply_qat",
    "build_gpt_model",
    "canonical_state",
    "checkpoint_layers",
    "from_megatron",
    "fuse_qkv",
    "init_parallel",
    "load_canonical",
    "logits",
    "megatron_shapes",
    "remove_qat",
    "shard",
    "split_qkv",
    "to_megatron",
    "transformer_config",
    "unshard",
]

# --------------------------------------------------------------------------------------------------
# Setup


def init_parallel(*, tp: int = 1, ep: int = 1, seed: int = 0) -> None:
    """Initialize megatron's parallel state on an already initialized torch.distributed group
    (pipeline parallel 1) and, with CUDA, its model-parallel RNG (its attention forks it even with
    dropout 0). Tear down with `megatron.core.parallel_state.destroy_model_parallel()`."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(
    cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, tp: int = 1, ep: int = 1, cpu_init: bool = False
):
    """The megatron-core TransformerConfig of `cfg` (field by field; see the module docstring).

    dtype: parameter and compute dtype of the model (the optimizer keeps fp32 master weights).
    cpu_init: allocate and initialize on the CPU (no CUDA needed; the CPU tests use it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if cfg.n_experts:
        moe = dict(
            num_moe_experts=cfg.n_experts,
            moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.n_layers)],
            moe_router_topk=cfg.top_k,
            moe_ffn_hidden_size=cfg.expert_ffn_dim,
            moe_shared_expert_intermediate_size=cfg.shared_expert_ffn_dim or None,
            moe_router_pre_softmax=not cfg.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",  # alltoall allocates CUDA streams at construction
            moe_grouped_gemm=False,
        )
    return TransformerConfig(
        num_layers=cfg.n_layers,
        hidden_size=cfg.dim,
        num_attention_heads=cfg.n_heads,
        num_query_groups=cfg.n_kv_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_dim or cfg.expert_ffn_dim,  # dense layers (unused when all are MoE)
        **moe,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        use_cpu_initialization=cpu_init,
    )


def build_gpt_model(
    cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, tp: int = 1, ep: int = 1, cpu_init: bool = False
):
    """A megatron-core GPTModel of `cfg` from the local layer spec, every parameter in `dtype`
    (parallel state must be set up).

    RMSNorm, grouped-query attention with per-head q/k RMSNorm and rotate-half RoPE (base
    `rope_theta`), MoE with a softmax top-k router, SwiGLU routed experts (`SequentialMLP`; on CUDA
    in bf16 its forward is one grouped GEMM per projection, `_experts_forward`) and the optional
    always-on shared expert, or a dense SwiGLU MLP per `cfg.is_moe_layer` (megatron's
    moe_layer_freq pattern), final RMSNorm and an output layer tied to the embedding when
    `tie_word_embeddings`. A routed expert weights its output by the router probability (megatron
    would scale fc2's input: `_scale_expert_outputs`). megatron's router computes
    `softmax(topk(logits))` when `moe_router_pre_softmax` is False, which equals softmax -> top-k ->
    renormalize (`norm_topk_prob=True`); `norm_topk_prob=False` is `topk(softmax(logits))`.
    Rotary positions are 0..T-1 (megatron ignores position_ids for RoPE)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = transformer_config(cfg, dtype=dtype, tp=tp, ep=ep, cpu_init=cpu_init)
    # Per layer: the local spec, MoE or dense MLP as config.moe_layer_freq says.
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
    )
    # The torch norms of the local spec are created in the default dtype; megatron's Float16Module
    # would cast them, we cast the whole model once so that every parameter has `dtype`.
    model = model.to(dtype=dtype)
    _fix_router_gating(model)
    _scale_expert_outputs(model)
    return model


def _scale_expert_outputs(model: nn.Module) -> None:
    """Routed experts weight their *output* by the router probability, as policy.model and the
    rollout engines do: y_e = p_e * fc2(silu(gate) * up). megatron's MLP applies p_e to fc2's input
    instead (per_token_scale), which is the same function but not the same quantized matmul: fc2's
    activation quantization must see the expert's own activation (Compute contract), and under the
    hp straight-through backward the router's gradient would go through fc2's master weight."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for mod in model.modules():
        if isinstance(mod, SequentialMLP):
            for expert in mod.local_experts:
                expert.forward = partial(_expert_forward, expert)
            mod.forward = partial(_experts_forward, mod, mod.forward)


_PLAIN_HOOK = QuantHook()


def _experts_forward(mlp: nn.Module, loop, hidden: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
    """SequentialMLP.forward: on CUDA under bf16 (or with `mlp.tandem_grouped = True`), one grouped
    GEMM per projection for all local experts, as policy.model's grouped MoE (through the QAT hook
    that apply_qat left in `mlp._tandem_grouped`, or a plain one), with no host sync; otherwise (or
    where the hook cannot group, e.g. fp8_block) megatron's loop over experts (`loop`), which syncs
    for the counts. hidden's rows are grouped by local expert, tokens_per_expert [E] counts them."""
    hook, sites = mlp.__dict__.get("_tandem_grouped") or (_PLAIN_HOOK, None)
    n = len(mlp.local_experts)
    grouped = mlp.__dict__.get("tandem_grouped")
    if grouped is None:
        grouped = hidden.is_cuda and compute.compute_dtype(hidden) == torch.bfloat16
    if sites is None:
        sites = ([""] * n, [""] * n)  # the plain hook ignores them
    if (
        not grouped
        or n == 1
        or mlp.config.moe_apply_probs_on_input
        or not (hook.can_group(sites[0]) and hook.can_group(sites[1]))
    ):
        return loop(hidden, tokens_per_expert, permuted_probs)
    counts = tokens_per_expert.to(device=hidden.device, dtype=torch.int64)
    offs = counts.cumsum(0).to(torch.int32)
    groups = torch.repeat_interleave(torch.arange(n, device=hidden.device), counts, output_size=hidden.shape[0])
    fc1 = [e.linear_fc1.weight for e in mlp.local_experts]
    gate, up = torch.chunk(hook.grouped_linear(sites[0], hidden, fc1, offs, groups), 2, dim=-1)
    fc2 = [e.linear_fc2.weight for e in mlp.local_experts]
    y = hook.grouped_linear(sites[1], F.silu(gate) * up, fc2, offs, groups)
    return y * permuted_probs.unsqueeze(-1).to(y.dtype), None


def _expert_forward(mlp: nn.Module, hidden_states: Tensor, per_token_scale: Tensor | None = None, **_: object):
    h, _bias = mlp.linear_fc1(hidden_states)
    gate, up = torch.chunk(h, 2, dim=-1)
    y, _bias = mlp.linear_fc2(F.silu(gate) * up)
    if per_token_scale is not None:
        y = y * per_token_scale.unsqueeze(-1).to(y.dtype)
    return y, None


def _fix_router_gating(model: nn.Module) -> None:
    """Each router computes its logits as a plain F.linear in the input dtype, which is what
    megatron's own router_gating_linear computes with moe_router_dtype unset, but (a) megatron-core
    0.16 without TransformerEngine raises NameError there (te_general_gemm is defined only when TE
    imports), and (b) 0.19's backward multiplies a bf16 gradient by the fp32 weight under autocast
    (fp32 parameters, bf16 compute: what the trainer runs), which torch refuses. F.linear autocasts."""
    from megatron.core.transformer.moe.router import TopKRouter

    for mod in model.modules():
        if isinstance(mod, TopKRouter):
            mod.gating = lambda input, _m=mod: F.linear(input, _m.weight)


def checkpoint_layers(model: nn.Module) -> None:
    """Activation checkpointing: each decoder layer keeps only its input for the backward and runs
    its forward again there (torch.utils.checkpoint, non-reentrant: autocast and the QAT hooks are
    replayed as they ran; the QAT cache is not refilled, the weights did not move)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.utils.checkpoint import checkpoint

    for mod in model.modules():
        if isinstance(mod, TransformerLayer):
            forward = mod.forward
            mod.forward = lambda *a, _f=forward, **k: (
                checkpoint(_f, *a, use_reentrant=False, **k) if torch.is_grad_enabled() else _f(*a, **k)
            )


def logits(model, tokens: Tensor) -> Tensor:
    """[B, T] token ids -> [B, T, V] logits, causal, RoPE positions 0..T-1 (right padding only).
    The causal mask (True = masked) is built here, on the tokens' device."""
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)[None, None]
    return model(tokens, positions, causal)


# --------------------------------------------------------------------------------------------------
# Names and layouts


def split_qkv(w: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """megatron linear_qkv [(H + 2G) h, D] -> canonical (q [H h, D], k [G h, D], v [G h, D]), copies.

    Rows per query group g: r = H / G query heads (g r .. g r + r - 1), then k head g, then v head g."""
    G, h, r = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    groups = w.reshape(G, r + 2, h, w.shape[-1])
    q = groups[:, :r].reshape(G * r * h, -1)
    k = groups[:, r].reshape(G * h, -1)
    v = groups[:, r + 1].reshape(G * h, -1)
    return q, k, v


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """Inverse of `split_qkv`: canonical q, k, v -> megatron's interleaved linear_qkv (a new tensor)."""
    G, h, r = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    D = q.shape[-1]
    return torch.cat((q.reshape(G, r, h, D), k.reshape(G, 1, h, D), v.reshape(G, 1, h, D)), dim=1).reshape(-1, D)


_C_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
_M_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
# canonical layer suffix <-> megatron layer suffix, for the 1:1 tensors (qkv is fused; experts below)
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate_up_proj.weight": "mlp.linear_fc1.weight",  # dense MLP layers
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.shared_expert.gate_up_proj.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
_LAYER_RENAMES_BACK = {m: c for c, m in _LAYER_RENAMES.items()}
_TOP_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
_TOP_RENAMES_BACK = {m: c for c, m in _TOP_RENAMES.items()}
_C_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")
_M_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_M_QKV = "self_attention.linear_qkv.weight"


def megatron_name(name: str) -> str:
    """Canonical name -> megatron name (full layout; q/k/v all map to the fused linear_qkv)."""
    if name in _TOP_RENAMES:
        return _TOP_RENAMES[name]
    m = _C_LAYER.match(name)
    if m:
        i, rest = m.groups()
        if rest in _LAYER_RENAMES:
            return f"decoder.layers.{i}.{_LAYER_RENAMES[rest]}"
        if rest in _QKV:
            return f"decoder.layers.{i}.{_M_QKV}"
        e = _C_EXPERT.match(rest)
        if e:
            fc = "linear_fc1" if e.group(2) == "gate_up_proj" else "linear_fc2"
            return f"decoder.layers.{i}.mlp.experts.local_experts.{e.group(1)}.{fc}.weight"
    raise ValueError(f"no megatron name for canonical parameter {name!r}")


def canonical_name(mname: str, *, expert_offset: int = 0) -> str:
    """Megatron name (any "module." wrapper prefixes stripped) -> canonical name; not for linear_qkv.
    `expert_offset`: the global index of this EP rank's local expert 0."""
    while mname.startswith("module."):
        mname = mname[len("module.") :]
    if mname in _TOP_RENAMES_BACK:
        return _TOP_RENAMES_BACK[mname]
    m = _M_LAYER.match(mname)
    if m:
        i, rest = m.groups()
        if rest in _LAYER_RENAMES_BACK:
            return f"model.layers.{i}.{_LAYER_RENAMES_BACK[rest]}"
        e = _M_EXPERT.match(rest)
        if e:
            proj = "gate_up_proj" if e.group(2) == "linear_fc1" else "down_proj"
            return f"model.layers.{i}.mlp.experts.{int(e.group(1)) + expert_offset}.{proj}.weight"
    raise ValueError(f"no canonical name for megatron parameter {mname!r}")


def megatron_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Megatron name -> full shape (TP=1, EP=1), the names a GPTModel of `cfg` has."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in parameter_shapes(cfg).items():
        mname = megatron_name(name)
        if mname.endswith(_M_QKV):
            shape = ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, cfg.dim)
        shapes[mname] = shape
    return shapes


def to_megatron(cfg: ModelConfig, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every canonical tensor -> the full megatron state (q/k/v fused; the others are the same
    tensors, not copies). All canonical names of `cfg` are required.

    Layouts (F = expert ffn dim, G = n_kv_heads, h = head_dim, r = n_heads / n_kv_heads):
      linear_qkv   [(n_heads + 2G) h, D], per query group g: [q heads g r .. g r + r - 1; k_g; v_g]
                   (each h rows): megatron's interleaved layout; TP shards whole groups.
      linear_fc1   [2F, D] = canonical gate_up_proj [gate; up] (routed, shared and dense MLPs), the
                   same tensor (one global scale); TP rank t holds [gate_t; up_t].
      experts      global expert e lives on EP rank e // (E / ep) as local_experts.{e % (E / ep)}.
      column-parallel (rows split): linear_qkv, linear_fc1, output_layer, word_embeddings;
      row-parallel (columns split): linear_proj, linear_fc2; replicated: norms and the router."""
    from policy.model import parameter_shapes

    expected = set(parameter_shapes(cfg))
    if set(tensors) != expected:
        missing, unknown = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"to_megatron: missing {missing[:5]}, unknown {unknown[:5]}")
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        mname = megatron_name(name)
        if not mname.endswith(_M_QKV):
            out[mname] = t
        elif name.endswith(_QKV[0]):
            prefix = name[: -len(_QKV[0])]
            out[mname] = fuse_qkv(*(tensors[prefix + s] for s in _QKV), cfg)
    return out


def from_megatron(cfg: ModelConfig, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The full megatron state -> canonical tensors (linear_qkv split into copies; the others are the
    same tensors), in `policy.model.parameter_shapes` order."""
    expected = megatron_shapes(cfg)
    names = {k[len("module.") :] if k.startswith("module.") else k: k for k in state}
    if set(names) != set(expected):
        missing, unknown = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
        raise ValueError(f"from_megatron: missing {missing[:5]}, unknown {unknown[:5]}")
    bad = [
        f"{n}: {tuple(state[names[n]].shape)} != {s}" for n, s in expected.items() if tuple(state[names[n]].shape) != s
    ]
    if bad:
        raise ValueError(f"from_megatron: bad shapes {bad[:5]}")
    out: dict[str, Tensor] = {}
    for name in parameter_shapes(cfg):
        mname = megatron_name(name)
        if not mname.endswith(_M_QKV):
            out[name] = state[names[mname]]
        elif name.endswith(_QKV[0]):
            prefix = name[: -len(_QKV[0])]
            out.update(zip((prefix + s for s in _QKV), split_qkv(state[names[mname]], cfg)))
    return out


def _split_kind(mname: str) -> str:
    """How TP splits a megatron tensor: "rows", "cols", "fc1" (gate and up halves each split), "rep"."""
    if mname.endswith(("linear_qkv.weight", "output_layer.weight", "word_embeddings.weight")):
        return "rows"
    if mname.endswith("linear_fc1.weight"):
        return "fc1"
    if mname.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "rep"


def _expert_of(mname: str) -> tuple[str, int, str] | None:
    m = re.match(r"(.*\.local_experts\.)(\d+)(\..*)$", mname)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def shard(
    cfg: ModelConfig, full: Mapping[str, Tensor], *, tp_rank: int = 0, tp: int = 1, ep_rank: int = 0, ep: int = 1
) -> dict[str, Tensor]:
    """The local megatron state of (TP rank, EP rank) from the full one (see the module docstring).
    Expert tensors use the same TP size (megatron's default expert_tensor_parallel_size)."""
    if cfg.n_experts % ep or cfg.n_kv_heads % tp or cfg.vocab_size % tp:
        raise ValueError(f"shard: n_experts, n_kv_heads and vocab_size must divide by ep={ep}, tp={tp}")
    per = cfg.n_experts // ep
    out: dict[str, Tensor] = {}
    for mname, t in full.items():
        ex = _expert_of(mname)
        if ex is not None:
            if ex[1] // per != ep_rank:
                continue
            mname = f"{ex[0]}{ex[1] % per}{ex[2]}"
        kind = _split_kind(mname)
        if kind == "rows":
            t = t.chunk(tp, dim=0)[tp_rank]
        elif kind == "cols":
            t = t.chunk(tp, dim=1)[tp_rank]
        elif kind == "fc1":
            gate, up = t.chunk(2, dim=0)
            t = torch.cat((gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]))
        out[mname] = t
    return out


def unshard(cfg: ModelConfig, local: Mapping[tuple[int, int], Mapping[str, Tensor]], *, tp: int, ep: int) -> dict:
    """Inverse of `shard`: {(tp_rank, ep_rank): local state} for every rank -> the full state."""
    per = cfg.n_experts // ep
    out: dict[str, Tensor] = {}
    for ep_rank in range(ep):
        parts = [local[(t, ep_rank)] for t in range(tp)]
        for mname in parts[0]:
            ex = _expert_of(mname)
            if ex is None and ep_rank > 0:
                continue  # not an expert: replicated over EP, taken from EP rank 0
            full_name = mname if ex is None else f"{ex[0]}{ex[1] + ep_rank * per}{ex[2]}"
            ts = [p[mname] for p in parts]
            kind = _split_kind(mname)
            if kind == "rows":
                t = torch.cat(ts, dim=0)
            elif kind == "cols":
                t = torch.cat(ts, dim=1)
            elif kind == "fc1":
                halves = [x.chunk(2, dim=0) for x in ts]
                t = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                t = ts[0]
            out[full_name] = t
    return out


def _ranks() -> tuple[int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
    )


@torch.no_grad()
def load_canonical(model: nn.Module, cfg: ModelConfig, tensors: Mapping[str, Tensor]) -> None:
    """Copy canonical tensors into a GPTModel (this rank's shards; cast to each parameter's dtype)."""
    tp_rank, tp, ep_rank, ep = _ranks()
    local = shard(cfg, to_megatron(cfg, tensors), tp_rank=tp_rank, tp=tp, ep_rank=ep_rank, ep=ep)
    params = {k[len("module.") :] if k.startswith("module.") else k: p for k, p in model.named_parameters()}
    if set(params) != set(local):
        raise ValueError(
            f"load_canonical: model has {sorted(set(params) - set(local))[:5]} extra, "
            f"{sorted(set(local) - set(params))[:5]} missing"
        )
    for n, t in local.items():
        if tuple(t.shape) != tuple(params[n].shape):
            raise ValueError(f"load_canonical: {n}: {tuple(t.shape)} != {tuple(params[n].shape)}")
        params[n].copy_(t)


@torch.no_grad()
def canonical_state(model: nn.Module, cfg: ModelConfig) -> dict[str, Tensor]:
    """The canonical tensors of a GPTModel (TP=1: views of its parameters except the q/k/v copies;
    EP > 1: every EP rank gets every expert, gathered over the expert-parallel group)."""
    from megatron.core import parallel_state as ps

    tp_rank, tp, ep_rank, ep = _ranks()
    if tp != 1:
        raise NotImplementedError("canonical_state with TP > 1 (gather the shards with unshard)")
    state = {k[len("module.") :] if k.startswith("module.") else k: p.detach() for k, p in model.named_parameters()}
    if ep > 1:
        group = ps.get_expert_model_parallel_group()
        local = {n: t for n, t in state.items() if _expert_of(n) is not None}
        gathered = [dict(local) for _ in range(ep)]
        for n, t in local.items():
            ts = [torch.empty_like(t) for _ in range(ep)]
            torch.distributed.all_gather(ts, t.contiguous(), group=group)
            for r in range(ep):
                gathered[r][n] = ts[r]
        others = {n: t for n, t in state.items() if n not in local}
        state = unshard(cfg, {(0, r): {**others, **gathered[r]} for r in range(ep)}, tp=1, ep=ep)
    return from_megatron(cfg, state)


# --------------------------------------------------------------------------------------------------
# QAT


class MegatronQATHook(QATHook):
    """policy.qat.QATHook over a GPTModel: sites are canonical, plus one pseudo-site per layer,
    "model.layers.{i}.self_attn.qkv_proj", for megatron's fused linear_qkv. Its effective weight is
    fuse_qkv of the three canonical effective weights (each quantized as published), cached with
    the fused parameter's version and dropped by `invalidate` like every other cached weight. Its
    activation site is q_proj's (apply_qat checks that q, k and v inputs share one spec)."""

    def __init__(self, plan: Plan, backward: str = "hp"):
        super().__init__(plan, backward)
        self.cfg = plan.config
        self._fused: dict[str, tuple[int, Tensor]] = {}
        self._fused_ops: dict[str, tuple[int, Operand]] = {}

    def invalidate(self, *_: object) -> None:
        super().invalidate()
        self._fused.clear()
        self._fused_ops.clear()

    def operand(self, name: str, p: Tensor) -> Operand:
        """The fused qkv's operand: fuse_qkv of the three canonical operands (values, and per-row
        scales where a part has one); per-K-block scales (fp8_block) are refused."""
        if not name.endswith(".qkv_proj.weight"):
            return super().operand(name, p)
        hit = self._fused_ops.get(name)
        if hit is not None and hit[0] == p._version and hit[1].values.device == p.device:
            return hit[1]
        prefix = name[: -len("qkv_proj.weight")]
        parts = []
        for proj, t in zip(("q_proj", "k_proj", "v_proj"), split_qkv(p.detach(), self.cfg)):
            self._cache.pop(f"{prefix}{proj}.weight", None)  # its copy is new: always requantize
            parts.append(super().operand(f"{prefix}{proj}.weight", t))
        if any(o.block_scale is not None for o in parts):
            raise NotImplementedError("megatron QAT: per-K-block (fp8_block) q/k/v weights in the fused linear_qkv")
        scale = None
        if any(o.scale is not None for o in parts):
            rows = [
                (o.scale if o.scale is not None else torch.ones(1, device=p.device)).expand(o.values.shape[0])[:, None]
                for o in parts
            ]
            scale = fuse_qkv(*rows, self.cfg).reshape(-1)
        fused = Operand(fuse_qkv(*(o.values for o in parts), self.cfg), scale=scale)
        self._fused_ops[name] = (p._version, fused)
        return fused

    def effective(self, name: str, p: Tensor) -> Tensor:
        if not name.endswith(".qkv_proj.weight"):
            return super().effective(name, p)
        hit = self._fused.get(name)
        if hit is not None and hit[0] == p._version and hit[1].device == p.device:
            return hit[1]
        prefix = name[: -len("qkv_proj.weight")]
        parts = []
        for proj, t in zip(("q_proj", "k_proj", "v_proj"), split_qkv(p.detach(), self.cfg)):
            self._cache.pop(f"{prefix}{proj}.weight", None)  # its copy is new: always requantize
            parts.append(super().effective(f"{prefix}{proj}.weight", t))
        fused = fuse_qkv(*parts, self.cfg)
        self._fused[name] = (p._version, fused)
        return fused

    def _names(self, site: str) -> tuple[str, str]:
        names = self._sites.get(site)
        if names is None:
            inp = site[: -len("qkv_proj")] + "q_proj.input" if site.endswith(".qkv_proj") else site + ".input"
            names = self._sites[site] = (site + ".weight", inp)
        return names

    def _canonical_entries(self, model: nn.Module) -> dict:
        tp_rank, tp, ep_rank, ep = _ranks()
        offset = ep_rank * (self.cfg.n_experts // ep)
        entries = {}
        for mname, p in model.named_parameters():
            if mname.endswith(_M_QKV):
                i = _M_LAYER.match(mname.removeprefix("module.")).group(1)
                self.effective(f"model.layers.{i}.self_attn.qkv_proj.weight", p)
                for s in _QKV:
                    entries[f"model.layers.{i}.{s}"] = self._cache[f"model.layers.{i}.{s}"]
            else:
                name = canonical_name(mname, expert_offset=offset)
                entries[name] = self._entry(name, p)
        return entries

    def effective_weights(self, model: nn.Module) -> dict[str, Tensor]:
        """Canonical name -> effective weight, for this rank's parameters (all of them at EP=1)."""
        dtype = next(model.parameters()).dtype
        return {
            n: self._dense_of(n, e[2], self.plan[n].shape, dtype) for n, e in self._canonical_entries(model).items()
        }

    def quantized_params(self, model: nn.Module) -> dict:
        """Canonical name -> QuantizedParam as published (policy.manifest.build_manifest takes them),
        from the cache the forward fills; this rank's parameters (every one at EP=1)."""
        return {n: e[1] for n, e in self._canonical_entries(model).items()}


def _add_expert_groups(model: nn.Module, hook: MegatronQATHook, expert_offset: int) -> None:
    """Each layer's local experts' linear_fc1s, and their linear_fc2s, are refilled together (one
    stacked quantization each: policy.qat.QATHook.add_group)."""
    groups: dict[tuple[str, str], list[tuple[str, Tensor]]] = {}
    for mname, p in model.named_parameters():
        m = _M_EXPERT.search(mname)
        if m:
            name = canonical_name(mname, expert_offset=expert_offset)
            groups.setdefault((mname[: m.start()], m.group(2)), []).append((name, p))
    for members in groups.values():
        hook.add_group([n for n, _ in members], [p for _, p in members])
    from megatron.core.transformer.moe.experts import SequentialMLP

    for path, mod in model.named_modules():
        if isinstance(mod, SequentialMLP):
            i = _M_LAYER.match(path.removeprefix("module.")).group(1)
            experts = range(expert_offset, expert_offset + len(mod.local_experts))
            mod._tandem_grouped = (
                hook,
                tuple(
                    [f"model.layers.{i}.mlp.experts.{e}.{proj}" for e in experts]
                    for proj in ("gate_up_proj", "down_proj")
                ),
            )


def _qat_forwards(model: nn.Module, hook: MegatronQATHook, expert_offset: int) -> dict[nn.Module, object]:
    """The replacement forward of every module that owns a parameter, keyed by module."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.moe.router import TopKRouter

    out = {}
    for path, mod in model.named_modules():
        if path.removeprefix("module.") == "output_layer" and hook.cfg.tie_word_embeddings:
            # tied head: GPTModel passes the embedding as `weight`; logits = x @ effective(embed).T
            def tied(input_, weight=None, runtime_gather_output=None):
                return F.linear(input_, hook.param("model.embed_tokens.weight", weight)), None

            out[mod] = ("forward", tied)
            continue
        if "weight" not in dict(mod.named_parameters(recurse=False)):
            continue
        mname = f"{path}.weight"
        if mname.removeprefix("module.").endswith(_M_QKV):
            i = _M_LAYER.match(mname.removeprefix("module.")).group(1)
            site = f"model.layers.{i}.self_attn.qkv_proj"
        else:
            site = canonical_name(mname, expert_offset=expert_offset)[: -len(".weight")]

        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):

            def linear(input_, weight=None, runtime_gather_output=None, *, _m=mod, _s=site):
                return hook.linear(_s, input_, _m.weight if weight is None else weight), None

            out[mod] = ("forward", linear)
        elif isinstance(mod, TopKRouter):
            out[mod] = ("gating", lambda input, _m=mod, _s=site: hook.linear(_s, input, _m.weight))
        elif isinstance(mod, nn.RMSNorm):

            def norm(x, _m=mod, _n=site + ".weight"):
                return F.rms_norm(x, _m.normalized_shape, hook.param(_n, _m.weight), _m.eps)

            out[mod] = ("forward", norm)
        elif isinstance(mod, VocabParallelEmbedding):
            out[mod] = ("forward", lambda ids, _m=mod, _n=site + ".weight": F.embedding(ids, hook.param(_n, _m.weight)))
        else:
            raise ValueError(f"megatron QAT: no QAT forward for {type(mod).__name__} at {path!r}")
    return out


def apply_qat(
    model: nn.Module,
    cfg: ModelConfig,
    recipe: Recipe | Plan,
    backward: str = "hp",
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> MegatronQATHook:
    """Install QAT on a GPTModel of `cfg` (in place; TP=1, any EP) and return its hook.

    A torch `optimizer` gets a step post-hook that refreshes the cache; with megatron's own optimizer
    (it writes the parameters through .data, which no version counter sees) the trainer calls
    `hook.invalidate()` after each step."""
    plan = recipe if isinstance(recipe, Plan) else recipe.plan(cfg)
    if plan.config != cfg:
        raise ValueError("apply_qat: the plan was made for a different model config")
    tp_rank, tp, ep_rank, ep = _ranks()
    if tp != 1:
        raise NotImplementedError(f"megatron QAT with TP={tp}: global scales across shards are not implemented")
    acts = {e.name: (e.format, sorted(e.kwargs.items())) for e in plan.activations}
    for i in range(cfg.n_layers):
        specs = [acts[f"model.layers.{i}.self_attn.{p}.input"] for p in ("q_proj", "k_proj", "v_proj")]
        if specs[1:] != specs[:-1]:
            raise ValueError(f"megatron QAT: layer {i} quantizes q/k/v inputs differently; linear_qkv fuses them")
    remove_qat(model)
    hook = MegatronQATHook(plan, backward)
    _add_expert_groups(model, hook, ep_rank * (cfg.n_experts // ep))
    for mod, (attr, fn) in _qat_forwards(model, hook, ep_rank * (cfg.n_experts // ep)).items():
        mod._tandem_qat = (attr, mod.__dict__.get(attr))  # what remove_qat restores
        setattr(mod, attr, fn)
    if optimizer is not None:
        optimizer.register_step_post_hook(hook.invalidate)
    return hook


def remove_qat(model: nn.Module) -> None:
    """Restore megatron's own forwards (undo `apply_qat`)."""
    for mod in model.modules():
        mod.__dict__.pop("_tandem_grouped", None)
        saved = mod.__dict__.pop("_tandem_qat", None)
        if saved is not None:
            attr, previous = saved
            delattr(mod, attr)
            if previous is not None:
                setattr(mod, attr, previous)
