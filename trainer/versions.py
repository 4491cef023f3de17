"""Older policy versions for the mismatch split, kept as the packed tensors their publish produced.

The trainer's `at_version` log-probs (DESIGN.md "Training": the quantization part of the mismatch)
evaluate each sample under its own version v. Version v's effective operands are a function of
its quantized objects alone (DESIGN.md "Compute contract": `policy.formats.operand(q)` for every
matmul, `dequantize(q)` for embeddings and norms), so the trainer keeps those objects, not v's fp32
master weights:

    versions = RetainedVersions(model_config, plan, keep=max_staleness)
    versions.add(v, backend.quantized_params())    # at each publish: references, no copy
    versions.token_logprobs(v, tokens, targets, attention_mask=attn, temperature=T)

`add` holds references to the QuantizedParams the publish already produced (the QAT cache's own
objects: the cache replaces them with new tensors after each optimizer step rather than writing
them in place), on the trainer's device. Nothing is copied to the host and nothing is quantized
again. Parts that share storage with a live parameter (none with fp32 master weights: every format
makes new tensors from them) are cloned so that the optimizer cannot change them.

`token_logprobs` runs `policy.model.Transformer`'s forward on a scratch model whose parameters are
on the meta device (no memory: every read of a parameter goes through the hook) with a
hook that is `policy.qat.PackedHook` over v's objects (QATHook's forward with v's operands), except
that each operand is built when its matmul runs and dropped after it, and that an MoE projection's
experts are built together, as the QAT cache's stacked refill builds them: their packed parts
concatenated along rows (a copy of the packed bytes, 0.2 GB for a gate_up_proj here) and one
`formats.operand` call for all (`qat.stacked_operands`), whose [E, N, K] operand the grouped GEMM
takes as is (no per-expert operands stacked per call; each operand is built once per call). The
result equals, bit for bit, the QAT forward (`policy.qat.apply_qat`, the training recipe) of v's
master weights on the same rows and device, on the MoE's loop over experts and on its grouped GEMM
alike (tests/unit/test_versions.py). Transient memory, during the call: one weight's operand at a
time, or one MoE projection's experts' (0.8 GB of bf16 operand values here, plus the fp32
intermediates of nvfp4's operand_values over all experts at once, ~3 GB at its peak, as the QAT
cache's refill has), plus the fp32 dequantized embedding and norms (as the QAT forward holds them).

Memory: per retained version, the bytes of its packed parts (`nbytes`): 4.38 GB for the 6-layer
Qwen3-30B-A3B of configs/gpu-h200.yaml under nvfp4_moe, against 17.4 GB of fp32 master weights.
The newest version's objects are shared with the QAT cache until the next optimizer step. `add(v)`
releases every version below v - keep, so at most `keep` versions older than the newest are held.

What `at_version` means, precisely: the log-probs of the QAT forward (training recipe, the Compute
contract's operands) of version v as published, from the quantized objects of v's publish. Under
the rollout_recipe ablation the trainer keeps the training recipe's objects (its QAT forward's),
not the rollouts' (trainer.service). Versions from before a restart are not held (nothing of this
is checkpointed): their samples are left out of the split (`known`), as before.
With trainer.backend=megatron the objects are its hook's canonical QuantizedParams (the same bytes
as the torch backend's for the same weights) and at_version still runs policy.model's forward, as
the fp32 scratch model did before; prox runs megatron's, so their accumulation-order difference
lands in the staleness part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from policy import formats, qat
from policy.formats.params import QuantizedParam
from policy.model import ModelConfig, MoE, Transformer
from policy.recipe import Plan

__all__ = ["RetainedVersions", "aliasing"]


def aliasing(tensors: Mapping[str, QuantizedParam], live: Iterable[Tensor]) -> list[str]:
    """Names of the quantized params with a part sharing storage with a tensor of `live`."""
    storages = {p.untyped_storage().data_ptr() for p in live}
    return [
        n
        for n, q in tensors.items()
        if any(t.untyped_storage().data_ptr() in storages for t in q.value.parts().values())
    ]


class RetainedVersions:
    """Version -> {canonical name: policy.formats object} for the newest versions (see the module
    docstring); `keep` = how many versions older than the newest added one are held."""

    def __init__(self, model_config: ModelConfig, plan: Plan, *, keep: int):
        if keep < 0:
            raise ValueError(f"keep={keep} must be >= 0")
        self.plan, self.keep = plan, keep
        self._packed: dict[int, dict[str, object]] = {}
        with torch.device("meta"):  # shapes and dtypes only: the hook supplies every value
            self.scratch = Transformer(model_config, seed=None)
        self._groups = [g for m in self.scratch.modules() if isinstance(m, MoE) for g in m.expert_groups()]
        self.last_builds = 0  # weight operand builds (formats.operand calls) of the last token_logprobs

    def __contains__(self, version: int) -> bool:
        return version in self._packed

    def versions(self) -> list[int]:
        return sorted(self._packed)

    def add(self, version: int, tensors: Mapping[str, QuantizedParam], *, live: Iterable[Tensor] = ()) -> None:
        """Hold `version`'s quantized objects (references; parts aliasing a tensor of `live`, the
        model's parameters, are cloned) and release the versions below version - keep."""
        missing = sorted({e.name for e in self.plan.params} - set(tensors))
        if missing:
            raise ValueError(f"version {version}: no quantized tensor for {missing[:3]} (of {len(missing)})")
        shared = set(aliasing(tensors, live))
        self._packed[version] = {n: _cloned(q.value) if n in shared else q.value for n, q in tensors.items()}
        for v in [v for v in self._packed if v < version - self.keep]:
            del self._packed[v]

    def nbytes(self, version: int | None = None) -> int:
        """Bytes of `version`'s packed parts (what holding it costs); of every held version by default."""
        held = self._packed.values() if version is None else [self._packed[version]]
        return sum(t.numel() * t.element_size() for p in held for q in p.values() for t in q.parts().values())

    @torch.no_grad()
    def token_logprobs(
        self, version: int, tokens: Tensor, targets: Tensor, *, attention_mask: Tensor | None = None,
        temperature: float = 1.0,
    ) -> Tensor:  # fmt: skip
        """[B, T] fp32 log-probs of `targets` under `version` (the caller's autocast applies, as
        for the trainer's own forward)."""
        hook = self.scratch.quant_hook = _PackedOperands(self.plan, self._packed[version], self._groups)
        try:
            return self.scratch.token_logprobs(tokens, targets, attention_mask=attention_mask, temperature=temperature)
        finally:
            self.scratch.quant_hook = None
            hook.invalidate()  # its operands are freed now
            self.last_builds = hook.builds


