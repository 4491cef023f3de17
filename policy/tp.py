"""Tensor parallelism as a small explicit mapping (gpt-fast style), for weights and activations.

Published tensors are the full logical tensors in canonical layout ([out, in], K = in). A rank
takes its slice of each one by the style its name maps to (`TPPlan`):

    column          cut rows (q/k/v, lm_head)
    column_gate_up  cut the gate half [0, F) and the up half [F, 2F) in step: [gate slice; up slice]
    row             cut K (o_proj, down_proj) at quantization-block boundaries
    replicated      every rank holds the whole tensor (norms, embeddings, the router)

Rules: a cut falls on block boundaries (rows on multiples of the block's rows, K on multiples of its
columns), else the plan refuses it naming the tensor, tp_size and block. Every part of every format
is row-major over the [M, K] grid, so one proportional rule slices them all (`part_index`). nvfp4
global scales are the full tensor's, so a shard is "quantize the full tensor, then slice". Per-token
activation scales: `shard` or `global` (`quantize_activation`). Why: docs/design-decisions.md."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from policy import formats
from policy.fields import is_int

COLUMN = "column"
COLUMN_GATE_UP = "column_gate_up"
ROW = "row"
REPLICATED = "replicated"
STYLES = (COLUMN, COLUMN_GATE_UP, ROW, REPLICATED)

TP_SCALE_MODES = ("shard", "global")

MAX_TP_SIZE = 1024

_LAYER = r"model\.layers\.\d+\."
_EXPERT = r"mlp\.(?:(?:experts\.\d+|shared_expert)\.)?"  # routed, shared or the dense MLP

# First full match wins. Keep this the only place that says how the model is split.
DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (_LAYER + r"self_attn\.[qkv]_proj\.weight", COLUMN),
    (_LAYER + r"self_attn\.o_proj\.weight", ROW),
    (_LAYER + _EXPERT + r"gate_up_proj\.weight", COLUMN_GATE_UP),
    (_LAYER + _EXPERT + r"down_proj\.weight", ROW),
    (r"lm_head\.weight", COLUMN),
    (r".*", REPLICATED),  # norms, embed_tokens, the router (mlp.gate)
)

_ATTENTION_HEADS = re.compile(_LAYER + r"self_attn\.[qkv]_proj\.weight")


def block_shape(fmt: str, kwargs: Mapping | None = None) -> tuple[int, int]:
    """(rows, cols) of one quantization block of format `fmt` with quantize() kwargs `kwargs`:
    the format module's own `block_shape` (ValueError naming the known formats for another name)."""
    return formats.get(fmt).block_shape(**dict(kwargs or {}))


def check_tp(tp_rank: int, tp_size: int) -> None:
    bad = []
    if not is_int(tp_size, 1, MAX_TP_SIZE):
        bad.append(f"tp_size={tp_size!r} must be an int in [1, {MAX_TP_SIZE}]")
    elif not is_int(tp_rank, 0, tp_size - 1):
        bad.append(f"tp_rank={tp_rank!r} must be an int in [0, tp_size={tp_size})")
    if bad:
        raise ValueError("; ".join(bad))


