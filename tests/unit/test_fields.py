"""policy.fields: the one definition of "an int" and "a number" that every config checks with."""

from __future__ import annotations

import math

import pytest

from policy.fields import is_int, is_number


@pytest.mark.parametrize(
    "value,lo,hi,want",
    [
        (3, None, None, True),
        (0, 0, None, True),
        (-1, 0, None, False),
        (16, 1, 16, True),
        (17, 1, 16, False),
        (True, None, None, False),  # a bool is an int in Python, never here
        (False, 0, 1, False),
        (3.0, None, None, False),
        ("3", None, None, False),
        (None, None, None, False),
    ],
)
def test_is_int(value, lo, hi, want):
    assert is_int(value, lo, hi) is want


@pytest.mark.parametrize(
    "value,lo,hi,want",
    [
        (0.5, 0, 1, True),
        (1, 0, 1, True),
        (1.5, 0, 1, False),
        (-0.0, 0, None, True),
        (True, None, None, False),
        ("0.5", None, None, False),
        (math.nan, None, None, True),  # a float, like any other without bounds
        (math.nan, 0, None, False),  # but it fails every bound
        (math.inf, 0, None, True),
        (math.inf, None, 1e9, False),
    ],
)
def test_is_number(value, lo, hi, want):
    assert is_number(value, lo, hi) is want