class _PackedOperands(qat.QATHook):
    """policy.qat.PackedHook's forward (QATHook's code, the operands from a version's quantized
    objects), each operand built when its matmul asks for it and dropped after: the forward holds one
    weight's operand at a time, or one MoE projection's: its experts' objects are concatenated into
    one stacked object and their operands built in one `formats.operand` call
    (`qat.stacked_operands`, what the QAT cache's stacked refill does), which the grouped GEMM takes
    as is and the loop over experts row by row. So every operand is built once per call, not once
    per expert and again for the stack (6+ GB for the 4B model if all were held, as PackedHook does)."""

    def __init__(self, plan: Plan, packed: Mapping[str, object], groups: Iterable[tuple[list[str], list[Tensor]]]):
        super().__init__(plan)
        self._packed = packed
        for names, params in groups:
            self.add_group(names, params)
        self.builds = 0  # formats.operand calls for weights (one per weight, or one per expert group)

    def _entry(self, name: str, p: Tensor) -> tuple[int, object, formats.Operand]:
        hit = self._cache.get(name)
        if hit is not None:
            return hit
        self._cache.clear()  # the previous weight's or group's operands: one at a time
        g = self._groups.get(name)
        if g is None:
            self.builds += 1
            q = self._packed[name]
            hit = self._cache[name] = (-1, q, formats.operand(q))
            return hit
        qs = [self._packed[n] for n in g.names]
        self.builds += 1
        ops, stacked = qat.stacked_operands(_concatenated(qs), len(qs))
        entries = tuple((-1, q, o) for q, o in zip(qs, ops))
        self._cache.update(zip(g.names, entries))
        g.stacked = (entries, stacked)
        return self._cache[name]


def _concatenated(qs: list) -> object:
    """One policy.formats object over the rows of `qs` (same format and shape): every tensor part
    concatenated along rows, as `policy.kernels.quantize_stacked`'s flat object (a global_scale
    [len(qs)] for nvfp4's tensor scope)."""
    first = qs[0]
    m, k = first.shape
    parts = {
        f.name: torch.cat([getattr(q, f.name) for q in qs])
        for f in dataclasses.fields(first)
        if isinstance(getattr(first, f.name), Tensor)
    }
    return dataclasses.replace(first, shape=(len(qs) * m, k), **parts)


def _cloned(value):
    """A policy.formats object (a frozen dataclass) with every tensor field cloned."""
    tensors = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return dataclasses.replace(value, **{k: t.clone() for k, t in tensors.items() if isinstance(t, Tensor)})
