"""Chunk-level coders behind the weight-delta format (see `storage.delta_codec` for the container).

Everything here is pure, vectorised numpy over one chunk of raw float bit patterns (`uint16` for
bf16/fp16, `uint32` for fp32). Two payloads exist:

- **sparse** (few elements changed, the normal RL case): the gaps between changed positions, and
  each changed value as a small signed integer, both close to their entropy.
- **dense** (most elements changed, e.g. fp32 or a large step): the same signed integer for every
  element, split into byte planes and zstd-compressed.

Values are coded as `ordered(new) - ordered(old)`, where `ordered` is the bijection from IEEE bit
patterns to integers that sort like the floats they encode. A one-ulp move (the common case at small
learning rates) is then `+-1` even across zero: a sign bit plus a small tail, where the XOR of the bit
patterns spreads the same move over 1, 3, 7, ... as the carry ripples.
All mappings are bijections on the raw bits, so the round trip is exact for any input, NaNs included.

Every stream ends as byte planes, each its own zstd frame, so zstd's Huffman stage does the entropy
coding and decoding is zstd plus a few vectorised shifts (no bit-level loops). A gap is split as
`gap = high << shift | low`: `high` is one byte symbol (255 escapes to a raw uint64), `low` is
`shift` bits in byte planes. `shift` sits two bits under the Rice optimum, so `high` carries ~4-5
bits of a roughly geometric distribution, which Huffman codes within a few percent of its entropy.

Decoders never trust their input: every length, count and index is checked and a mismatch raises
`ValueError`, so a bad payload can never scatter writes outside its chunk.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

ZSTD_LEVEL = 1
"""zstd level for every plane. Levels 3 and 9 made sparse payloads 1-4% larger (their extra LZ matches
on these near-random symbol streams cost more than Huffman alone)."""

HIGH_ESCAPE = 255
"""A gap whose high byte would reach this is written in full to the raw escape stream instead."""

RICE_K_SAMPLE = 1 << 13
"""Gaps sampled (evenly strided) to choose the shift; the size curve is flat near its minimum."""

MAX_SHIFT = 56
"""Largest gap shift the decoder accepts (gaps are below 2^63)."""

_SPARSE_HEADER = struct.Struct("<QIB3x")  # changed count, escape count, gap shift
_FRAME_COUNT = struct.Struct("<I")
_FRAME_SIZE = struct.Struct("<Q")


def _uint_dtype(width: int) -> np.dtype:
    return np.dtype(f"<u{width}")


def to_ordered(bits: np.ndarray) -> np.ndarray:
    """Map IEEE bit patterns to unsigned integers that sort like the floats (a bijection).

    Positive floats get their sign bit set; negative floats have every bit flipped. -0 and +0 end up
    adjacent, so a sign change through zero is a small difference too.
    """
    nbits = bits.dtype.itemsize * 8
    flip = (bits.view(f"<i{bits.dtype.itemsize}") >> (nbits - 1)).view(bits.dtype)  # all ones if negative
    flip |= 1 << (nbits - 1)
    flip ^= bits
    return flip


def from_ordered(ordered: np.ndarray) -> np.ndarray:
    """Inverse of `to_ordered`."""
    nbits = ordered.dtype.itemsize * 8
    flip = (ordered.view(f"<i{ordered.dtype.itemsize}") >> (nbits - 1)).view(ordered.dtype)  # all ones if positive
    np.invert(flip, out=flip)
    flip |= 1 << (nbits - 1)
    flip ^= ordered
    return flip


def zigzag_diff(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Zigzag code of `ordered(new) - ordered(old)` modulo 2^w: 0, -1, 1, -2 ... -> 0, 1, 2, 3 ..."""
    width = old.dtype.itemsize
    diff = to_ordered(new)
    diff -= to_ordered(old)
    signed = diff.view(f"<i{width}")
    zigzag = signed >> (width * 8 - 1)
    zigzag ^= signed << 1
    return zigzag.view(_uint_dtype(width))


