"""Delta versions: a version's tensors encoded against a parent version's (DESIGN.md, "Distribution
at pool scale"). Pure functions over byte buffers; the policy server encodes, the client decodes.

Each tensor is its packed contract bytes (codes and scales, as the manifest lays them out), and
travels as one of:
  UNCHANGED  the parent's bytes: no payload;
  XOR_ZSTD   zstd(new XOR parent): consecutive zstd frames, each of FRAME_BYTES of the tensor (the
             last fewer) and recording its content size, so that threads encode and rebuild the
             frames of one large tensor at once.
Rules:
1. Only tensors of equal size are XOR-ed: a version whose tensors the parent lacks, or has at
   another size, has no delta (`xor_compatible` names the first such tensor).
2. `decode` refuses (DeltaError, one line) a frame that is not exactly one zstd frame of the
   bytes it rebuilds; it never decides that a rebuilt tensor is right: the client checks every rebuilt
   tensor against the version's manifest (chunk xxh3s and sha256), whatever this module says.
3. `decode` may write into the parent's own memory (out is parent): the XOR runs element by element.
4. A delta is served only when its payload bytes are below the version's full bytes (`worth_it`).
zstd (de)compression and numpy's XOR release the GIL: callers encode or decode tensors in threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

LEVEL = 3  # zstd level of XOR payloads (bench/bench_delta.py measures it)
PIECE = 1 << 20  # bytes XOR-ed and (de)compressed at a time: a piece stays in cache
FRAME_BYTES = 32 << 20  # tensor bytes per zstd frame: a large tensor's frames encode and rebuild in parallel
# this thread's zstd compressors (by level) and decompressor: making one costs about what a small
# tensor does, so each thread keeps its own
_contexts = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    by_level = _contexts.__dict__.setdefault("compressors", {})
    if level not in by_level:
        by_level[level] = zstandard.ZstdCompressor(level=level)
    return by_level[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_contexts, "decompressor"):
        _contexts.decompressor = zstandard.ZstdDecompressor()
    return _contexts.decompressor


class DeltaError(ValueError):
    """A delta payload or description that cannot be decoded (one line naming the tensor)."""


def as_bytes(buf) -> np.ndarray:
    """A buffer's bytes as a flat uint8 array (no copy)."""
    return np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)


def xor(a, b, out: np.ndarray | None = None) -> np.ndarray:
    """a XOR b, byte by byte (equal sizes), into `out` when given (which may be a or b)."""
    a, b = as_bytes(a), as_bytes(b)
    if a.nbytes != b.nbytes:
        raise DeltaError(f"XOR of {a.nbytes} and {b.nbytes} bytes")
    return np.bitwise_xor(a, b, out=out)


