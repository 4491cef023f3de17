"""Continuous batching: which sample runs in which KV slot, as a pure state machine (no tensors, no I/O).

    s = Scheduler(slots=S, max_inflight_groups=G, version=v)
    s.submit(key, n_samples); s.admit() -> [Admit]; s.finish(slot) -> Finish
    s.request_swap(); s.drained; s.swap(v')     drain-on-swap of the policy version
    s.swap(v', inflight=True)                    an in-flight swap (loop.inflight_updates)

Rules:
1. A slot holds one sample from admission to finish; free slots go lowest index first.
2. A group is in flight from `submit` until its last sample finishes (then emitted whole); at most G
   are (`can_submit`). A group may have more samples than there are slots.
3. `admit` is FIFO: waiting samples of started groups first, then new groups. A group starts at its
   first admission: its prompt is prefilled once, under the version current then (`group_version`).
4. A started group's prefix (prompt KV + last logits) is held for each sample still waiting
   (refs = samples not yet admitted); the admission taking the last reference frees it.
5. Drain-on-swap, never two versions in one group: `request_swap()` stops starting groups; `drained`
   when no started group is unfinished; only then `swap(v')`.
6. In-flight swap (`swap(v', inflight=True)`): at any time; started groups continue (their samples
   under v' from now on, the batcher records which tokens), groups start under v' from now on.
Capacity errors are ValueErrors naming the numbers."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["Admit", "Finish", "Scheduler"]


@dataclass(frozen=True)
class Admit:
    """Sample `sample` of group `group` runs in `slot` from now on. start: the group's first admission
    (prefill its prompt now); frees_prefix: this admission takes the prefix's last reference (drop it
    once this admission's slots are filled)."""

    group: Hashable
    sample: int
    slot: int
    start: bool
    frees_prefix: bool


@dataclass(frozen=True)
class Finish:
    """Sample `sample` of `group` finished in `slot` (now free); group_done: it was the group's last."""

    group: Hashable
    sample: int
    slot: int
    group_done: bool


@dataclass
class _Group:
    n: int
    waiting: list[int]  # sample indices not yet admitted, ascending
    finished: int = 0
    version: int | None = None  # set at the start
    started: bool = False


@dataclass
class Scheduler:
    """The state machine of the module docstring.

    Free slots go lowest index first so the busy slots stay packed at the bottom and the engine
    decodes the smallest batch bucket that holds them. Admission copies the prefix into the sample's
    own slot: both engines' caches are slotted (one contiguous row of KV per sample, what the fused
    decode-attention kernel reads; a paged cache could share the prefix blocks instead). After
    `request_swap()` samples of groups already started keep being admitted (their prefix was
    computed by this version); groups queued but not started start under the next version, so KV and
    prefix state never outlive the version that computed them. An in-flight swap (rule 6) keeps
    them: what the batcher records per token (rollout/batching.py). Modelled on trainer/admission.py
    (pure, tested alone: tests/unit/test_scheduler.py)."""

    slots: int
    max_inflight_groups: int
    version: int | None = None
    draining: bool = False
    _groups: dict = field(default_factory=dict)  # key -> _Group, in submission order
    _slot_user: list = field(default_factory=list)  # slot -> (key, sample) or None

    def __post_init__(self):
        if self.slots < 1 or self.max_inflight_groups < 1:
            raise ValueError(
                f"Scheduler: slots={self.slots}, max_inflight_groups={self.max_inflight_groups} (need >= 1 each)"
            )
        self._slot_user = [None] * self.slots

    # ------------------------------------------------------------------ queries

    def can_submit(self) -> bool:
        return len(self._groups) < self.max_inflight_groups

    @property
    def busy_slots(self) -> list[int]:
        return [s for s, u in enumerate(self._slot_user) if u is not None]

    @property
    def free_slots(self) -> int:
        return self._slot_user.count(None)

    def prefix_refs(self, key: Hashable) -> int:
        """References to the group's prefix: its samples still waiting for a slot (0 once freed or
        before the group starts)."""
        g = self._groups.get(key)
        return len(g.waiting) if g is not None and g.started else 0

    @property
    def held_prefixes(self) -> list:
        return [k for k, g in self._groups.items() if g.started and g.waiting]

    def group_version(self, key: Hashable) -> int | None:
        return self._groups[key].version

    @property
    def drained(self) -> bool:
        """No started group is unfinished: no busy slot, no held prefix."""
        return not any(g.started for g in self._groups.values())

    @property
    def idle(self) -> bool:
        return not self._groups

    # ------------------------------------------------------------------ transitions

    def submit(self, key: Hashable, n_samples: int) -> None:
        if key in self._groups:
            raise ValueError(f"group {key!r} is already in flight")
        if n_samples < 1:
            raise ValueError(f"group {key!r}: n_samples={n_samples} must be >= 1")
        if not self.can_submit():
            raise ValueError(
                f"group {key!r} refused: {len(self._groups)} groups in flight = max_inflight_groups="
                f"{self.max_inflight_groups}"
            )
        self._groups[key] = _Group(n=n_samples, waiting=list(range(n_samples)))

    def admit(self) -> list[Admit]:
        """Fill free slots (rules 1, 3, 4, 5); [] while no version is set."""
        if self.version is None:
            return []
        free = [s for s, u in enumerate(self._slot_user) if u is None]
        out: list[Admit] = []
        order = [k for k, g in self._groups.items() if g.started] + [
            k for k, g in self._groups.items() if not g.started
        ]
        for key in order:
            g = self._groups[key]
            if not free:
                break
            if not g.waiting or (not g.started and self.draining):
                continue
            start = not g.started
            if start:
                g.started, g.version = True, self.version
            while g.waiting and free:
                sample, slot = g.waiting.pop(0), free.pop(0)
                self._slot_user[slot] = (key, sample)
                out.append(Admit(key, sample, slot, start=start, frees_prefix=not g.waiting))
                start = False
        return out

    def finish(self, slot: int) -> Finish:
        if not 0 <= slot < self.slots or self._slot_user[slot] is None:
            raise ValueError(f"finish: slot {slot} is not busy (slots={self.slots})")
        key, sample = self._slot_user[slot]
        self._slot_user[slot] = None
        g = self._groups[key]
        g.finished += 1
        done = g.finished == g.n
        if done:
            del self._groups[key]
        return Finish(key, sample, slot, group_done=done)

    def request_swap(self) -> None:
        """Stop starting groups until `swap` (rule 5)."""
        self.draining = True

    def cancel_swap(self) -> None:
        """Resume starting groups under the current version (the new one could not be loaded)."""
        self.draining = False

    def swap(self, version: int, *, inflight: bool = False) -> None:
        """Install `version` and resume admission: only when drained (rule 5), or at once (rule 6)."""
        if not inflight and not self.drained:
            busy = self.busy_slots
            raise ValueError(
                f"swap to v{version} refused: {len(busy)} slot(s) busy and {len(self.held_prefixes)} prefix(es) "
                f"held under v{self.version}; drain first"
            )
        self.version, self.draining = version, False