@dataclass(frozen=True)
class ShardCut:
    """Where one rank's shard sits in the logical [M, K] tensor.

    `rows`: row ranges [start, stop) concatenated in order (two for gate_up, one otherwise);
    `cols`: the K range. `shape`: the shard's logical shape.
    """

    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int]
    shape: tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """Name -> TP style, by full-match regular expressions (first match wins)."""

    rules: tuple[tuple[str, str], ...] = DEFAULT_RULES

    def __post_init__(self) -> None:
        rules = tuple((str(p), str(s)) for p, s in self.rules)
        bad = []
        for pattern, style in rules:
            if style not in STYLES:
                bad.append(f"rule {pattern!r}: style {style!r} is not one of {STYLES}")
            try:
                re.compile(pattern)
            except re.error as e:
                bad.append(f"rule {pattern!r}: invalid regular expression ({e})")
        if not rules:
            bad.append("rules is empty")
        if bad:
            raise ValueError("invalid TPPlan: " + "; ".join(bad))
        object.__setattr__(self, "rules", rules)

    @cached_property
    def _compiled(self) -> tuple[tuple[re.Pattern, str], ...]:
        return tuple((re.compile(p), s) for p, s in self.rules)

    def style(self, name: str) -> str:
        for pattern, style in self._compiled:
            if pattern.fullmatch(name):
                return style
        raise ValueError(f"TP plan has no rule for tensor {name!r}")

    def to_dict(self) -> dict:
        return {"rules": [list(r) for r in self.rules]}

    # -- weights -------------------------------------------------------------------------------

    def shard_errors(
        self,
        name: str,
        *,
        fmt: str,
        kwargs: Mapping | None,
        shape: Sequence[int],
        tp_size: int,
        head_dim: int | None = None,
    ) -> list[str]:
        """Every reason tensor `name` cannot be split `tp_size` ways (empty list: it can)."""
        style = self.style(name)
        if tp_size == 1 or style == REPLICATED:
            return []
        if len(shape) != 2:
            return [f"{name}: {style}-parallel needs a 2-D [M, K] tensor, got shape {tuple(shape)}"]
        m, k = (int(s) for s in shape)
        bm, bk = block_shape(fmt, kwargs)
        where = f"{name} ({fmt}, shape [{m}, {k}], block {bm}x{bk})"
        if style == ROW:
            if k % tp_size:
                return [f"{where}: K={k} does not divide by tp_size={tp_size}"]
            if (k // tp_size) % bk:
                return [
                    f"{where}: row-parallel shard over tp_size={tp_size} is {k // tp_size} columns of K, "
                    f"not a whole number of {bk}-column quantization blocks"
                ]
            return []
        errors = []
        halves = 2 if style == COLUMN_GATE_UP else 1
        if halves == 2 and m % 2:
            return [f"{where}: fused gate_up needs an even number of rows, got M={m}"]
        if (m // halves) % tp_size:
            what = f"the gate and up halves of {m // 2} rows" if halves == 2 else f"M={m} rows"
            return [f"{where}: {what} do not divide by tp_size={tp_size}"]
        rows = m // (halves * tp_size)
        if rows % bm:
            errors.append(
                f"{where}: column-parallel shard over tp_size={tp_size} is {rows} rows"
                f"{' per half' if halves == 2 else ''}, not a whole number of {bm}-row quantization blocks"
            )
        if head_dim and _ATTENTION_HEADS.fullmatch(name) and rows % head_dim:
            errors.append(
                f"{where}: shard over tp_size={tp_size} is {rows} rows, not whole heads of head_dim={head_dim}"
            )
        return errors

    def check(
        self,
        tensors: Mapping[str, tuple[str, Mapping | None, Sequence[int]]],
        tp_size: int,
        *,
        head_dim: int | None = None,
    ) -> None:
        """Refuse a TP degree that would cut any tensor off a block boundary.

        `tensors`: name -> (format, quantize kwargs, logical shape). Names every offending tensor.
        """
        check_tp(0, tp_size)
        errors = []
        for name, (fmt, kwargs, shape) in tensors.items():
            errors += self.shard_errors(name, fmt=fmt, kwargs=kwargs, shape=shape, tp_size=tp_size, head_dim=head_dim)
        if errors:
            shown = "; ".join(errors[:8]) + (f"; and {len(errors) - 8} more" if len(errors) > 8 else "")
            raise ValueError(f"TP plan refuses tp_size={tp_size}: {shown}")

    def cut(
        self, name: str, *, fmt: str, kwargs: Mapping | None, shape: Sequence[int], tp_rank: int, tp_size: int
    ) -> ShardCut:
        """The slice of tensor `name` held by rank `tp_rank` of `tp_size` (validated)."""
        check_tp(tp_rank, tp_size)
        errors = self.shard_errors(name, fmt=fmt, kwargs=kwargs, shape=shape, tp_size=tp_size)
        if errors:
            raise ValueError(f"TP plan refuses tp_size={tp_size}: " + "; ".join(errors))
        m, k = (int(s) for s in shape) if len(shape) == 2 else (1, int(shape[0]))
        style = self.style(name)
        if tp_size == 1 or style == REPLICATED:
            return ShardCut(((0, m),), (0, k), (m, k))
        if style == ROW:
            w = k // tp_size
            return ShardCut(((0, m),), (tp_rank * w, (tp_rank + 1) * w), (m, w))
        if style == COLUMN:
            h = m // tp_size
            return ShardCut(((tp_rank * h, (tp_rank + 1) * h),), (0, k), (h, k))
        f = m // 2
        h = f // tp_size
        gate = (tp_rank * h, (tp_rank + 1) * h)
        up = (f + tp_rank * h, f + (tp_rank + 1) * h)
        return ShardCut((gate, up), (0, k), (2 * h, k))


def part_index(
    part_shape: Sequence[int], logical_shape: Sequence[int], cut: ShardCut, *, name: str = "part"
) -> list[tuple[slice, ...]]:
    """Index tuples whose concatenation along dim 0 is the shard of one part.

    The proportional rule: a part dim of size P over a logical dim of size L maps logical [a, b)
    to [a*P/L, b*P/L), which must be whole numbers (block boundaries). Dim 0 of a part follows rows
    (or row blocks), dim 1 follows K (or K blocks); a 1-D part of length M is per row (nvfp4 `row`
    scope) and a [1] part (per-tensor scale) is taken whole.

    Slicing the packed bytes equals quantizing the slice for mxfp8, int4, bf16 and fp8_block (every
    scale belongs to one block, and blocks never straddle a cut). For nvfp4 `tensor` scope the fp32
    global scale is computed from the amax of the full logical tensor (gate and up jointly), so the
    canonical bytes are "quantize the full tensor, then slice" and every shard carries the full
    tensor's global scale.
    """
    m, k = (int(s) for s in logical_shape) if len(logical_shape) == 2 else (1, int(logical_shape[0]))
    part_shape = tuple(int(s) for s in part_shape)
    whole = cut.rows == ((0, m),) and cut.cols == (0, k)

    def scale(a: int, size: int, logical: int) -> int:
        if logical == 0 or (a * size) % logical:
            raise ValueError(
                f"{name}: shard boundary {a} of a logical dim of {logical} falls inside a block "
                f"of a part dim of {size} (part shape {part_shape}, logical shape {(m, k)})"
            )
        return a * size // logical

    if whole or part_shape == (1,):
        return [tuple(slice(None) for _ in part_shape)]
    if len(part_shape) == 1:
        if cut.cols != (0, k) and part_shape[0] != m:
            raise ValueError(f"{name}: cannot cut K of a 1-D part of shape {part_shape}")
        return [(slice(scale(a, part_shape[0], m), scale(b, part_shape[0], m)),) for a, b in cut.rows]
    if len(part_shape) != 2:
        raise ValueError(f"{name}: parts must be 1-D or 2-D, got shape {part_shape}")
    p_rows, p_cols = part_shape
    cols = slice(scale(cut.cols[0], p_cols, k), scale(cut.cols[1], p_cols, k))
    return [(slice(scale(a, p_rows, m), scale(b, p_rows, m)), cols) for a, b in cut.rows]


def shard_parts(
    parts: Mapping[str, torch.Tensor], logical_shape: Sequence[int], cut: ShardCut
) -> dict[str, torch.Tensor]:
    """The shard of every part of a quantized tensor (contiguous copies, same dtypes)."""
    out = {}
    for pname, t in parts.items():
        pieces = [t[idx] for idx in part_index(tuple(t.shape), logical_shape, cut, name=pname)]
        out[pname] = (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)).contiguous()
    return out


def shard_quantized(q, *, fmt: str, kwargs: Mapping | None, cut: ShardCut):
    """The shard of a quantized object as an object of the same format (via from_parts)."""
    mod = formats.get(fmt)
    return mod.from_parts(shard_parts(q.parts(), q.shape, cut), cut.shape, **from_parts_kwargs(fmt, kwargs))


def from_parts_kwargs(fmt: str, kwargs: Mapping | None) -> dict:
    """quantize()/from_parts() kwargs from their JSON form (JSON turns fp8_block's block tuple into a list)."""
    out = dict(kwargs or {})
    if fmt == "fp8_block" and "block" in out:
        out["block"] = tuple(out["block"])
    return out


# -- activations ------------------------------------------------------------------------------


def group_size(group=None) -> int:
    """Size of a TP process group; None means no TP group (size 1), even inside a larger world."""
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


def quantize_activation(
    x_local: torch.Tensor,
    *,
    fmt: str,
    scope: str | None = None,
    tp_scale_mode: str = "global",
    group=None,
    partition_tp_size: int = 0,
    kwargs: Mapping | None = None,
    site: str = "activation",
):
    """Quantize one rank's activation shard per token under a TP group (torch.distributed).

    `x_local` is [tokens, K_local], this rank's slice of K (the whole row for a column-parallel
    input). `group` is the TP process group (gloo or NCCL); None means TP=1. Only nvfp4 has a
    scale spanning more than one block (its `row`/`tensor` global scale); every other format's
    scales are block-local, so both modes give the same bytes for them.

    `global`: all-reduce MAX of each token's amax over `group`, then quantize with that amax: the
    result is the slice of the TP=1 quantization, bit for bit. `shard`: the local amax; refused
    when `partition_tp_size` (the trainer's TP degree from the contract, 0 = unpinned) differs
    from this group's size.
    """
    if tp_scale_mode not in TP_SCALE_MODES:
        raise ValueError(f"{site}: tp_scale_mode {tp_scale_mode!r} is not one of {TP_SCALE_MODES}")
    size = group_size(group)
    if tp_scale_mode == "shard" and partition_tp_size and partition_tp_size != size:
        raise ValueError(
            f"{site}: tp_scale_mode 'shard' computes per-token scales over the local shard, so the "
            f"contract pins the trainer's partition tp_size={partition_tp_size}; this TP group has "
            f"tp_size={size}. Use tp_size={partition_tp_size} or publish with tp_scale_mode 'global'."
        )
    mod = formats.get(fmt)
    kw = from_parts_kwargs(fmt, kwargs)
    if fmt != "nvfp4":
        return mod.quantize(x_local, **kw)
    scope = scope or kw.pop("scope", "row")
    kw.pop("scope", None)
    if tp_scale_mode == "shard" or size == 1:
        return mod.quantize(x_local, scope=scope, **kw)
    import torch.distributed as dist

    b = formats.nvfp4.BLOCK
    if x_local.dim() != 2 or x_local.shape[1] % b:
        raise ValueError(
            f"{site}: expected a 2-D [tokens, K] activation with K divisible by {b}, got shape {tuple(x_local.shape)}"
        )
    xf = x_local.detach().to(torch.float32)
    m, k = xf.shape
    amax = xf.abs().amax(dim=1) if k else xf.new_zeros(m)
    if scope == "tensor":
        amax = amax.amax().reshape(1) if m else xf.new_zeros(1)
    # One all-reduce carries the amax and a non-finite flag, so every rank raises together
    # instead of one raising while the others wait in the collective.
    bad = (~torch.isfinite(xf)).any().to(torch.float32).reshape(1)
    reduced = torch.cat([torch.nan_to_num(amax, nan=0.0, posinf=0.0), bad])
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    if reduced[-1] > 0:
        raise ValueError(f"{site}: activation has non-finite values on some rank of the TP group")
    return mod.quantize(xf, scope=scope, amax=reduced[:-1])


def fake_quant_activation(x_local: torch.Tensor, **kwargs) -> torch.Tensor:
    """dequantize(quantize_activation(...)) in x_local's dtype."""
    fmt = kwargs["fmt"]
    return formats.get(fmt).dequantize(quantize_activation(x_local, **kwargs)).to(x_local.dtype)