def frame_step(chunk_bytes: int) -> int:
    """Tensor bytes per zstd frame: FRAME_BYTES rounded down to whole chunks (one chunk at least)."""
    return chunk_bytes * max(1, FRAME_BYTES // chunk_bytes)


def _piece_buffer(nbytes: int) -> np.ndarray:
    """This thread's scratch buffer of at least `nbytes` (a piece of XOR, kept in cache)."""
    buf = getattr(_contexts, "piece", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _contexts.piece = np.empty(nbytes, dtype=np.uint8)
    return buf


def encode(new, parent, *, level: int = LEVEL, piece: int = PIECE) -> bytes | None:
    """The XOR_ZSTD payload of `new` against `parent` (equal sizes) as one frame, or None when they
    are equal (UNCHANGED)."""
    frame, changed = encode_frame(new, parent, level=level, piece=piece)
    return frame if changed else None


def encode_frame(new, parent, *, level: int = LEVEL, piece: int = PIECE) -> tuple[bytes, bool]:
    """One zstd frame of `new` XOR `parent` (equal sizes; the frame records its content size) and
    whether any byte differs, XOR-ed and compressed `piece` bytes at a time (`encode_pieces`)."""
    new, parent = as_bytes(new), as_bytes(parent)
    if new.nbytes != parent.nbytes:
        raise DeltaError(f"XOR of {new.nbytes} and {parent.nbytes} bytes")
    bounds = [(a, min(new.nbytes, a + piece)) for a in range(0, new.nbytes, piece)]
    return encode_pieces([new[a:b] for a, b in bounds], [parent[a:b] for a, b in bounds], level=level)


def encode_pieces(new: Sequence, parent: Sequence, *, level: int = LEVEL) -> tuple[bytes, bool]:
    """One zstd frame of the concatenation of new[i] XOR parent[i] (buffers of pairwise equal sizes,
    e.g. a tensor's chunks as the server holds them) and whether any byte differs. Each piece is
    XOR-ed into a scratch buffer and compressed while in cache: no buffer of the frame's size."""
    new, parent = [as_bytes(x) for x in new], [as_bytes(x) for x in parent]
    if [x.nbytes for x in new] != [x.nbytes for x in parent]:
        raise DeltaError(f"XOR of {sum(x.nbytes for x in new)} and {sum(x.nbytes for x in parent)} bytes in pieces")
    buf = _piece_buffer(max([x.nbytes for x in new], default=1))
    stream, parts, changed = _compressor(level).compressobj(size=sum(x.nbytes for x in new)), [], False
    for a, b in zip(new, parent):
        x = buf[: a.nbytes]
        np.bitwise_xor(a, b, out=x)
        changed = changed or bool(x.any())
        parts.append(stream.compress(x))
    parts.append(stream.flush())
    return b"".join(parts), changed


def max_payload_bytes(nbytes: int) -> int:
    """The largest XOR_ZSTD payload a tensor of `nbytes` may have (above zstd's compress bound)."""
    return nbytes + nbytes // 128 + 4096


def decode(
    name: str,
    payload,
    parent,
    out: np.ndarray,
    *,
    piece: int = PIECE,
    on_piece: Callable[[int, int], None] | None = None,
) -> None:
    """Write parent XOR unzstd(payload) into `out` (as many bytes as `parent`; `out` may be `parent`),
    `piece` bytes at a time, calling on_piece(a, b) once out[a:b] is written (a caller hashes it
    while it is in cache). DeltaError naming `name` when the payload is not one zstd frame of that size."""
    parent = as_bytes(parent)
    n = parent.nbytes
    if out.nbytes != n:
        raise DeltaError(f"tensor {name}: the parent has {n} bytes, the version {out.nbytes}")
    try:
        size = zstandard.frame_content_size(payload)
        if size != n:
            raise DeltaError(f"tensor {name}: the delta frame holds {size} bytes, the tensor has {n}")
        buf = _piece_buffer(min(piece, max(1, n)))
        with _decompressor().stream_reader(payload, read_across_frames=True) as reader:
            for a in range(0, n, piece):
                x = buf[: min(n, a + piece) - a]
                got = _read_into(reader, x)
                if got != len(x):
                    raise DeltaError(f"tensor {name}: the delta decoded to {a + got} bytes, the tensor has {n}")
                np.bitwise_xor(parent[a : a + len(x)], x, out=out[a : a + len(x)])
                if on_piece is not None:
                    on_piece(a, a + len(x))
            if reader.read(1):
                raise DeltaError(f"tensor {name}: the delta decodes to more than the tensor's {n} bytes")
    except zstandard.ZstdError as e:
        raise DeltaError(f"tensor {name}: undecodable delta payload: {e}") from None


def _read_into(reader, x: np.ndarray) -> int:
    """Fill `x` from a zstd stream reader; the bytes read (fewer only at the end of the stream)."""
    view, got = memoryview(x), 0
    while got < len(view):
        k = reader.readinto(view[got:])
        if not k:
            break
        got += k
    return got


def xor_compatible(sizes: Mapping[str, int], parent_sizes: Mapping[str, int]) -> str:
    """ "" when every tensor of `sizes` (name -> bytes) is in `parent_sizes` at the same size; else
    why not (the first tensor that is not)."""
    for name, n in sizes.items():
        p = parent_sizes.get(name)
        if p is None:
            return f"the parent has no tensor {name}"
        if p != n:
            return f"tensor {name} has {n} bytes, {p} in the parent"
    return ""


def worth_it(payload_bytes: int, full_bytes: int) -> bool:
    """Serve the delta (payloads summed over the version) rather than the full version (rule 4)."""
    return payload_bytes < full_bytes


@dataclass(frozen=True)
class HeldPolicy:
    """A version a client holds whole and verified, to fetch the next against: its number, its
    manifest's digest (policy.manifest.manifest_digest) and its tensors' bytes by name."""

    version: int
    digest: bytes
    data: Mapping[str, np.ndarray]

    def covers(self, sizes: Mapping[str, int]) -> bool:
        """Whether it has every tensor of `sizes` (name -> bytes) at that size (rule 1)."""
        return not xor_compatible(sizes, {n: a.nbytes for n, a in self.data.items()})
