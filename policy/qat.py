"""Quantization-aware forward (trainer) and the packed-weight path (rollout), from one recipe plan.

Trainer: `apply_qat(model, recipe, backward="hp"|"dequant")` installs a `QATHook`: every matmul
computes as DESIGN.md's Compute contract says (`policy.compute.matmul` on the effective operands of
the weight and, at the recipe's activation sites, of the per-token quantized input); non-matmul
parameters use dequantize(quantize(p)). Backward is the straight-through estimator: `hp` (the
original operands x, W) or `dequant` (the forward's x̂, Ŵ); non-matmul parameters pass straight.
Rollout: `quantize_weights(model, recipe)` gives the packed tensors a trainer publishes, and
`install_packed(model, recipe, packed)` makes a model compute with them (`PackedHook`: QATHook's
code, operands from the packed objects). Both sides build operands with `policy.kernels.operand`
from the same quantized objects, so for version v every matmul's operands are bitwise equal.
Operands are cached per parameter and refilled once per optimizer step; MoE projections' experts are
refilled together in one stacked call (`hook.add_group`). `probe_mismatch` compares BF16, QAT and
packed-weight forwards. The cache's invalidation rules: `QATHook`; why: docs/design-decisions.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from policy import compute, formats, kernels
from policy.formats import Operand
from policy.formats.params import QuantizedParam, quantize_param
from policy.model import MoE, QuantHook, Transformer
from policy.recipe import Plan, Recipe
from policy.tp import from_parts_kwargs

__all__ = [
    "BACKWARD_MODES",
    "ActivationQuantizer",
    "PackedHook",
    "QATHook",
    "apply_qat",
    "bits",
    "dequantize_packed",
    "install_packed",
    "load_packed",
    "probe_mismatch",
    "quantize_weights",
    "remove_qat",
    "stacked_operands",
]

BACKWARD_MODES = ("hp", "dequant")


def _as_plan(model: Transformer, recipe: Recipe | Plan) -> Plan:
    if isinstance(recipe, Plan):
        if recipe.config != model.cfg:
            raise ValueError("the plan was made for a different model config")
        return recipe
    if isinstance(recipe, Recipe):
        return recipe.plan(model)
    raise ValueError(f"expected a Recipe or a Plan, got {type(recipe).__name__}")


def _quantize_param(entry, w: Tensor):
    """The quantized object of one parameter, exactly as the trainer publishes it (policy.manifest)."""
    return quantize_param(w, entry.format, **entry.kwargs).value


class ActivationQuantizer:
    """Per-token activation quantization: `aq(site_name, x) -> Operand`, or None where the recipe
    leaves the site unquantized (no autograd).

    `site_name` is an activation site ("...down_proj.input"); x is [rows, K] with row-local scales,
    so each token's result depends only on that token. The operand is `policy.kernels.operand` of
    `policy.kernels.quantize` (the Triton quantizers on CUDA, the reference elsewhere: same bytes).
    """

    def __init__(self, plan: Plan):
        self.sites = {e.name: (e.format, e.kwargs) for e in plan.activations if e.format != "bf16"}

    def __call__(self, name: str, x: Tensor) -> Operand | None:
        spec = self.sites.get(name)
        if spec is None:
            return None
        with torch.no_grad():  # no NaN/Inf check (a host sync per call): a non-finite input shows in the loss
            x2 = x.detach().reshape(-1, x.shape[-1])
            return kernels.operand(kernels.quantize(spec[0], x2, check_finite=False, **spec[1]))

    def quantize_rows(self, names: Sequence[str], x: Tensor, counts: Sequence[int]) -> Operand | _Chunks | None:
        """x [sum(counts), K], chunk i (counts[i] rows) feeding site names[i] -> the operand of all
        rows (one quantize call when all sites share a spec, the usual MoE case: rows are
        independent, so this equals quantizing chunk by chunk, bit for bit), per-chunk operands
        (None where unquantized) when the specs differ, or None if no site quantizes."""
        specs = [self.sites.get(n) for n in names]
        if all(s is None for s in specs):
            return None
        if all(s == specs[0] for s in specs):
            return self(names[0], x)
        return _Chunks(self(n, c) for n, c in zip(names, x.split(list(counts))))


class _Chunks(tuple):
    """Per-chunk activation operands (None: unquantized) of a mixed group, already split."""

    def split(self, sizes) -> _Chunks:
        return self


class _QATLinear(torch.autograd.Function):
    """y = matmul(x̂, Ŵ) per the Compute contract; backward with (x, W) in hp mode or the dequantized
    operands (x̂, Ŵ) in dequant mode (straight-through). x is [M, K]."""

    @staticmethod
    def forward(ctx, x, w, x_op, w_op, hp: bool, dtype, exact: bool = False):
        if hp:
            ctx.save_for_backward(x, w)
        else:
            ctx.ops = (x_op, w_op)
        ctx.hp, ctx.w_dtype = hp, w.dtype
        return compute.matmul(x_op, w_op, dtype, exact=exact)

    @staticmethod
    def backward(ctx, grad):
        if ctx.hp:
            xs, ws = ctx.saved_tensors
        else:
            xs, ws = (o.dequantize() for o in ctx.ops)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(ws.to(grad.dtype))
        if ctx.needs_input_grad[1]:
            grad_w = grad.t().matmul(xs.to(grad.dtype)).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None


class _StraightThrough(torch.autograd.Function):
    """Forward returns the fake-quantized value, backward passes the gradient to the master."""

    @staticmethod
    def forward(ctx, p, p_hat):
        return p_hat.view_as(p_hat)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _split_rows(t: Tensor | None, n: int) -> Sequence[Tensor | None]:
    """t's rows in n equal blocks (views), or n Nones."""
    return [None] * n if t is None else t.split(t.shape[0] // n)


def stacked_operands(flat, n: int) -> tuple[list[Operand], Operand | None]:
    """The operands of the n tensors stacked along rows in one quantized object `flat`
    (`kernels.quantize_stacked`'s): one `kernels.operand` call, each tensor's operand a view of its
    rows, and the [n, N, K] operand of all of them for the grouped GEMM (None with block scales)."""
    op = kernels.operand(flat)
    return _split_operand(op, n), _grouped_operand(op, n)


def _split_operand(op: Operand, n: int) -> list[Operand]:
    """The operands of the n tensors stacked along rows in `op`, as views of its rows."""
    parts = zip(_split_rows(op.values, n), _split_rows(op.scale, n), _split_rows(op.block_scale, n))
    return [Operand(v, scale=s, block_scale=b, block=op.block) for v, s, b in parts]


def _grouped_operand(op: Operand, n: int) -> Operand | None:
    """The [n, N, K] operand of the n tensors stacked along rows in `op` (None with block scales)."""
    if op.block_scale is not None:
        return None
    scale = None if op.scale is None else op.scale.view(n, -1)
    return Operand(op.values.view(n, -1, op.values.shape[-1]), scale=scale)


def _stack_operands(ops: Sequence[Operand]) -> Operand:
    """One [E, N, K] operand of E weight operands without block scales (scale [E, 1 or N] or None)."""
    values = torch.stack([o.values for o in ops])
    if ops[0].scale is None:
        return Operand(values)
    return Operand(values, scale=torch.stack([o.scale for o in ops]))


class _Group:
    """Parameters quantized together (one MoE projection's experts): their names and parameters, and
    what the last refill made of them: the parameters' autograd versions and device then, the
    [E, N, K] operand of all of them for the grouped GEMM (`stacked`; None with block scales), and
    each one's (quantized object, operand), views of the stacked result made when first asked for
    (the grouped forward never asks: a refill makes no per-expert objects)."""

    def __init__(self, names: Sequence[str], params: Sequence[Tensor]):
        self.names, self.params = tuple(names), tuple(params)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.clear()

    def clear(self) -> None:
        self.versions: tuple[int, ...] | None = None
        self.device: torch.device | None = None
        self.stacked: Operand | None = None
        self._flat = self._op = None
        self._experts: list[tuple[object, Operand]] | None = None

    def fill(self, flat, op: Operand | None, experts: list | None = None) -> None:
        """The refill's result: `flat` (all rows) and its operand `op`, or per-expert `experts`."""
        self.versions = tuple(p._version for p in self.params)
        self.device = self.params[0].device
        self._flat, self._op, self._experts = flat, op, experts
        self.stacked = None if op is None else _grouped_operand(op, len(self.names))

    def fresh(self, i: int | None = None) -> bool:
        """Whether the refill still holds parameter i's value (every parameter's, for None)."""
        if self.versions is None or self.device != self.params[0].device:
            return False
        if i is not None:
            return self.versions[i] == self.params[i]._version
        return all(v == p._version for v, p in zip(self.versions, self.params))

    def expert(self, i: int) -> tuple[object, Operand]:
        """(quantized object, operand) of parameter i, views of the refill's."""
        if self._experts is None:
            n = len(self.names)
            qs = kernels.rows_of(self._flat, n, tuple(self.params[0].shape))
            self._experts = list(zip(qs, _split_operand(self._op, n)))
        return self._experts[i]


class QATHook(QuantHook):
    """The QAT `QuantHook`: Compute-contract matmuls on cached weight operands and per-token activation
    operands, straight-through backward.

    Operands are cached per parameter together with the quantized object they came from and
    recomputed once per optimizer step: `apply_qat(..., optimizer=opt)` registers a step post-hook
    that invalidates the cache (the first forward after the step refills it, tensor by tensor, on the
    parameter's device), and so do `Transformer.load_weights` and a bumped autograd version counter
    (in-place edits outside the optimizer). A fused optimizer does not bump that counter, so a
    trainer that steps an optimizer it did not register must call `invalidate()` itself. The cache
    is one copy of the operands plus the packed parts; `quantized_params(model)` hands those parts
    to the publish. Expert groups (`add_group`) are quantized in one call (`policy.kernels.
    quantize_stacked`: the same bytes as one call per expert; on CUDA it reads the masters where
    they are), and each expert's QuantizedParam and operand are views of one stacked result, which
    the grouped MoE forward (`grouped_linear`) multiplies in one grouped GEMM."""

    def __init__(self, plan: Plan, backward: str = "hp", *, exact: bool = False):
        if backward not in BACKWARD_MODES:
            raise ValueError(f"backward={backward!r}; expected one of {BACKWARD_MODES}")
        super().__init__(exact=exact)
        self.plan = plan
        self.backward = backward
        self.act_quant = ActivationQuantizer(plan)
        self._params = {e.name: e for e in plan.params}
        self._sites: dict[str, tuple[str, str]] = {}
        # name -> (the parameter's autograd version, its QuantizedParam, its operand)
        self._cache: dict[str, tuple[int, QuantizedParam, Operand]] = {}
        self._dense: dict[str, tuple[Operand, Tensor]] = {}  # effective(): keyed by the operand it came from
        self._groups: dict[str, _Group] = {}  # name -> the group it is refilled with
        self._groupable: dict[str, bool] = {}  # first site -> can_group()

    def invalidate(self, *_: object) -> None:
        """Forget every cached weight (also an optimizer step post-hook: it is called with the optimizer)."""
        self._cache.clear()
        self._dense.clear()
        for g in self._groups.values():
            g.clear()

    def add_group(self, names: Sequence[str], params: Sequence[Tensor]) -> None:
        """Refill these parameters together (one MoE projection's experts, same recipe entry and
        shape): one stacked quantization instead of one per parameter. Ignored if they differ."""
        entries = [self._params.get(n) for n in names]
        first = entries[0]
        if (
            len(names) < 2
            or any(e is None or (e.format, e.kwargs) != (first.format, first.kwargs) for e in entries)
            or any(p.shape != params[0].shape or p.dtype != params[0].dtype or p.dim() != 2 for p in params)
        ):
            return
        g = _Group(names, params)
        for n in names:
            self._groups[n] = g

    def _refill(self, g: _Group) -> None:
        spec = self._params[g.names[0]]
        kw = from_parts_kwargs(spec.format, spec.kwargs)
        with torch.no_grad():
            xs = [p.detach() for p in g.params]
            flat = kernels.quantize_group(spec.format, xs, check_finite=False, **kw)
            if flat is not None:
                g.fill(flat, kernels.operand(flat))
            else:  # quantized one by one
                qs = [kernels.quantize(spec.format, x, check_finite=False, **kw) for x in xs]
                g.fill(None, None, [(q, kernels.operand(q)) for q in qs])

    def _group_operand(self, g: _Group) -> Operand | None:
        """Group g's [E, N, K] operand of its parameters' current values (refilled if one changed)."""
        if not g.fresh():
            self._refill(g)
        return g.stacked

    def _entry(self, name: str, p: Tensor) -> tuple[int, QuantizedParam, Operand]:
        hit = self._cache.get(name)
        if hit is not None and hit[0] == p._version and hit[2].values.device == p.device:
            return hit
        g = self._groups.get(name)
        if g is not None and g.params[g.index[name]] is p:
            i = g.index[name]
            if not g.fresh(i):
                self._refill(g)
            spec = self._params[name]
            q, op = g.expert(i)
            hit = self._cache[name] = (p._version, QuantizedParam(spec.format, dict(spec.kwargs), q), op)
            return hit
        with torch.no_grad():
            # No NaN/Inf check here (a host sync per weight, every step): the trainer checks the
            # master weights once per publish (trainer.backends), a NaN forward shows in the loss.
            q = quantize_param(p, self._params[name].format, check_finite=False, **self._params[name].kwargs)
            hit = self._cache[name] = (p._version, q, kernels.operand(q.value))
        return hit

    def operand(self, name: str, p: Tensor) -> Operand:
        """The effective operand of parameter `name` (values [out, in]), computed once per optimizer step."""
        return self._entry(name, p)[2]

    def effective(self, name: str, p: Tensor) -> Tensor:
        """dequantize(quantize(p)) in p's dtype and shape (no autograd): the operand times its scales."""
        return self._dense_of(name, self.operand(name, p), p.shape, p.dtype)

    def _dense_of(self, name: str, op: Operand, shape, dtype: torch.dtype) -> Tensor:
        hit = self._dense.get(name)
        if hit is None or hit[0] is not op:
            hit = self._dense[name] = (op, op.dequantize().view(shape).to(dtype))
        return hit[1]

    def effective_weights(self, model: Transformer) -> dict[str, Tensor]:
        return {n: self.effective(n, p) for n, p in model.named_parameters()}

    def quantized_params(self, model: Transformer) -> dict[str, QuantizedParam]:
        """Every parameter's QuantizedParam, as published (policy.manifest.build_manifest takes them):
        the same objects the forward computes with, from the cache where the forward already made them."""
        return {n: self._entry(n, p)[1] for n, p in model.named_parameters()}

    def _names(self, site: str) -> tuple[str, str]:
        names = self._sites.get(site)
        if names is None:
            names = self._sites[site] = (site + ".weight", site + ".input")
        return names

    def quantize_inputs(self, sites: Sequence[str], x: Tensor, counts: Sequence[int]) -> Operand | None:
        return self.act_quant.quantize_rows([self._names(s)[1] for s in sites], x, counts)

    def linear(self, site: str, x: Tensor, weight: Tensor, x_hat: Operand | Tensor | None = None) -> Tensor:
        names = self._names(site)
        w_op = self.operand(names[0], weight)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        dtype = compute.compute_dtype(x)
        x_op = x_hat if isinstance(x_hat, Operand) else self.act_quant(names[1], x2)
        if x_op is None:
            x_op = compute.plain(x2.to(dtype))
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            y = _QATLinear.apply(x2, weight, x_op, w_op, self.backward == "hp", dtype, self.exact)
        else:
            y = compute.matmul(x_op, w_op, dtype, exact=self.exact)
        return y.view(*lead, y.shape[-1])

    def can_group(self, sites: Sequence[str]) -> bool:
        """Whether these sites' matmuls can run as one grouped GEMM: one weight spec and one
        activation spec for all, and no per-K-block scales (fp8_block)."""
        hit = self._groupable.get(sites[0])
        if hit is None:
            w = [self._params.get(self._names(s)[0]) for s in sites]
            a = [self.act_quant.sites.get(self._names(s)[1]) for s in sites]
            hit = self._groupable[sites[0]] = (
                all(e is not None and (e.format, e.kwargs) == (w[0].format, w[0].kwargs) for e in w)
                and w[0].format != "fp8_block"
                and all(spec == a[0] for spec in a)
                and (a[0] is None or a[0][0] != "fp8_block")
            )
        return hit

    def grouped_linear(
        self, sites: Sequence[str], x: Tensor, weights: Sequence[Tensor], offs: Tensor, groups: Tensor
    ) -> Tensor:
        names = [self._names(s)[0] for s in sites]
        g = self._groups.get(names[0])
        w_op = None
        if g is not None and g.names == tuple(names) and all(a is b for a, b in zip(g.params, weights)):
            w_op = self._group_operand(g)
        if w_op is None:  # not refilled as a group (e.g. a PackedHook's operands): stack them now
            w_op = _stack_operands([self._entry(n, w)[2] for n, w in zip(names, weights)])
        dtype = compute.compute_dtype(x)
        x_op = self.act_quant(self._names(sites[0])[1], x)
        if x_op is None:
            x_op = compute.plain(x.detach().to(dtype))
        if torch.is_grad_enabled() and (x.requires_grad or weights[0].requires_grad):
            return compute.GroupedLinear.apply(x, x_op, w_op, offs, groups, self.backward == "hp", dtype, *weights)
        return compute.grouped_matmul(x_op, w_op, offs, groups, dtype)

    def param(self, name: str, p: Tensor) -> Tensor:
        p_hat = self.effective(name, p)
        if torch.is_grad_enabled() and p.requires_grad:
            return _StraightThrough.apply(p, p_hat)
        return p_hat


class PackedHook(QATHook):
    """Rollout side: QATHook's forward with the operands of a published version's quantized objects
    (`packed`: canonical name -> policy.formats object, for every parameter), whatever the model's
    parameters hold. No autograd, nothing to invalidate."""

    def __init__(self, plan: Plan, packed: dict[str, object], *, exact: bool = False):
        super().__init__(plan, exact=exact)
        missing = sorted(set(self._params) - set(packed))
        if missing:
            raise ValueError(f"PackedHook: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
        self._cache = {n: (-1, q, kernels.operand(q)) for n, q in packed.items()}

    def invalidate(self, *_: object) -> None:
        self._dense.clear()

    def _entry(self, name: str, p: Tensor) -> tuple[int, object, Operand]:
        return self._cache[name]


def apply_qat(
    model: Transformer,
    recipe: Recipe | Plan,
    backward: str = "hp",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    exact: bool = False,
) -> QATHook:
    """Install QAT on `model` (in place) and return the hook; `optimizer`'s steps refresh its cache;
    exact: the model computes in exact mode (policy.exact)."""
    hook = QATHook(_as_plan(model, recipe), backward, exact=exact)
    for mod in model.modules():
        if isinstance(mod, MoE):
            for names, params in mod.expert_groups():
                hook.add_group(names, params)
    model.quant_hook = hook
    if optimizer is not None:
        optimizer.register_step_post_hook(hook.invalidate)
    return hook


def remove_qat(model: Transformer) -> None:
    model.quant_hook = None


@torch.no_grad()
def quantize_weights(model: Transformer, recipe: Recipe | Plan) -> dict[str, object]:
    """Canonical name -> quantized object (policy.formats) for every parameter: what gets published.

    1-D parameters (norm weights) are quantized as [1, N] matrices (always bf16 in valid recipes).
    """
    plan = _as_plan(model, recipe)
    return {n: _quantize_param(plan[n], p) for n, p in model.named_parameters()}


def dequantize_packed(q) -> Tensor:
    """fp32 [M, K] values of one quantized object, whatever its format."""
    return formats.dequantize(q)


@torch.no_grad()
def load_packed(model: Transformer, packed: dict[str, object]) -> None:
    """Load dequantize(packed[name]) into every parameter (cast to its dtype). All names required."""
    params = dict(model.named_parameters())
    model.load_weights(
        {
            n: dequantize_packed(q).view(params[n].shape) if n in params else dequantize_packed(q)
            for n, q in packed.items()
        }
    )


def install_packed(
    model: Transformer, recipe: Recipe | Plan, packed: dict[str, object], *, exact: bool = False
) -> PackedHook:
    """Rollout side: `model` computes with the published `packed` tensors (moved to its device) as
    the Compute contract says; its parameters hold their dequantization (`load_packed`); exact: in
    exact mode (policy.exact)."""
    load_packed(model, packed)
    device = model.lm_head.weight.device
    packed = {n: kernels.to_device(q, device) for n, q in packed.items()}
    hook = PackedHook(_as_plan(model, recipe), packed, exact=exact)
    model.quant_hook = hook
    return hook


# --------------------------------------------------------------------------------------------------
# Mismatch probe


def _pair_metrics(lp_a: Tensor, lp_b: Tensor, targets: Tensor, mask: Tensor) -> dict[str, float]:
    """lp_*: [B, T, V] log-probs. Mean |Δ log p(target)|, max, and KL(a || b) over the vocab."""
    ta = lp_a.gather(-1, targets[..., None]).squeeze(-1)
    tb = lp_b.gather(-1, targets[..., None]).squeeze(-1)
    diff = (ta - tb).abs()[mask]
    kl = (lp_a.exp() * (lp_a - lp_b)).sum(-1)[mask]
    return {"mean_abs_dlogp": diff.mean().item(), "max_abs_dlogp": diff.max().item(), "kl": kl.mean().item()}


@torch.no_grad()
def probe_mismatch(model: Transformer, recipe: Recipe, tokens: Tensor, attention_mask: Tensor | None = None) -> dict:
    """Compare three forwards of `model` on `tokens` [B, T] (targets = next tokens):

    bf16    the `bf16` recipe: weights rounded to bf16, activations unquantized (BF16 baseline);
    qat     the QAT forward under `recipe` (trainer side);
    packed  a copy of the model computing with quantize_weights(model, recipe) (`install_packed`:
            what a CPU rollout computes).
    Returns {"pairs": {"bf16~qat": {...}, "bf16~packed": {...}, "qat~packed": {...}},
             "weights_bitwise_equal": bool (QAT's weight operands vs the packed ones, bitwise),
             "tokens": number of scored tokens}.
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B, T] with T >= 2, got {tuple(tokens.shape)}")
    mask = torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    saved = model.quant_hook
    try:

        def logprobs(m: Transformer) -> Tensor:
            return m(tokens, attention_mask=mask).float().log_softmax(-1)[:, :-1]

        apply_qat(model, Recipe.load("bf16"))
        lp_bf16 = logprobs(model)
        hook = apply_qat(model, recipe)
        lp_qat = logprobs(model)

        w = model.lm_head.weight
        rollout = Transformer(model.cfg).to(device=w.device, dtype=w.dtype)
        packed_hook = install_packed(rollout, hook.plan, quantize_weights(model, hook.plan))
        lp_packed = logprobs(rollout)
        same = all(_same_operand(hook.operand(n, p), packed_hook.operand(n, p)) for n, p in model.named_parameters())
    finally:
        model.quant_hook = saved

    targets = tokens[:, 1:]
    valid = mask[:, 1:] & mask[:, :-1]
    pairs = {
        "bf16~qat": _pair_metrics(lp_bf16, lp_qat, targets, valid),
        "bf16~packed": _pair_metrics(lp_bf16, lp_packed, targets, valid),
        "qat~packed": _pair_metrics(lp_qat, lp_packed, targets, valid),
    }
    return {
        "recipe": recipe.name,
        "pairs": pairs,
        "weights_bitwise_equal": same,
        "tokens": int(valid.sum()),
        "logits_bitwise_equal": bool(torch.equal(lp_qat, lp_packed)),
    }


def bits(t: Tensor) -> Tensor:
    """The raw bytes of a tensor, for bitwise comparisons (torch.equal says -0.0 == 0.0)."""
    return t.detach().contiguous().view(torch.uint8)


def _same_operand(a: Operand, b: Operand) -> bool:
    """Bitwise equality of two operands (values and every scale)."""
    pairs = ((a.values, b.values), (a.scale, b.scale), (a.block_scale, b.block_scale))
    return a.block == b.block and all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(bits(u), bits(v)))
        for u, v in pairs
    )
