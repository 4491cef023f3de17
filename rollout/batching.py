"""Continuous batching across prompt groups: `rollout.scheduler` driving an engine's KV slots.

    b = ContinuousBatcher(backend, max_inflight_groups=G, version=v)
    b.submit(key, prompt, seeds, max_new_tokens=N)     while b.can_submit() (N: one, or one per sample)
    for g in b.step(): ...                             GroupResult: a finished group, all n samples
    b.request_swap(); ... b.step() until b.drained; b.swap(v')   a new policy version (drain-on-swap)
    b.swap(v', inflight=True)                          between two steps, rows live (loop.inflight_updates)

One `step`: admit what the scheduler lets in (each new group's prompt prefilled once, copied into its
samples' slots), advance every live row (one decode step of the model, `check_every` graph replays of
the packed engine), free finished rows, emit finished groups. A row's samples depend only on its
prompt, seed and own token index, never on who shares the batch. Backends: `ModelBackend` (rollout/engine.py) and
`PackedBackend` (rollout/packed_engine.py). Versions per token: the one whose weights computed the
token's logits; after an in-flight swap live rows keep their KV (`tokens_on_stale_kv`). Routing
replay: each sample's `routes` [n, n MoE layers, k] uint8 (uint16 past 256 experts), else None."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from policy.formats import NonFinite
from policy.model import KVCache, Transformer
from rollout.engine import decode_one_token, prefill, sample
from rollout.scheduler import Scheduler

__all__ = [
    "ContinuousBatcher",
    "ModelBackend",
    "GroupResult",
    "PackedBackend",
    "route_dtype",
    "stale_kv_tokens",
    "token_versions",
]


@dataclass
class GroupResult:
    """A finished group: sample i produced tokens[i] (the stop token included) with behavior
    log-probs logprobs[i]; versions[i][t] sampled tokens[i][t]; `version` started the group (all
    tokens' version under drain-on-swap); routes[i]: sample i's expert ids [n, layers, k] (routing
    replay) or None."""

    key: Hashable
    version: int
    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]
    versions: list[list[int]]
    routes: list = field(default_factory=list)


def route_dtype(n_experts: int):
    """The compact dtype of expert ids: uint8 for <= 256 experts, else uint16 (the codec's two)."""
    return np.uint8 if n_experts <= 256 else np.uint16


def token_versions(segments: Sequence[tuple[int, int]], n: int) -> list[int]:
    """The version of each of n tokens from (first token index, version) segments in the order
    they were recorded (non-decreasing starts; a later segment at the same start wins)."""
    out, k = [], 0
    for t in range(n):
        while k + 1 < len(segments) and segments[k + 1][0] <= t:
            k += 1
        out.append(segments[k][1])
    return out


def stale_kv_tokens(versions: Sequence[int]) -> int:
    """Tokens sampled on KV an older version computed (the KV is kept across an in-flight swap): those
    of a newer version than the sample's first token, whose version computed the prompt's KV."""
    return sum(v > versions[0] for v in versions) if len(versions) else 0


@dataclass
class _Pending:
    prompt: list[int]
    seeds: list[int]
    max_new: list
    tokens: list
    logprobs: list
    stopped: list
    versions: list
    routes: list
    version: int | None = None  # set when the group starts


class ContinuousBatcher:
    """Prompt groups through one backend; see the module docstring. What a backend provides:

    slots                          KV slots (rows decoded at once)
    check(prompt_len, max_new)     ValueError if such a request can never fit a slot
    prefill(prompts) -> prefixes   each prompt through the model once (its KV + last logits)
    admit(prefix, slots, seeds, max_new)   copy the prefix into those slots, start those rows (max_new:
                                   one budget per row)
    advance() -> [slot]            run live rows; the busy slots whose row has finished
    result(slot) -> (tokens, logprobs, stopped, routes [n, layers, k] array or None)
    release(slot)                  the slot is free (its row's state is dropped)
    live                           busy slots (0 when drained)
    fresh_from(slots) -> [int]     per busy slot, the index of its first token whose logits weights
                                   installed now compute (an in-flight swap)
    """

    def __init__(self, backend, *, max_inflight_groups: int, version: int):
        self.backend = backend
        self.sched = Scheduler(slots=backend.slots, max_inflight_groups=max_inflight_groups, version=version)
        self._groups: dict = {}
        self.prefixes: dict = {}  # key -> the backend's prefix, while the scheduler counts readers of it
        self._segments: dict = {}  # busy slot -> [(first token index, version)] of its row

    @property
    def version(self) -> int | None:
        return self.sched.version

    def can_submit(self) -> bool:
        return self.sched.can_submit()

    @property
    def idle(self) -> bool:
        return self.sched.idle

    @property
    def drained(self) -> bool:
        return self.sched.drained

    @property
    def draining(self) -> bool:
        """A swap was requested: no group starts until `swap` or `cancel_swap`."""
        return self.sched.draining

    def submit(
        self, key: Hashable, prompt: Sequence[int], seeds: Sequence[int], *, max_new_tokens: int | Sequence[int]
    ) -> None:
        """Queue a group of len(seeds) samples of `prompt`, each stopping after max_new_tokens (one
        number, or one per sample) unless a stop token comes first; ValueError if it can never fit,
        or if max_inflight_groups are already in flight."""
        n = len(seeds)
        budget = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if len(prompt) == 0 or len(budget) != n or min(budget, default=1) < 1:
            raise ValueError(
                f"group {key!r}: prompt of {len(prompt)} tokens, max_new_tokens={max_new_tokens} for {n} samples "
                "(need a prompt, and >= 1 per sample)"
            )
        self.backend.check(len(prompt), max(budget, default=1))
        self.sched.submit(key, n)
        self._groups[key] = _Pending(list(prompt), list(seeds), budget, *([None] * n for _ in range(5)))

    def step(self) -> list[GroupResult]:
        admits = self.sched.admit()
        starting = [a.group for a in admits if a.start]
        for key in starting:
            self._groups[key].version = self.sched.version
        if starting:
            for key, prefix in zip(starting, self.backend.prefill([self._groups[k].prompt for k in starting])):
                self.prefixes[key] = prefix
        i = 0
        while i < len(admits):  # one backend call per group: its admits are consecutive
            key = admits[i].group
            j = i
            while j < len(admits) and admits[j].group == key:
                j += 1
            g = self._groups[key]
            batch = admits[i:j]
            for a in batch:  # the first token from the prefix (the group's version), the rest decoded now
                self._segments[a.slot] = [(0, g.version), (1, self.sched.version)]
            self.backend.admit(
                self.prefixes[key],
                [a.slot for a in batch],
                [g.seeds[a.sample] for a in batch],
                [g.max_new[a.sample] for a in batch],
            )
            if batch[-1].frees_prefix:
                del self.prefixes[key]  # its last reader has its own copy: free it
            i = j
        done = []
        if self.backend.live:
            for slot in self.backend.advance():
                tokens, logprobs, stopped, routes = self.backend.result(slot)
                self.backend.release(slot)
                f = self.sched.finish(slot)
                g = self._groups[f.group]
                g.tokens[f.sample], g.logprobs[f.sample], g.stopped[f.sample] = tokens, logprobs, stopped
                g.routes[f.sample] = routes
                g.versions[f.sample] = token_versions(self._segments.pop(slot), len(tokens))
                if f.group_done:
                    del self._groups[f.group]
                    done.append(GroupResult(f.group, g.version, g.tokens, g.logprobs, g.stopped, g.versions, g.routes))
        return done

    def run(self) -> list[GroupResult]:
        """Step until every submitted group is emitted."""
        out = []
        while not self.sched.idle:
            out += self.step()
        return out

    def request_swap(self) -> None:
        self.sched.request_swap()

    def cancel_swap(self) -> None:
        self.sched.cancel_swap()

    def swap(self, version: int, backend=None, *, inflight: bool = False) -> None:
        """Install a new version (and the backend that serves it, for engines built per version)
        once drained; ValueError before. inflight: now, the rows live continuing on the same backend
        (whose weights the caller has updated in place), their later tokens under `version`."""
        if inflight and self.backend is not None and self.backend.live:
            if backend is not None and backend is not self.backend:
                raise ValueError("in-flight swap: live rows continue on their backend's KV; no new backend")
            slots = sorted(self._segments)
            for slot, start in zip(slots, self.backend.fresh_from(slots)):
                self._segments[slot].append((start, version))
            self.sched.swap(version, inflight=True)
            return
        self.sched.swap(version, inflight=inflight)
        drained = not self.prefixes and (self.backend is None or self.backend.live == 0)
        assert inflight or drained, "state survives a drain"
        if backend is not None:
            if backend.slots != self.sched.slots:
                raise ValueError(f"swap: the new backend has {backend.slots} slots, not {self.sched.slots}")
            self.backend = backend


# --------------------------------------------------------------------------------------------------
# The model's engine (rollout/engine.py) as a backend: the CPU path, and exact mode on CUDA


@dataclass
class _ModelPrefix:
    k: list  # per layer [Hkv, T, hd]
    v: list
    logits: Tensor  # [V] fp32
    routes: Tensor | None = None  # [n MoE layers, k]: the last prompt position's expert ids


class ModelBackend:
    """Continuous batching on `policy.model.Transformer` through rollout/engine.py, on the model's
    device (the CPU path, and exact mode on CUDA): the live rows share one lockstep `KVCache` (rows
    advance together; each row's keys are the valid columns of its row, its RoPE positions its own
    count). Whenever rows join (admission) or leave (finish), the cache is rebuilt with exactly the
    live rows, each row's valid keys moved to the left in order (attention reads the same keys at the
    same positions, so results are unchanged up to float reduction order; in exact mode bit for bit),
    and capacity for the longest remaining continuation: dead rows are never decoded. Each row samples
    from its own `torch.Generator(seed)` on the host (rollout/engine.py's Gumbel-max), so its draws do
    not depend on when it joined or on the device. record_routes: each row records its tokens' expert
    ids (routing replay)."""

    def __init__(
        self, model: Transformer, *, slots: int, temperature: float, stop: set, pad_id: int, record_routes: bool = False
    ):
        self.model, self.slots, self.temperature, self.pad_id = model, slots, float(temperature), pad_id
        self.device = model.lm_head.weight.device
        self.record_routes = record_routes and bool(model.moe_layers())  # a dense model has none to record
        self.routes: Tensor | None = None  # [R, n MoE layers, k]: the expert ids behind each row's logits
        self.stop = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        self.rows: list[int] = []  # slot of each cache row
        self.cache: KVCache | None = None
        self.logits: Tensor | None = None  # [R, V]: the next-token logits of each row (to sample)
        self.gens: list = []
        self.remaining: list[int] = []  # tokens each row may still produce
        self.out: dict = {}  # slot -> [tokens, logprobs, stopped, routes (one [layers, k] per token)]

    @property
    def live(self) -> int:
        return len(self.out)

    def check(self, prompt_len: int, max_new: int) -> None:
        cap = self.model.cfg.max_seq_len
        if prompt_len + max_new > cap:
            raise ValueError(f"prompt {prompt_len} + max_new_tokens {max_new} > max_seq_len {cap}")

    @torch.no_grad()
    def prefill(self, prompts: list) -> list[_ModelPrefix]:
        cfg = self.model.cfg
        L = max(len(p) for p in prompts)
        tokens = torch.full((len(prompts), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.bool)
        for b, p in enumerate(prompts):  # left padding, as rollout.engine.generate
            tokens[b, L - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            mask[b, L - len(p) :] = True
        cache = KVCache(cfg, len(prompts), L, dtype=self.model.lm_head.weight.dtype, device=self.device)
        logits, ids = prefill(
            self.model, tokens.to(self.device), mask.to(self.device), cache, routes=True
        )  # ids: [B, layers, k], cheap
        return [
            _ModelPrefix(
                [k[b, :, L - len(p) :].clone() for k, _ in cache.layers],
                [v[b, :, L - len(p) :].clone() for _, v in cache.layers],
                logits[b].clone(),
                ids[b].clone() if self.record_routes else None,
            )
            for b, p in enumerate(prompts)
        ]

    def admit(self, prefix: _ModelPrefix, slots: list[int], seeds: list[int], max_new: list[int]) -> None:
        n = len(slots)
        for s in slots:
            self.out[s] = [[], [], False, []]
        self._rebuild(list(range(len(self.rows))), (prefix, n, max(max_new)))
        self.rows += slots
        self.gens += [torch.Generator().manual_seed(int(s)) for s in seeds] if self.temperature > 0 else [None] * n
        self.remaining += list(max_new)
        add = prefix.logits[None].expand(n, -1)
        self.logits = add.clone() if self.logits is None else torch.cat([self.logits, add])
        if self.record_routes:
            ids = prefix.routes[None].expand(n, -1, -1)
            self.routes = ids.clone() if self.routes is None else torch.cat([self.routes, ids])

    @torch.no_grad()
    def advance(self) -> list[int]:
        """Sample one token per live row, finish rows on a stop id or their last token, decode the rest."""
        if not self.rows:
            return []
        if not bool(torch.isfinite(self.logits).all()):
            raise NonFinite("model engine: non-finite logits (NaN/Inf) in this batch")
        done = []
        gens = self.gens if self.temperature > 0 else None
        nxt, lp = sample(self.logits, self.temperature, gens, exact=self.model.exact)
        hit = torch.isin(nxt, self.stop).tolist()
        tokens, logprobs = nxt.tolist(), lp.tolist()  # one copy to the host per step
        keep = []
        for r, slot in enumerate(self.rows):
            o = self.out[slot]
            o[0].append(tokens[r])
            o[1].append(logprobs[r])
            if self.record_routes:
                o[3].append(self.routes[r])
            self.remaining[r] -= 1
            if hit[r] or self.remaining[r] == 0:
                o[2] = hit[r]
                done.append(slot)
            else:
                keep.append(r)
        if len(keep) < len(self.rows):
            self._rebuild(keep)
            self.rows = [self.rows[r] for r in keep]
            self.gens = [self.gens[r] for r in keep]
            self.remaining = [self.remaining[r] for r in keep]
            nxt = nxt[torch.tensor(keep, dtype=torch.long, device=self.device)]
        if self.rows:
            if self.cache.length + 1 > self.cache.capacity:
                self._rebuild(list(range(len(self.rows))))
            alive = torch.ones(len(self.rows), dtype=torch.bool, device=self.device)
            if self.record_routes:
                self.logits, self.routes = decode_one_token(self.model, nxt, alive, self.cache, routes=True)
            else:
                self.logits = decode_one_token(self.model, nxt, alive, self.cache)
        else:
            self.cache, self.logits, self.routes = None, None, None
        return done

    def result(self, slot: int):
        tokens, logprobs, stopped, ids = self.out[slot]
        routes = None
        if self.record_routes:
            routes = torch.stack(ids).cpu().numpy().astype(route_dtype(self.model.cfg.n_experts))
        return tokens, logprobs, stopped, routes

    def fresh_from(self, slots: list[int]) -> list[int]:
        """`advance` decodes right after sampling: each live row's next logits are already computed,
        so the weights installed now compute those of the token after the next."""
        return [len(self.out[s][0]) + 1 for s in slots]

    def release(self, slot: int) -> None:
        del self.out[slot]

    def _rebuild(self, keep: list[int], add: tuple | None = None) -> None:
        """The cache with rows `keep` of the current one (their valid keys left-justified, in order)
        plus, if `add` = (prefix, n, max_new), n new rows holding the prefix; capacity for the
        longest remaining continuation."""
        cfg, old = self.model.cfg, self.cache
        blocks = []  # (k per layer, v per layer, valid counts, next positions) of each row block
        longest = max([self.remaining[r] for r in keep], default=1)
        if old is not None and keep:
            kidx = torch.tensor(keep, dtype=torch.long, device=self.device)
            valid = old.key_valid[kidx, : old.length]
            count = valid.sum(dim=1)
            order = (~valid).to(torch.int8).argsort(dim=1, stable=True)[:, : int(count.max())]  # valid first
            ks, vs = [], []
            for k, v in old.layers:
                idx = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
                ks.append(k[kidx, :, : old.length].gather(2, idx))
                vs.append(v[kidx, :, : old.length].gather(2, idx))
            blocks.append((ks, vs, count, old.next_pos[kidx]))
        if add is not None:
            prefix, n, max_new = add
            T = prefix.k[0].shape[1]
            full = torch.full((n,), T, dtype=torch.long, device=self.device)
            blocks.append(
                (
                    [k[None].expand(n, -1, -1, -1) for k in prefix.k],
                    [v[None].expand(n, -1, -1, -1) for v in prefix.v],
                    full,
                    full,
                )
            )
            longest = max(longest, max_new)
        if not blocks:
            self.cache = None
            return
        count = torch.cat([b[2] for b in blocks])
        width = int(count.max())
        dtype = blocks[0][0][0].dtype
        cache = KVCache(cfg, len(count), min(cfg.max_seq_len, width + longest), dtype=dtype, device=self.device)
        r0 = 0
        for ks, vs, c, _ in blocks:
            w, r1 = ks[0].shape[2], r0 + len(c)
            for i, (k, v) in enumerate(cache.layers):
                k[r0:r1, :, :w] = ks[i]
                v[r0:r1, :, :w] = vs[i]
            r0 = r1
        cache.key_valid[:, :width] = torch.arange(width, device=self.device)[None, :] < count[:, None]
        cache.next_pos = torch.cat([b[3] for b in blocks])
        cache.length = width
        self.cache = cache


# --------------------------------------------------------------------------------------------------
# The packed GPU engine (rollout/packed_engine.py) as a backend


class PackedBackend:
    """Continuous batching on a `PackedEngine`: its max_batch KV slots; each `advance` replays the
    captured decode graph of the smallest bucket holding every busy slot `check_every` times (free
    slots in it are dead padding), then reads which rows are still alive in one host sync (a finished
    row waits check_every / 2 steps on average for its slot to be reused; 8 keeps that and the host
    turnaround per chunk each near 2% of a 136-token sample at batch 64). A prefix
    is copied into each sample's slot at admission (the fused decode-attention kernel reads one
    contiguous KV row per slot; sharing would need a paged cache with a block table). The engine's
    `EngineConfig.record_routes` says whether rows record their expert ids (routing replay)."""

    def __init__(self, engine, *, temperature: float, stop: set, pad_id: int, check_every: int = 8):
        engine.begin(temperature=temperature, stop=stop, pad_id=pad_id)
        self.engine, self.slots = engine, engine.ecfg.max_batch
        self.every = check_every
        self.busy: set = set()
        self.done: dict = {}  # slot -> (tokens, logprobs, stopped) of finished rows, read back once

    @property
    def live(self) -> int:
        return len(self.busy)

    def check(self, prompt_len: int, max_new: int) -> None:
        self.engine.check_fits(prompt_len, max_new)

    def prefill(self, prompts: list) -> list:
        return self.engine.prefixes(prompts)

    def admit(self, prefix, slots: list[int], seeds: list[int], max_new: list[int]) -> None:
        self.engine.admit(prefix, slots, seeds, max_new)
        self.busy.update(slots)

    @torch.no_grad()
    def advance(self) -> list[int]:
        eng = self.engine
        n = eng.bucket(max(self.busy) + 1)
        eng.decode(n, self.every, check_every=self.every)
        flags = torch.cat([eng.alive[:n].to(torch.int32), eng._finite_bad]).tolist()  # one sync
        if flags[-1]:
            raise NonFinite("PackedEngine: non-finite activations or logits (NaN/Inf) in this batch")
        fin = sorted(s for s in self.busy if not flags[s])
        if fin:
            rows = torch.tensor(fin, device=eng.device)
            lengths = eng.lengths[rows].tolist()
            N = max(lengths)
            tok = eng.out_tok[rows, :N].tolist()
            lp = eng.out_logp[rows, :N].tolist()
            stopped = eng.stopped[rows].tolist()
            routes = None if eng.out_routes is None else eng.out_routes[rows, :N].cpu().numpy()
            dtype = route_dtype(eng.cfg.n_experts)
            for i, s in enumerate(fin):
                r = None if routes is None else routes[i, : lengths[i]].astype(dtype)
                self.done[s] = (tok[i][: lengths[i]], lp[i][: lengths[i]], bool(stopped[i]), r)
        return fin

    def result(self, slot: int):
        return self.done.pop(slot)

    def fresh_from(self, slots: list[int]) -> list[int]:
        """A decode step runs the forward, then samples: a row's next token (index = its count so far,
        read in one host sync) comes from the weights installed now."""
        if not slots:
            return []
        return self.engine.lengths[torch.tensor(slots, device=self.engine.device)].tolist()

    def release(self, slot: int) -> None:
        self.busy.discard(slot)