def undo_zigzag_diff(old: np.ndarray, zigzag: np.ndarray) -> np.ndarray:
    """The new bit patterns given the old ones and `zigzag_diff(old, new)`."""
    diff = (zigzag & 1) * np.iinfo(zigzag.dtype).max
    diff ^= zigzag >> 1
    diff += to_ordered(old)
    return from_ordered(diff)


def _planes(values: np.ndarray, count: int) -> list[np.ndarray]:
    """The low `count` byte planes of unsigned ints (shifts and casts; a transposing copy is slower)."""
    planes = np.empty((count, values.size), dtype=np.uint8)
    for i, plane in enumerate(planes):
        np.right_shift(values, 8 * i, out=plane, casting="unsafe")
    return list(planes)


def _join_planes(planes: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    values = np.zeros(planes[0].size if planes else 0, dtype=dtype)
    for i in reversed(range(len(planes))):
        values <<= 8
        values |= planes[i]
    return values


def _pack_frames(planes: list[np.ndarray]) -> bytes:
    """Each plane as its own zstd frame, behind a table of frame sizes."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    frames = [cctx.compress(plane.data) for plane in planes]
    sizes = b"".join(_FRAME_SIZE.pack(len(frame)) for frame in frames)
    return b"".join((_FRAME_COUNT.pack(len(frames)), sizes, *frames))


def _unpack_frames(payload: memoryview, count: int, what: str) -> list[np.ndarray]:
    """Inverse of `_pack_frames`: every frame decompressed to exactly `count` bytes, or ValueError."""
    if len(payload) < _FRAME_COUNT.size:
        raise ValueError(f"delta {what}: payload truncated before its frame table")
    (num_frames,) = _FRAME_COUNT.unpack_from(payload)
    offset = _FRAME_COUNT.size + num_frames * _FRAME_SIZE.size
    if offset > len(payload):
        raise ValueError(f"delta {what}: payload truncated inside its frame table")
    dctx, planes = zstandard.ZstdDecompressor(), []
    for i in range(num_frames):
        (size,) = _FRAME_SIZE.unpack_from(payload, _FRAME_COUNT.size + i * _FRAME_SIZE.size)
        frame = payload[offset : offset + size]
        try:
            raw = dctx.decompress(frame, max_output_size=count) if size else b""
        except zstandard.ZstdError as exc:
            raise ValueError(f"delta {what}: zstd frame {i} does not decode ({exc})") from exc
        if len(frame) != size or len(raw) != count:
            raise ValueError(f"delta {what}: frame {i} holds {len(raw)} bytes, expected {count}")
        planes.append(np.frombuffer(raw, dtype=np.uint8))
        offset += size
    if offset != len(payload):
        raise ValueError(f"delta {what}: {len(payload) - offset} bytes after the last frame")
    return planes


def _choose_shift(gaps: np.ndarray) -> int:
    """Bits of each gap kept out of the high byte: two under the Rice optimum, on a sample.

    Low planes of only 1-2 bits code badly in zstd (about 1.5 bits per bit), so such shifts round
    down to the byte boundary, where the high byte absorbs the bits instead.
    """
    sample = gaps[:: max(1, gaps.size // RICE_K_SAMPLE)]
    guesses = {max(0, int(np.ceil(np.log2(float(m) * np.log(2) + 1.0)))) for m in (sample.mean(), np.median(sample))}
    best_k, best_bits = 0, None
    for k in sorted({k for guess in guesses for k in range(guess - 2, guess + 3) if 0 <= k <= MAX_SHIFT}):
        quotients = sample >> k
        bits = sample.size * (k + 1) + int(np.minimum(quotients, 64).sum()) + 64 * int((quotients >= 64).sum())
        if best_bits is None or bits < best_bits:
            best_k, best_bits = k, bits
    shift = best_k - 2
    if shift < 3:
        return 0
    return shift - shift % 8 if shift % 8 in (1, 2) else shift


def encode_positions(positions: np.ndarray) -> tuple[int, bytes, list[np.ndarray]]:
    """Gaps between sorted positions (pos_-1 = -1) as (shift, raw uint64 escapes, byte planes)."""
    gaps = np.diff(positions, prepend=-1) - 1
    shift = _choose_shift(gaps)
    high = np.minimum(gaps >> shift, HIGH_ESCAPE).astype(np.uint8)
    escapes = gaps[high == HIGH_ESCAPE].astype("<u8").tobytes()
    low = gaps & ((1 << shift) - 1)
    return shift, escapes, [high, *_planes(low, -(-shift // 8))]


def decode_positions(shift: int, escapes: np.ndarray, planes: list[np.ndarray], count: int, limit: int) -> np.ndarray:
    """Inverse of `encode_positions`; raises ValueError unless every position lies in [0, limit)."""
    if not 0 <= shift <= MAX_SHIFT or len(planes) != 1 + -(-shift // 8):
        raise ValueError(f"delta positions: shift {shift} with {len(planes)} gap planes")
    high = planes[0]
    gaps = high.astype(np.int64) << shift
    if shift:
        gaps |= _join_planes(planes[1:], np.dtype(np.int64))
    escaped = high == HIGH_ESCAPE
    if int(escaped.sum()) != escapes.size or (escapes.size and int(escapes.max()) >= limit):
        raise ValueError(f"delta positions: {int(escaped.sum())} escaped gaps, {escapes.size} bad escape values")
    gaps[escaped] = escapes
    if int(gaps.max()) >= limit:
        raise ValueError(f"delta positions: gap {int(gaps.max())} exceeds the chunk of {limit} elements")
    positions = np.cumsum(gaps + 1) - 1
    if positions[-1] >= limit:
        raise ValueError(f"delta positions: index {int(positions[-1])} outside a chunk of {limit} elements")
    return positions


# --- chunk payloads ---------------------------------------------------------------------------


def encode_sparse(old: np.ndarray, new: np.ndarray, positions: np.ndarray) -> bytes:
    """Payload for a chunk where `positions` (sorted, non-empty) are exactly the changed elements."""
    shift, escapes, gap_planes = encode_positions(positions)
    value_planes = _planes(zigzag_diff(old[positions], new[positions]), old.dtype.itemsize)
    header = _SPARSE_HEADER.pack(positions.size, len(escapes) // 8, shift)
    return b"".join((header, escapes, _pack_frames(gap_planes + value_planes)))


def apply_sparse(bits: np.ndarray, payload: memoryview) -> None:
    """Apply a sparse payload to one chunk's bits in place; the chunk is untouched if it raises."""
    if len(payload) < _SPARSE_HEADER.size:
        raise ValueError("delta sparse chunk: payload shorter than its header")
    count, num_escapes, shift = _SPARSE_HEADER.unpack_from(payload)
    if not 0 < count <= bits.size:
        raise ValueError(f"delta sparse chunk: {count} changes in a chunk of {bits.size} elements")
    escapes_end = _SPARSE_HEADER.size + 8 * num_escapes
    if escapes_end > len(payload):
        raise ValueError("delta sparse chunk: payload truncated in its escapes")
    escapes = np.frombuffer(payload[_SPARSE_HEADER.size : escapes_end], dtype="<u8")
    planes = _unpack_frames(payload[escapes_end:], count, "sparse chunk")
    width = bits.dtype.itemsize
    if len(planes) < width:
        raise ValueError(f"delta sparse chunk: {len(planes)} planes, fewer than the value width {width}")
    positions = decode_positions(shift, escapes, planes[:-width], count, bits.size)
    bits[positions] = undo_zigzag_diff(bits[positions], _join_planes(planes[-width:], bits.dtype))


def encode_dense(old: np.ndarray, new: np.ndarray) -> bytes:
    """Payload for a chunk where most elements changed: zigzag differences of all elements, byte planes."""
    return _pack_frames(_planes(zigzag_diff(old, new), old.dtype.itemsize))


def apply_dense(bits: np.ndarray, payload: memoryview) -> None:
    """Apply a dense payload to one chunk's bits in place; the chunk is untouched if it raises."""
    planes = _unpack_frames(payload, bits.size, "dense chunk")
    if len(planes) != bits.dtype.itemsize:
        raise ValueError(f"delta dense chunk: {len(planes)} planes for {bits.dtype.itemsize}-byte values")
    bits[:] = undo_zigzag_diff(bits, _join_planes(planes, bits.dtype))
