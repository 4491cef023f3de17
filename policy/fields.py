"""Type and range checks of config and message fields, written once for every package.

Python's bool is an int (True == 1), so a value that must be a number is never a bool here. Each
caller keeps its own message (naming the field, its value and what it wants) and asks only these
predicates whether a value fits:

- `is_int(v, lo, hi)`: an int, not a bool, with lo <= v <= hi (either bound may be None).
- `is_number(v, lo, hi)`: an int or a float, not a bool, within the same bounds (NaN fails every
  bound; without bounds it is a float like any other).
"""

from __future__ import annotations


def is_int(value, lo: int | None = None, hi: int | None = None) -> bool:
    """An int (never a bool) in [lo, hi]; a bound of None is no bound."""
    return isinstance(value, int) and not isinstance(value, bool) and _within(value, lo, hi)


def is_number(value, lo: float | None = None, hi: float | None = None) -> bool:
    """An int or a float (never a bool) in [lo, hi]; a bound of None is no bound."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and _within(value, lo, hi)


def _within(value, lo, hi) -> bool:
    return (lo is None or lo <= value) and (hi is None or value <= hi)
