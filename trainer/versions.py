"""Older policy versions for the mismatch split, kept as the packed tensors their publish produced.

    versions = RetainedVersions(model_config, plan, keep=max_staleness)
    versions.add(v, backend.quantized_params())    # at each publish: references, no copy
    versions.token_logprobs(v, tokens, targets, chunks=row_chunks, attention_mask=attn, temperature=T)
    per_token(token_versions, by_version, fallback) -> (log-probs, known)   each token under its own version

Rules:
- `add` holds references to the QuantizedParams the publish produced (the QAT cache's own objects,
  which the cache replaces after each optimizer step), on the trainer's device; parts that share
  storage with a live parameter are cloned. `add(v)` releases every version below v - keep.
- `token_logprobs(v, ...)` equals, bit for bit, the QAT forward (training recipe, the Compute
  contract's operands) of version v's master weights, chunk by chunk: a meta-device scratch model
  whose hook builds each operand when its matmul first runs (an MoE projection's experts together)
  and keeps only the current layer's; the chunks go through each layer before the next
  (`Transformer.token_logprobs_by_layer`), so each operand is built once per call, not per chunk.
- A sample spanning versions (loop.inflight_updates) is recomputed under each distinct version of
  its tokens, and each token takes the one of its own version (`per_token`, pure).
- Versions from before a restart are not held; their tokens are left out of the split.
- exact (loop.exact): the forward runs in exact mode (policy.exact), as the trainer's own.
Why packed versions and not fp32 snapshots, and the memory they take: docs/design-decisions.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from policy import formats, kernels, qat
from policy.formats.params import QuantizedParam
from policy.model import ModelConfig, MoE, Transformer
from policy.recipe import Plan

__all__ = ["RetainedVersions", "aliasing", "per_token"]


def aliasing(tensors: Mapping[str, QuantizedParam], live: Iterable[Tensor]) -> list[str]:
    """Names of the quantized params with a part sharing storage with a tensor of `live`."""
    storages = {p.untyped_storage().data_ptr() for p in live}
    return [
        n
        for n, q in tensors.items()
        if any(t.untyped_storage().data_ptr() in storages for t in q.value.parts().values())
    ]


def per_token(
    token_versions: Tensor, by_version: Mapping[int, tuple[Tensor, Tensor]], fallback: Tensor
) -> tuple[Tensor, Tensor]:
    """Each token's log-prob under the version that sampled it: out[b, t] = the log-probs of
    v = token_versions[b, t] at (b, t), where by_version[v] = (rows [R] long, log-probs [R, T]) holds
    the recompute under v of rows `rows`; a token whose version (or row) is not there keeps
    fallback[b, t] and is not known. -> (out [B, T], known [B, T] bool)."""
    out, known = fallback.clone(), torch.zeros(token_versions.shape, dtype=torch.bool, device=fallback.device)
    for v, (rows, logp) in by_version.items():
        pick = token_versions[rows] == v  # [R, T]
        out[rows] = torch.where(pick, logp.to(out.dtype), out[rows])
        known[rows] |= pick
    return out, known


class RetainedVersions:
    """Version -> {canonical name: policy.formats object} for the newest versions (see the module
    docstring); `keep` = how many versions older than the newest added one are held.

    Memory: per retained version, the bytes of its packed parts (`nbytes`); the newest version's
    objects are shared with the QAT cache until the next optimizer step. Transient, during
    `token_logprobs`: one layer's weight operands at a time (an MoE projection's experts' packed
    parts concatenated along rows and one `kernels.operand` call, `qat.stacked_operands`, whose
    [E, N, K] operand the grouped GEMM takes as is; 1.2 GB for a Qwen3-30B-A3B layer's 128 bf16
    experts), the fp32 dequantized embedding and norms, and every chunk's hidden states.
    Under the rollout_recipe ablation the trainer keeps the training recipe's objects, not the
    rollouts'. With trainer.backend=megatron the objects are its hook's canonical QuantizedParams
    and this still runs policy.model's forward."""

    def __init__(self, model_config: ModelConfig, plan: Plan, *, keep: int, exact: bool = False):
        if keep < 0:
            raise ValueError(f"keep={keep} must be >= 0")
        self.plan, self.keep, self.exact = plan, keep, exact
        self._packed: dict[int, dict[str, object]] = {}
        with torch.device("meta"):  # shapes and dtypes only: the hook supplies every value
            self.scratch = Transformer(model_config, seed=None)
        self._groups = [g for m in self.scratch.modules() if isinstance(m, MoE) for g in m.expert_groups()]
        self.last_builds = 0  # weight operand builds (kernels.operand calls) of the last token_logprobs

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
        self, version: int, tokens: Tensor, targets: Tensor, *, chunks: Sequence[Tensor] | None = None,
        attention_mask: Tensor | None = None, temperature: float = 1.0, routes: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        """[R, T] fp32 log-probs of `targets` under `version` for the rows of `chunks` (row-index
        tensors, each run as one forward's batch; R rows in all, in their order; every row in one
        chunk by default). The caller's autocast applies, as for the trainer's own forward; routes:
        replayed expert ids (policy.model.Transformer)."""
        if chunks is None:
            chunks = [torch.arange(tokens.shape[0], device=tokens.device)]
        hook = _PackedOperands(self.plan, self._packed[version], self._groups, exact=self.exact)
        self.scratch.quant_hook = hook
        try:
            return self.scratch.token_logprobs_by_layer(
                tokens, targets, chunks, attention_mask=attention_mask, temperature=temperature, routes=routes
            )
        finally:
            self.scratch.quant_hook = None
            hook.invalidate()  # its operands are freed now
            self.last_builds = hook.builds


