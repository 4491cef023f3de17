"""Host memory that gets page-locked for the GPU (broker.frames): it lies in pages of its own, so that
CUDA, which pins whole pages, never pins a neighbour's bytes; an array that does not start on a page
is refused before any CUDA call (the refusal is checked here, without a GPU)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from broker import frames


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 << 20])
def test_page_aligned_empty_starts_on_a_page_and_holds_nbytes(nbytes):
    arr = frames.page_aligned_empty(nbytes)
    assert arr.ctypes.data % mmap.PAGESIZE == 0 and arr.nbytes == nbytes and arr.dtype == np.uint8
    arr[:] = 7  # writable
    assert int(arr.sum()) == 7 * nbytes


def test_page_lock_refuses_an_array_off_a_page_boundary():
    arr = frames.page_aligned_empty(3 * mmap.PAGESIZE)[1:]
    with pytest.raises(OSError, match="does not start on a page"):
        frames.page_lock(arr)
