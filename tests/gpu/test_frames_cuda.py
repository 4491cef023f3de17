"""broker.frames on CUDA: device-to-host copies straight into the page-locked framed buffer give the
same bytes and checksums as build_manifest, and staging protects parts that alias live parameters."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from broker import frames
from policy import manifest as M
from policy.contract import Contract
from policy.formats.params import QuantizedParam, quantize_param

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONTRACT = Contract(model_config={"test": "frames"}, recipe_name="mixed", recipe_rules={"rules": ["test"]})


def tensors(seed: int) -> dict[str, QuantizedParam]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    shapes = {"a": (256, 1024), "b": (640, 2048), "c": (1, 96), "d": (3000, 512)}  # chunks cut parts mid-way
    fmts = {"a": ("nvfp4", {"scope": "tensor"}), "b": ("mxfp8", {}), "c": ("bf16", {}), "d": ("int4", {})}
    for name, shape in shapes.items():
        fmt, kw = fmts[name]
        w = torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)
        out[name] = quantize_param(w, fmt, **kw)
    return out


@pytest.mark.parametrize(("chunk", "task_chunks"), [(M.CHUNK_BYTES, 0), (4096 + 3, 0), (4096 + 3, 5)])
def test_framed_bytes_and_checksums_equal_build_manifest(chunk, task_chunks, monkeypatch):
    """task_chunks > 0: every tensor hashed in runs of that many chunks (several tasks waiting on its D2H)."""
    if task_chunks:
        monkeypatch.setattr("policy.chunks.HASH_TASK_BYTES", task_chunks * chunk)
    t = tensors(0)
    ref = M.build_manifest(
        version=2, parent_version=1, contract=CONTRACT, tensors=t, chunk_bytes=chunk, created_unix_ns=5
    )
    pool = frames.BufferPool(pin=True)
    for _ in range(3):  # the third reuses a buffer: stale bytes must not leak through
        f = frames.build_framed(
            version=2, parent_version=1, contract=CONTRACT, tensors=t, pool=pool, chunk_bytes=chunk, created_unix_ns=5
        )
        assert f.manifest == ref.manifest
        for tf in f.layout.tensors:
            got = b"".join(f.data[a:b].tobytes() for a, b in tf.data)
            assert got == bytes(ref.blobs[tf.name]), tf.name
        f.release()
        t = tensors(0)  # new device tensors, same values
    assert pool.allocated == 1
    pool.close()


def test_staged_parts_aliasing_a_parameter_survive_an_in_place_update():
    p = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    q = quantize_param(p, "bf16")
    alias = QuantizedParam("bf16", {}, type(q.value)(p, (512, 1024)))
    want = p.clone()
    staged = frames.stage(
        version=1, parent_version=None, contract=CONTRACT, tensors={"p": alias}, pool=frames.BufferPool(pin=True),
        live=[p],
    )  # fmt: skip
    p.mul_(3)  # the next optimizer step, queued before the background copy
    f = staged.run()
    got = b"".join(f.data[a:b].tobytes() for a, b in f.layout.tensors[0].data)
    assert got == want.view(torch.uint8).cpu().numpy().tobytes()
    f.release()
    staged.pool.close()  # unpin what this test pinned (the finalize covers a failure before here)


def test_page_locked_memory_freed_without_unlock_leaves_no_registration():
    """A page-locked buffer dropped without its unlock (a pool never closed) ends its registration
    with its memory: host memory later allocated at the same addresses takes device-to-host copies.
    A registration that outlived its memory made such copies fail ("CUDA error: invalid argument")
    in whichever later test allocated there."""
    nbytes = 48 << 20  # mmap-backed: freed memory goes back, and the next allocation reuses its addresses
    src = torch.arange(nbytes, device="cuda", dtype=torch.int64).to(torch.uint8)
    for _ in range(3):
        arr = frames.page_aligned_empty(nbytes)
        frames.page_lock(arr)  # the unlock dropped on purpose
        address = arr.ctypes.data
        del arr
        gc.collect()
        again = np.empty(nbytes, dtype=np.uint8)
        reused = again.ctypes.data == address
        torch.from_numpy(again).copy_(src)  # pageable: a stale registration here is an invalid argument
        torch.cuda.synchronize()
        assert torch.equal(torch.from_numpy(again), src.cpu()), f"bytes differ (addresses reused: {reused})"
        del again
    for p in (frames.HostBuffer(nbytes, pin=True), frames.BufferPool(pin=True).acquire(nbytes)):
        assert p.pinned
        del p
    gc.collect()
    torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).copy_(src)
    torch.cuda.synchronize()


def test_host_memory_beside_a_live_registration_copies_to_the_gpu():
    """CUDA pins whole pages: a page-locked buffer lies in pages of its own, so small host tensors
    allocated while it is registered never share a page with it and copy as pageable memory."""
    buf = frames.HostBuffer(1_048_632, pin=True)  # an odd size, not a whole number of pages
    assert buf.pinned and buf.array.ctypes.data % 4096 == 0
    for n in (64, 512, 3000, 8000) * 25:
        t = torch.full((n,), 3, dtype=torch.uint8)
        assert int(t.cuda().sum()) == 3 * n
    buf.close()


def test_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """cudaHostRegister of memory already registered fails; the runtime keeps that error as its last
    one, which the next kernel launch anywhere would raise unless page_lock clears it."""
    arr = frames.page_aligned_empty(8192)
    unlock = frames.page_lock(arr)
    with pytest.raises(OSError, match="cudaHostRegister of 8192 bytes failed"):
        frames.page_lock(arr)
    assert float(torch.ones(4, device="cuda").mul_(2).sum()) == 8.0
    unlock()