class _PackedOperands(qat.QATHook):
    """policy.qat.PackedHook's forward (QATHook's code, the operands from a version's quantized
    objects), each operand built when its matmul first asks for it and kept until a weight of
    another layer is asked for (the embedding, final norm and LM head count as one more layer): the
    forward holds one layer's operands at a time. An MoE projection's experts' objects are
    concatenated into one stacked object and their operands built in one `kernels.operand` call
    (`qat.stacked_operands`, what the QAT cache's stacked refill does), which the grouped GEMM takes
    as is and the loop over experts row by row. So under a layer-by-layer forward every operand is
    built once per call, not once per chunk, per expert and again for the stack (6+ GB for the 4B
    model if all were held, as PackedHook does)."""

    def __init__(
        self,
        plan: Plan,
        packed: Mapping[str, object],
        groups: Iterable[tuple[list[str], list[Tensor]]],
        *,
        exact: bool = False,
    ):
        super().__init__(plan, exact=exact)
        self._packed = packed
        for names, params in groups:
            self.add_group(names, params)
        self.builds = 0  # kernels.operand calls for weights (one per weight, or one per expert group)
        self._layer = ""  # the layer whose operands the cache holds
        self._stacked: dict = {}  # group -> its [E, N, K] operand, for that layer

    def _entry(self, name: str, p: Tensor) -> tuple[int, object, formats.Operand]:
        hit = self._cache.get(name)
        if hit is not None:
            return hit
        layer = name.split(".")[2] if name.startswith("model.layers.") else "top"
        if layer != self._layer:  # the previous layer's operands: one layer at a time
            self.invalidate()
            self._layer = layer
        g = self._groups.get(name)
        if g is None:
            self.builds += 1
            q = self._packed[name]
            hit = self._cache[name] = (-1, q, kernels.operand(q))
            return hit
        qs = [self._packed[n] for n in g.names]
        self.builds += 1
        ops, stacked = qat.stacked_operands(_concatenated(qs), len(qs))
        self._cache.update((n, (-1, q, o)) for n, q, o in zip(g.names, qs, ops))
        self._stacked[g] = stacked
        return self._cache[name]

    def _group_operand(self, g) -> formats.Operand | None:
        self._entry(g.names[0], g.params[0])  # builds the group's operands from the version's objects
        return self._stacked.get(g)

    def invalidate(self, *_: object) -> None:
        super().invalidate()
        self._stacked.clear()


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
