"""Quantization-aware forward (trainer) and the packed-weight path (rollout), from one recipe plan.

Trainer side: `apply_qat(model, recipe, backward="hp"|"dequant")` installs a `QATHook`. Forward uses
fake_quant(w) = dequantize(quantize(w)) for every parameter per the recipe (bf16-format parameters are
rounded to bf16) and per-token fake quantization at the recipe's activation sites. Backward is the
straight-through estimator, in one of two modes:
  hp       gradients of each matmul use the original high-precision operands (x, W);
  dequant  gradients use the dequantized operands the forward used (x̂, Ŵ).
Non-matmul parameters (embeddings, norm weights) pass gradients straight through in both modes.

Rollout side: `quantize_weights(model, recipe)` gives the packed tensors a trainer publishes;
`load_packed(model, packed)` loads dequantize(packed) into a model and `install_activation_quant`
puts the same per-token activation quantizer (`ActivationQuantizer`) in front of each matmul.

Bit-exactness: QAT's effective weight for a parameter is `dequantize(quantize(w))` computed by the same
policy.formats functions the rollout uses on the published tensors, cast to the parameter dtype on both
sides, so for version v the trainer's effective weights equal the rollout's bitwise (tested). The
matmul then sees identical operands on both sides.

Effective weights are cached per parameter together with the quantized object they came from, and
recomputed once per optimizer step: `apply_qat(..., optimizer=opt)` registers a step post-hook that
invalidates the cache (the first forward after the step refills it, tensor by tensor, on the device
the parameter lives on), and so do `Transformer.load_weights` and a bumped autograd version counter
(in-place edits outside the optimizer). A fused optimizer does not bump that counter, so a trainer
that steps an optimizer it did not register must call `hook.invalidate()` itself. The cache is one
copy of the effective weights plus the packed parts; publishing reuses those parts
(`hook.quantized_params(model)`) instead of quantizing every weight again.

`probe_mismatch` compares BF16, QAT and packed-weight forwards (mean |Δ log-prob| and KL per pair).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from policy import formats, kernels
from policy.manifest import QuantizedParam, quantize_param
from policy.model import QuantHook, Transformer, parameter_shapes
from policy.recipe import Plan, Recipe

__all__ = [
    "BACKWARD_MODES",
    "ActivationQuantizer",
    "QATHook",
    "apply_qat",
    "bits",
    "dequantize_packed",
    "install_activation_quant",
    "load_packed",
    "probe_mismatch",
    "quantize_weights",
    "remove_qat",
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
    """Per-token activation fake quantization: `aq(site_name, x) -> x̂` (no autograd).

    `site_name` is an activation site ("...down_proj.input"); x is [..., K] and is quantized as a
    [rows, K] matrix with row-local scales, so each token's result depends only on that token.
    Sites the recipe leaves in bf16 return x unchanged.
    """

    def __init__(self, plan: Plan):
        # (format, kwargs) per quantized site; policy.kernels runs the Triton kernel on CUDA tensors
        # and the policy.formats reference elsewhere (the same bytes either way).
        self.sites = {e.name: (e.format, e.kwargs) for e in plan.activations if e.format != "bf16"}

    def __call__(self, name: str, x: Tensor) -> Tensor:
        spec = self.sites.get(name)
        if spec is None:
            return x
        fmt, kwargs = spec
        with torch.no_grad():
            x2 = x.detach().reshape(-1, x.shape[-1])
            return kernels.fake_quant(fmt, x2, **kwargs).view(x.shape)

    def quantize_rows(self, names: Sequence[str], x: Tensor, counts: Sequence[int]) -> Tensor | None:
        """x [sum(counts), K], chunk i (counts[i] rows) feeding site names[i] -> x̂, or None if no
        site quantizes. One fake_quant call when all sites share a spec (the usual MoE case): rows
        are independent, so this equals quantizing chunk by chunk, bit for bit."""
        specs = [self.sites.get(n) for n in names]
        if all(s is None for s in specs):
            return None
        with torch.no_grad():
            x = x.detach()
            if all(s == specs[0] for s in specs):
                fmt, kwargs = specs[0]
                return kernels.fake_quant(fmt, x.reshape(-1, x.shape[-1]), **kwargs).view(x.shape)
            return torch.cat(
                [c if s is None else kernels.fake_quant(s[0], c, **s[1]) for s, c in zip(specs, x.split(list(counts)))]
            )


class _QATLinear(torch.autograd.Function):
    """y = x̂ Ŵᵀ; backward with (x, W) in hp mode or (x̂, Ŵ) in dequant mode (straight-through)."""

    @staticmethod
    def forward(ctx, x, w, x_hat, w_hat, hp: bool):
        ctx.save_for_backward(x if hp else x_hat, w if hp else w_hat)
        ctx.w_dtype = w.dtype  # the cache may hold w_hat in bf16: the gradient is the master's dtype
        return F.linear(x_hat, w_hat)

    @staticmethod
    def backward(ctx, grad):
        xs, ws = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(ws.to(grad.dtype))
        if ctx.needs_input_grad[1]:
            g2 = grad.reshape(-1, grad.shape[-1])
            grad_w = g2.t().matmul(xs.reshape(-1, xs.shape[-1]).to(grad.dtype)).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None


class _StraightThrough(torch.autograd.Function):
    """Forward returns the fake-quantized value, backward passes the gradient to the master."""

    @staticmethod
    def forward(ctx, p, p_hat):
        return p_hat.view_as(p_hat)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class QATHook(QuantHook):
    """The QAT `QuantHook`: fake-quantized weights (cached) and activations, straight-through backward."""

    def __init__(self, plan: Plan, backward: str = "hp", cache_dtype: torch.dtype | None = None):
        if backward not in BACKWARD_MODES:
            raise ValueError(f"backward={backward!r}; expected one of {BACKWARD_MODES}")
        self.plan = plan
        self.backward = backward
        # cache_dtype (e.g. bf16 under bf16 autocast): the dtype matmul weights' effective values are
        # kept in (None: the parameter's); embeddings and norms keep the parameter's dtype.
        self.cache_dtype = cache_dtype
        self._matmul = {n for n, s in parameter_shapes(plan.config).items() if len(s) == 2} - {
            "model.embed_tokens.weight"
        }
        self.act_quant = ActivationQuantizer(plan)
        self._params = {e.name: e for e in plan.params}
        self._sites: dict[str, tuple[str, str]] = {}
        # name -> (the parameter's autograd version, its QuantizedParam, its effective weight)
        self._cache: dict[str, tuple[int, QuantizedParam, Tensor]] = {}

    def invalidate(self, *_: object) -> None:
        """Forget every cached weight (also an optimizer step post-hook: it is called with the optimizer)."""
        self._cache.clear()

    def _entry(self, name: str, p: Tensor) -> tuple[int, QuantizedParam, Tensor]:
        hit = self._cache.get(name)
        if hit is not None and hit[0] == p._version and hit[2].device == p.device:
            return hit
        with torch.no_grad():
            # No NaN/Inf check here (a host sync per weight, every step): the trainer checks the
            # master weights once per publish (trainer.backends), a NaN forward shows in the loss.
            q = quantize_param(p, self._params[name].format, check_finite=False, **self._params[name].kwargs)
            dtype = self.cache_dtype if self.cache_dtype is not None and name in self._matmul else p.dtype
            if q.format == "bf16" and dtype == torch.bfloat16:
                w_hat = q.value.values.view(p.shape)  # the published part itself: no second copy
            else:
                w_hat = kernels.dequantize(q.value).view(p.shape).to(dtype)
            hit = self._cache[name] = (p._version, q, w_hat)
        return hit

    def effective(self, name: str, p: Tensor) -> Tensor:
        """fake_quant of parameter `name` (no autograd), computed once per optimizer step."""
        return self._entry(name, p)[2]

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

    def quantize_inputs(self, sites: Sequence[str], x: Tensor, counts: Sequence[int]) -> Tensor | None:
        return self.act_quant.quantize_rows([self._names(s)[1] for s in sites], x, counts)

    def linear(self, site: str, x: Tensor, weight: Tensor, x_hat: Tensor | None = None) -> Tensor:
        names = self._names(site)
        w_hat = self.effective(names[0], weight)
        if x_hat is None:
            x_hat = self.act_quant(names[1], x)
        if w_hat.dtype != x_hat.dtype and not torch.is_autocast_enabled(x.device.type):
            w_hat = w_hat.to(x_hat.dtype)  # a bf16 cache outside autocast: computes as before
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _QATLinear.apply(x, weight, x_hat, w_hat, self.backward == "hp")
        return F.linear(x_hat, w_hat)

    def param(self, name: str, p: Tensor) -> Tensor:
        p_hat = self.effective(name, p)
        if torch.is_grad_enabled() and p.requires_grad:
            return _StraightThrough.apply(p, p_hat)
        return p_hat


def apply_qat(
    model: Transformer,
    recipe: Recipe | Plan,
    backward: str = "hp",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    cache_dtype: torch.dtype | None = None,
) -> QATHook:
    """Install QAT on `model` (in place) and return the hook; `optimizer`'s steps refresh its cache.
    `cache_dtype`: see QATHook (bf16 halves the cache under bf16 autocast, bitwise the same forward)."""
    hook = QATHook(_as_plan(model, recipe), backward, cache_dtype)
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


def install_activation_quant(model: Transformer, recipe: Recipe | Plan) -> ActivationQuantizer:
    """Rollout side: per-token activation fake quant at the recipe's sites, weights used as loaded."""
    aq = ActivationQuantizer(_as_plan(model, recipe))
    model.set_activation_quant(aq)
    return aq


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
    packed  a copy of the model with weights loaded from quantize_weights(model, recipe) and the
            activation quantizer installed (what a rollout computes).
    Returns {"pairs": {"bf16~qat": {...}, "bf16~packed": {...}, "qat~packed": {...}},
             "weights_bitwise_equal": bool (QAT effective weights vs packed-loaded weights),
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
        effective = hook.effective_weights(model)

        w = model.lm_head.weight
        rollout = Transformer(model.cfg).to(device=w.device, dtype=w.dtype)
        load_packed(rollout, quantize_weights(model, hook.plan))
        install_activation_quant(rollout, hook.plan)
        lp_packed = logprobs(rollout)
        same = all(torch.equal(bits(effective[n]), bits(p)) for n, p in rollout.named_parameters())
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


def _ints(t: Tensor) -> Tensor:
    """Same-size integer view, so torch.equal compares bits (-0.0 vs 0.0, NaN payloads)."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bits(t: Tensor) -> Tensor:
    """The raw bytes of a tensor, for bitwise comparisons (torch.equal says -0.0 == 0.0)."""
    return t.detach().contiguous().view(torch.uint8)
