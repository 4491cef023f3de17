"""Which prompt groups the trainer fed and has not settled yet, as a small pure class (no Redis, no
clock, no I/O) over the State's `prompt_seq`, `outstanding` and `dropped_unaudited`.

1. `feed(n, min_version=m)` makes prompts prompt_seq .. prompt_seq + n - 1 (prompt i is
   `make_prompt(i)`, a pure function of i, with `min_version` m) and holds them outstanding:
   group_id -> prompt index.
2. `settle(group_id, dropped=...)`: the group was used or dropped; it is no longer outstanding, is
   remembered as settled (the newest `remember` groups), and, if dropped, listed in
   `dropped_unaudited` for the next audit line. A group is settled at most once.
3. `fed_prompt(group_id)`: the tokens fed under that id while it is outstanding, else None.
   `fed_as(group)`: whether `group` is the very prompt fed under its id (not a copy borrowing it).
4. `adopt(seq)`: prompts up to `seq` were fed by this trainer's previous process after its
   checkpoint: they are outstanding too.
5. `overflow(cap)`: the oldest outstanding groups beyond `cap` are settled as dropped (prompts lost
   on the way would otherwise stay outstanding forever).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .state import State


class PromptLedger:
    def __init__(self, state: State, make_prompt: Callable[[int], Any], *, remember: int = 100_000):
        self.state, self.make_prompt, self.remember = state, make_prompt, remember
        self._tokens: dict[str, Any] = {}  # group_id -> prompt tokens, of outstanding groups
        self._settled: dict[str, None] = {}  # recently settled group ids, oldest first

    def feed(self, n: int, *, min_version: int = 0) -> list:
        """Rule 1: the next `n` prompt groups, now outstanding, each with `min_version`."""
        first = self.state.prompt_seq
        groups = [self._prompt(i, min_version) for i in range(first, first + n)]
        self.state.outstanding.update((g.group_id, i) for i, g in zip(range(first, first + n), groups))
        self.state.prompt_seq = first + n
        return groups

    def outstanding_groups(self, *, min_version: int = 0) -> list:
        """Every outstanding group's prompt, in the order they were fed, each with `min_version`."""
        return [self._prompt(i, min_version) for i in sorted(self.state.outstanding.values())]

    def _prompt(self, index: int, min_version: int):
        return dataclasses.replace(self.make_prompt(index), min_version=min_version)

    def adopt(self, seq: int) -> None:
        """Rule 4."""
        for i in range(self.state.prompt_seq, seq):
            self.state.outstanding[self.make_prompt(i).group_id] = i
        self.state.prompt_seq = max(self.state.prompt_seq, seq)

    def settle(self, group_id: str, *, dropped: bool) -> None:
        """Rule 2."""
        if self.state.outstanding.pop(group_id, None) is not None and dropped:
            self.state.dropped_unaudited.append(group_id)
        self._tokens.pop(group_id, None)
        self._settled[group_id] = None
        while len(self._settled) > self.remember:
            del self._settled[next(iter(self._settled))]

    def settled_recently(self, group_id: str) -> bool:
        return group_id in self._settled

    def fed_prompt(self, group_id: str):
        """Rule 3."""
        if group_id not in self.state.outstanding:
            return None
        if group_id not in self._tokens:
            self._tokens[group_id] = self.make_prompt(self.state.outstanding[group_id]).prompt_tokens
        return self._tokens[group_id]

    def fed_as(self, group) -> bool:
        """Rule 3."""
        index = self.state.outstanding.get(group.group_id)
        return index is not None and prompt_key(group) == prompt_key(self.make_prompt(index))

    def overflow(self, cap: int) -> None:
        """Rule 5."""
        excess = len(self.state.outstanding) - cap
        if excess > 0:
            for gid, _ in sorted(self.state.outstanding.items(), key=lambda kv: kv[1])[:excess]:
                self.settle(gid, dropped=True)


def prompt_key(g) -> tuple:
    """What makes a prompt group the one fed (everything but when it was made: `created_at`, `min_version`)."""
    return g.group_id, g.prompt_id, g.n_samples, g.task, g.prompt_tokens.tobytes()
