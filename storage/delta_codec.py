"""Lossless weight deltas between two versions of one tensor, on its raw bit patterns.

`new == apply(old, encode(old, new))` bit for bit for any input (NaNs, -0, denormals included).
Callers work on integer views of the tensors: bf16/fp16 as `uint16`, fp32 as `uint32` (`tensor_bits`).

Format (little-endian), one blob per tensor:

    header   "LWDC" | format u8 | width u8 (2 or 4) | 0 u16 | elements u64 | chunk_elems u64 | chunks u32
    table    per chunk: encoding u8 | 3 pad | payload crc32 u32 | payload bytes u64
    crc32    of header + table
    payloads concatenated in chunk order

Chunk `i` covers elements `[i * chunk_elems, min((i + 1) * chunk_elems, elements))` and is coded on its
own, so encode and apply both parallelise over chunks and the blob does not depend on `threads`.
Encodings: 0 unchanged (empty payload), 1 sparse (gaps between changes + small value differences), 2 dense
(value differences of every element in zstd byte planes); see `storage.delta_streams`. The encoder
picks sparse below `SPARSE_ONLY_MAX_FRACTION` changed, dense above `DENSE_ONLY_MIN_FRACTION`, and
whichever is smaller in between.

Failure behaviour: a blob for another element count or width, a truncated blob, trailing bytes or any
flipped bit (crc32) raises `ValueError` before the target is touched. The blob cannot tell whether the
target holds the right *base version*; the weight store checks each tensor's hash after applying.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard

from storage.delta_streams import apply_dense, apply_sparse, encode_dense, encode_sparse

MAGIC = b"LWDC"
FORMAT_VERSION = 1
CHUNK_ELEMS = 1 << 22
"""Elements per independently coded chunk: 8 MiB of bf16, small enough to stay in cache while coding
and to spread one large tensor over threads, large enough that the 16-byte table entry is noise."""
MAX_CHUNK_ELEMS = 1 << 31
SPARSE_ONLY_MAX_FRACTION = 0.4
"""Below this changed fraction the sparse payload always wins (measured), so dense is not tried."""
DENSE_ONLY_MIN_FRACTION = 0.7
"""Above this changed fraction the dense payload always wins (measured), so sparse is not tried."""

UNCHANGED, SPARSE, DENSE = 0, 1, 2
_HEADER = struct.Struct("<4sBBHQQI")
_ENTRY = struct.Struct("<B3xIQ")
_CRC = struct.Struct("<I")
_BIT_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_TORCH_INT_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def tensor_bits(tensor: torch.Tensor) -> np.ndarray:
    """Flat zero-copy `uint16`/`uint32` view of a contiguous CPU bf16, fp16 or fp32 tensor's bits.

    Writing into the view writes the tensor, which is how `apply_delta` updates a tensor in place.
    """
    if tensor.dtype not in _TORCH_INT_VIEWS:
        raise ValueError(f"tensor_bits: dtype {tensor.dtype} not supported (bfloat16, float16, float32)")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor_bits: need a contiguous CPU tensor, got device={tensor.device}")
    ints = tensor.detach().view(_TORCH_INT_VIEWS[tensor.dtype]).numpy()
    return ints.view(_BIT_DTYPES[tensor.element_size()]).reshape(-1)


def _flat_bits(array: np.ndarray, name: str) -> np.ndarray:
    if array.dtype.kind != "u" or array.dtype.itemsize not in _BIT_DTYPES:
        raise ValueError(f"{name}: expected uint16 or uint32 bit patterns, got dtype {array.dtype}")
    return array.reshape(-1).view(_BIT_DTYPES[array.dtype.itemsize])


def _pair(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    old, new = _flat_bits(old, "old"), _flat_bits(new, "new")
    if old.dtype != new.dtype or old.size != new.size:
        raise ValueError(
            f"old ({old.dtype}, {old.size}) and new ({new.dtype}, {new.size}) bits differ in dtype or size"
        )
    return old, new


def _run(fn: Callable[[int], object], count: int, threads: int) -> list:
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if threads == 1 or count <= 1:
        return [fn(i) for i in range(count)]
    with ThreadPoolExecutor(max_workers=min(threads, count)) as pool:
        return list(pool.map(fn, range(count)))


def _encode_chunk(old: np.ndarray, new: np.ndarray) -> tuple[int, bytes]:
    positions = np.flatnonzero(old != new)
    fraction = positions.size / max(old.size, 1)
    if positions.size == 0:
        return UNCHANGED, b""
    if fraction <= SPARSE_ONLY_MAX_FRACTION:
        return SPARSE, encode_sparse(old, new, positions)
    dense = encode_dense(old, new)
    if fraction >= DENSE_ONLY_MIN_FRACTION:
        return DENSE, dense
    sparse = encode_sparse(old, new, positions)
    return (SPARSE, sparse) if len(sparse) < len(dense) else (DENSE, dense)


def encode_delta(
    old_bits: np.ndarray, new_bits: np.ndarray, *, threads: int = 1, chunk_elems: int = CHUNK_ELEMS
) -> bytes:
    """Encode `new_bits` relative to `old_bits` (same dtype and size; any shape, read flat)."""
    old, new = _pair(old_bits, new_bits)
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"chunk_elems must be in [1, {MAX_CHUNK_ELEMS}], got {chunk_elems}")
    num_chunks = -(-old.size // chunk_elems)

    def encode_one(i: int) -> tuple[int, bytes]:
        window = slice(i * chunk_elems, (i + 1) * chunk_elems)
        return _encode_chunk(old[window], new[window])

    chunks = _run(encode_one, num_chunks, threads)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, old.dtype.itemsize, 0, old.size, chunk_elems, num_chunks)
    table = b"".join(_ENTRY.pack(enc, zlib.crc32(payload), len(payload)) for enc, payload in chunks)
    return b"".join((head, table, _CRC.pack(zlib.crc32(head + table)), *(payload for _, payload in chunks)))


def _parse(blob: bytes | memoryview) -> tuple[int, int, int, list[tuple[int, memoryview]]]:
    """(width, elements, chunk_elems, [(encoding, payload)]) after every structural and crc check."""
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER.size or bytes(view[:4]) != MAGIC:
        raise ValueError(f"not a Leeway delta: bad magic or only {len(view)} bytes")
    _, version, width, _, elements, chunk_elems, num_chunks = _HEADER.unpack_from(view)
    if version != FORMAT_VERSION:
        raise ValueError(f"delta format version {version} not supported (this reader knows {FORMAT_VERSION})")
    if width not in _BIT_DTYPES or not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise ValueError(f"delta header: bad width {width} or chunk_elems {chunk_elems}")
    if num_chunks != -(-elements // chunk_elems):
        raise ValueError(f"delta header: {num_chunks} chunks cannot cover {elements} elements")
    table_end = _HEADER.size + num_chunks * _ENTRY.size
    if len(view) < table_end + _CRC.size:
        raise ValueError("delta truncated inside its chunk table")
    if zlib.crc32(view[:table_end]) != _CRC.unpack_from(view, table_end)[0]:
        raise ValueError("delta header checksum mismatch: blob is corrupted")
    chunks, offset = [], table_end + _CRC.size
    for i in range(num_chunks):
        encoding, crc, size = _ENTRY.unpack_from(view, _HEADER.size + i * _ENTRY.size)
        payload = view[offset : offset + size]
        if len(payload) != size:
            raise ValueError(f"delta truncated in chunk {i} payload")
        if encoding not in (UNCHANGED, SPARSE, DENSE) or (encoding == UNCHANGED) != (size == 0):
            raise ValueError(f"delta chunk {i}: bad encoding {encoding} with {size} payload bytes")
        if zlib.crc32(payload) != crc:
            raise ValueError(f"delta chunk {i} checksum mismatch: blob is corrupted")
        chunks.append((encoding, payload))
        offset += size
    if offset != len(view):
        raise ValueError(f"delta has {len(view) - offset} trailing bytes after its last chunk")
    return width, elements, chunk_elems, chunks


def apply_delta(bits: np.ndarray, blob: bytes | memoryview, *, threads: int = 1) -> None:
    """Turn `bits` (writable, C-contiguous, the delta's base) into the new version in place.

    Raises ValueError, with `bits` untouched, when the blob is corrupted, truncated, or made for
    another element count or width: the header and every chunk's crc32 are checked before any write.
    Each chunk is then fully decoded and validated before it is written, so a payload that passed its
    crc but is inconsistent (an encoder bug) can leave earlier chunks applied; it still raises.
    """
    if not (bits.flags.c_contiguous and bits.flags.writeable):
        raise ValueError("apply_delta: target bits must be a writable C-contiguous array")
    flat = _flat_bits(bits, "apply_delta target")
    width, elements, chunk_elems, chunks = _parse(blob)
    if width != flat.dtype.itemsize or elements != flat.size:
        raise ValueError(
            f"delta is for {elements} elements of {width * 8} bits, target has {flat.size} of {flat.dtype.itemsize * 8}"
        )
    appliers = {SPARSE: apply_sparse, DENSE: apply_dense}

    def apply_one(i: int) -> None:
        encoding, payload = chunks[i]
        if encoding != UNCHANGED:
            appliers[encoding](flat[i * chunk_elems : (i + 1) * chunk_elems], payload)

    _run(apply_one, len(chunks), threads)


# --- baselines and bounds, for benchmarks ---------------------------------------------------------


def encode_xor_zstd_baseline(old_bits: np.ndarray, new_bits: np.ndarray) -> bytes:
    """What slime ships: XOR of the bit patterns, split into byte planes, one zstd level-1 frame."""
    old, new = _pair(old_bits, new_bits)
    xor = old ^ new
    planes = np.ascontiguousarray(xor.view(np.uint8).reshape(xor.size, xor.dtype.itemsize).T)
    return zstandard.ZstdCompressor(level=1).compress(planes.data)


def changed_fraction(old_bits: np.ndarray, new_bits: np.ndarray) -> float:
    """Fraction of elements whose bit pattern differs (0.0 for empty arrays)."""
    old, new = _pair(old_bits, new_bits)
    return float(np.count_nonzero(old != new)) / old.size if old.size else 0.0


def index_value_baseline_bytes(old_bits: np.ndarray, new_bits: np.ndarray) -> int:
    """The TRL-style sparse baseline: an int32 index plus the new value per changed element."""
    old, new = _pair(old_bits, new_bits)
    return int(np.count_nonzero(old != new)) * (4 + old.dtype.itemsize)


def entropy_bound_bytes(old_bits: np.ndarray, new_bits: np.ndarray) -> float:
    """n*H(p)/8 for the positions plus changed*H(XOR values)/8, the empirical order-0 entropy bound."""
    old, new = _pair(old_bits, new_bits)
    xor = (old ^ new)[old != new]
    if xor.size in (0, old.size):
        position_bits = 0.0
    else:
        p = xor.size / old.size
        position_bits = old.size * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    if xor.size == 0:
        return position_bits / 8
    counts = np.bincount(xor) if xor.dtype.itemsize == 2 else np.unique(xor, return_counts=True)[1]
    probs = counts[counts > 0] / xor.size
    return (position_bits + float(-(probs * np.log2(probs)).sum()) * xor.size) / 8
