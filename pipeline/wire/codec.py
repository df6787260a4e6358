"""TrajectoryGroup <-> Arrow IPC stream bytes (zstd buffer compression), and groups <-> Parquet files.

One message on the wire is one Arrow IPC stream holding exactly one record batch of schema v3 (v1 and v2 are read
too) (`TRAJECTORY_SCHEMA`), one row per sample. A MoE group's routes are one ``list<uint8>`` row per sample holding
the bytes of its ``[tokens, layers, top_k]`` array (uint16 ids as their little-endian bytes), with the layer and
top-k counts and the id width beside them, so they compress with the group and cost no per-token header. zstd stays at Arrow's default level 1: it costs ~6.4 bytes
per token on random token ids and realistic log-probs, and level 3 compresses only 0.1% smaller at a
quarter of the speed (`leeway bench transport` measures bytes per token and decode speed).

Decoding treats the bytes as untrusted: any malformed input (random bytes, truncated stream, wrong
schema, offsets pointing outside their buffers, nulls where none are allowed) raises `CodecError`
with a machine-readable `reason`, and invariant violations raise `TrajectoryValidationError`; nothing
is returned half-decoded. Arrow buffers are fully validated before numpy views are taken, so a
hostile offset can never make numpy read outside a buffer.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.wire.trajectory import (
    MAX_ROUTE_BYTES_PER_TOKEN,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    TOKEN_COLUMNS,
    TrajectoryGroup,
    TrajectoryValidationError,
    validate_group,
)

SCHEMA_VERSION_KEY = b"leeway.schema_version"
COMPRESSION = "zstd"
"""Arrow IPC buffer compression; level 1 (Arrow's default) is the measured sweet spot."""

PARQUET_COMPRESSION = "zstd"

MAX_DECODED_BYTES = 2 * 1024**3
"""Default cap on one message's decompressed size (twice the largest claim check the wire accepts
inflated 8x); callers that know the group's size from its headers pass a tighter one."""

_V1_FIELDS = [
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("prompt_id", pa.string(), nullable=False),
    pa.field("generator_id", pa.string(), nullable=False),
    pa.field("tokens", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("versions", pa.list_(pa.int32()), nullable=False),
    pa.field("min_version", pa.int32(), nullable=False),
    pa.field("max_version", pa.int32(), nullable=False),
    pa.field("reward", pa.float32(), nullable=True),
    pa.field("reward_source", pa.string(), nullable=False),
    pa.field("status", pa.string(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("tags", pa.list_(pa.string()), nullable=False),
    pa.field("created_at_s", pa.float64(), nullable=False),
    pa.field("gen_start_s", pa.float64(), nullable=False),
    pa.field("gen_end_s", pa.float64(), nullable=False),
]
_V2_FIELDS = [
    *_V1_FIELDS,
    pa.field("episode_id", pa.string(), nullable=False),
    pa.field("branch", pa.int32(), nullable=False),
]
TRAJECTORY_SCHEMA = pa.schema(
    [
        *_V2_FIELDS,
        pa.field("routes", pa.list_(pa.uint8()), nullable=False),
        pa.field("route_versions", pa.list_(pa.int32()), nullable=False),
        pa.field("route_layers", pa.int32(), nullable=False),
        pa.field("route_top_k", pa.int32(), nullable=False),
        pa.field("route_itemsize", pa.int8(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)
"""Schema v3 (what this build writes). Change a column and you bump SCHEMA_VERSION."""
SCHEMAS = {
    1: pa.schema(_V1_FIELDS, metadata={SCHEMA_VERSION_KEY: b"1"}),
    2: pa.schema(_V2_FIELDS, metadata={SCHEMA_VERSION_KEY: b"2"}),
    SCHEMA_VERSION: TRAJECTORY_SCHEMA,
}
"""Every schema this build reads, by version (`READABLE_SCHEMA_VERSIONS`); others are refused."""

_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression=COMPRESSION)
_INT32_MAX = np.iinfo(np.int32).max


class CodecError(ValueError):
    """Bytes that are not a trajectory group of a schema this build reads. `reason`: `decode_error` or `schema_mismatch`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def group_to_record_batch(group: TrajectoryGroup) -> pa.RecordBatch:
    """The group as one Arrow record batch (numpy buffers are wrapped, not copied)."""
    if group.num_tokens > _INT32_MAX:
        raise TrajectoryValidationError(
            f"{group.num_tokens} tokens exceed Arrow list offsets (int32)", group_id=group.group_id, column="tokens"
        )
    offsets = pa.array(group.offsets.astype(np.int32))
    n = group.num_samples
    columns = {
        "trajectory_id": pa.array(group.trajectory_ids, pa.string()),
        "group_id": pa.array([group.group_id] * n, pa.string()),
        "prompt_id": pa.array([group.prompt_id] * n, pa.string()),
        "generator_id": pa.array([group.generator_id] * n, pa.string()),
        **{name: pa.ListArray.from_arrays(offsets, pa.array(getattr(group, name))) for name in TOKEN_COLUMNS},
        "min_version": pa.array(group.min_version, pa.int32()),
        "max_version": pa.array(group.max_version, pa.int32()),
        "reward": pa.array(group.reward, pa.float32(), mask=np.isnan(group.reward)),
        "reward_source": pa.array(group.reward_source, pa.string()),
        "status": pa.array(group.status, pa.string()),
        "finish_reason": pa.array(group.finish_reason, pa.string()),
        "tags": pa.array([list(t) for t in group.tags], pa.list_(pa.string())),
        "created_at_s": pa.array(group.created_at_s, pa.float64()),
        "gen_start_s": pa.array(group.gen_start_s, pa.float64()),
        "gen_end_s": pa.array(group.gen_end_s, pa.float64()),
        "episode_id": pa.array(group.episode_ids, pa.string()),
        "branch": pa.array(group.branches, pa.int32()),
        **_route_columns(group, offsets),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=TRAJECTORY_SCHEMA)


def _route_columns(group: TrajectoryGroup, offsets: pa.Array) -> dict[str, pa.Array]:
    """The routes as bytes per sample (offsets scaled by a position's width in bytes), or empty rows (dense)."""
    n = group.num_samples
    routes = group.routes
    if routes is None or group.route_versions is None:
        empty = pa.array(np.zeros(n + 1, np.int32))
        dims = (0, 0, 0)
        route_bytes = pa.ListArray.from_arrays(empty, pa.array(np.zeros(0, np.uint8)))
        versions = pa.ListArray.from_arrays(empty, pa.array(np.zeros(0, np.int32)))
    else:
        _, layers, top_k = routes.shape
        dims = (layers, top_k, routes.dtype.itemsize)
        width = layers * top_k * routes.dtype.itemsize
        if group.num_tokens * width > _INT32_MAX:
            raise TrajectoryValidationError(
                f"{group.num_tokens * width} route bytes exceed Arrow list offsets (int32)",
                group_id=group.group_id,
                column="routes",
            )
        byte_offsets = pa.array(group.offsets.astype(np.int32) * width)
        flat = np.ascontiguousarray(routes, dtype=routes.dtype.newbyteorder("<")).view(np.uint8).reshape(-1)
        route_bytes = pa.ListArray.from_arrays(byte_offsets, pa.array(flat))
        versions = pa.ListArray.from_arrays(offsets, pa.array(group.route_versions))
    return {
        "routes": route_bytes,
        "route_versions": versions,
        "route_layers": pa.array(np.full(n, dims[0], np.int32)),
        "route_top_k": pa.array(np.full(n, dims[1], np.int32)),
        "route_itemsize": pa.array(np.full(n, dims[2], np.int8)),
    }


def encode_group(group: TrajectoryGroup) -> bytes:
    """Arrow IPC stream bytes (schema + one batch, zstd-compressed buffers) of a validated group."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TRAJECTORY_SCHEMA, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(group_to_record_batch(group))
    return sink.getvalue().to_pybytes()


def decode_group(
    data: bytes | memoryview | pa.Buffer, *, validate: bool = True, max_decoded_bytes: int = MAX_DECODED_BYTES
) -> TrajectoryGroup:
    """Decode one message into a group whose arrays are numpy views of the decompressed Arrow buffers.

    Raises `CodecError` (not a group of a readable schema, or one that would inflate past `max_decoded_bytes`: reason
    `too_large`, decided from the IPC metadata before anything is decompressed) or
    `TrajectoryValidationError` (a group that breaks an invariant). `validate=False` skips only the
    semantic checks of `validate_group`; structural checks (schema, Arrow buffer bounds, equal list
    lengths) always run because the numpy views rely on them.
    """
    buffer = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    schema_message, batch_message = _stream_messages(buffer)  # the stream is parsed once, for both steps
    decoded = _inflated_size(batch_message)
    if decoded > max_decoded_bytes:
        raise CodecError("too_large", f"the record batch inflates to {decoded} bytes, over the {max_decoded_bytes} cap")
    try:
        schema = pa.ipc.read_schema(schema_message)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise CodecError("decode_error", f"not a readable Arrow IPC schema: {exc}") from exc
    check_schema(schema)  # before anything is decompressed
    try:
        batch = pa.ipc.read_record_batch(batch_message, schema)
    except (pa.ArrowException, ValueError, MemoryError, OSError) as exc:
        raise CodecError("decode_error", f"not a readable Arrow IPC stream: {exc}") from exc
    return group_from_record_batch(batch, validate=validate)


def inflated_size(data: pa.Buffer) -> int:
    """Bytes the stream's one record batch takes once decompressed, read from the IPC metadata alone.

    Each compressed Arrow buffer starts with its uncompressed length (int64, -1 = stored raw), and the
    batch's flatbuffer metadata says where each buffer lies in the body: so a small message that would
    inflate to gigabytes is refused before a byte is decompressed. A stream with other than one record
    batch is refused here too, without decoding any.
    """
    return _inflated_size(_stream_messages(data)[1])


def _stream_messages(data: pa.Buffer) -> tuple[pa.ipc.Message, pa.ipc.Message]:
    """The schema message and the one record batch message of a stream (anything else: `CodecError`)."""
    try:
        messages = list(pa.ipc.MessageReader.open_stream(data))
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise CodecError("decode_error", f"not a readable Arrow IPC stream: {exc}") from exc
    kinds = [m.type for m in messages]
    if kinds != ["schema", "record batch"]:
        raise CodecError("decode_error", f"expected exactly one record batch after the schema, got {kinds}")
    return messages[0], messages[1]


def _inflated_size(batch: pa.ipc.Message) -> int:
    try:  # views of the message's buffers, not copies of its body
        return _batch_body_size(memoryview(batch.metadata), memoryview(batch.body))
    except (struct.error, IndexError) as exc:
        raise CodecError("decode_error", f"malformed record batch metadata: {exc}") from exc


def _batch_body_size(meta: memoryview, body: memoryview) -> int:
    """Sum of the uncompressed sizes of a RecordBatch message's buffers (Arrow `Message.fbs`, `Schema.fbs`)."""
    root = _offset(meta, 0)
    header = _field(meta, root, _MESSAGE_HEADER)
    buffers = _field(meta, header, _RECORD_BATCH_BUFFERS)
    if not header or not buffers:
        raise CodecError("decode_error", "record batch metadata has no buffer list")
    compressed = bool(_field(meta, header, _RECORD_BATCH_COMPRESSION))
    total = 0
    for index in range(struct.unpack_from("<I", meta, buffers)[0]):
        offset, length = struct.unpack_from("<qq", meta, buffers + 4 + 16 * index)
        if offset < 0 or length < 0 or offset + length > len(body):
            raise CodecError("decode_error", f"buffer {index} lies outside the message body")
        if length == 0 or not compressed:
            total += length
            continue
        if length < 8:
            raise CodecError("decode_error", f"compressed buffer {index} is shorter than its length prefix")
        size = struct.unpack_from("<q", body, offset)[0]
        if size < -1:
            raise CodecError("decode_error", f"buffer {index} claims {size} uncompressed bytes")
        total += length - 8 if size == -1 else size
    return total


_MESSAGE_HEADER = 2
"""Field index of `Message.header` (after `version`, `header_type`)."""
_RECORD_BATCH_BUFFERS = 2
"""Field index of `RecordBatch.buffers` (after `length`, `nodes`)."""
_RECORD_BATCH_COMPRESSION = 3
"""Field index of `RecordBatch.compression`: absent when the buffers are stored raw."""


def _offset(buf: memoryview, pos: int) -> int:
    """Follow the flatbuffer uoffset stored at `pos` (hostile offsets that leave the buffer are refused)."""
    target = pos + struct.unpack_from("<I", _within(buf, pos), pos)[0]
    return _within(buf, target) and target


def _within(buf: memoryview, pos: int) -> memoryview:
    if not 0 <= pos < len(buf):
        raise CodecError("decode_error", f"record batch metadata points outside itself ({pos})")
    return buf


def _field(buf: memoryview, table: int, index: int) -> int:
    """Position of the object an offset field of a flatbuffer table points to; 0 if the field is absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    slot = 4 + 2 * index
    if slot >= struct.unpack_from("<H", _within(buf, vtable), vtable)[0]:
        return 0
    at = struct.unpack_from("<H", buf, vtable + slot)[0]
    return _offset(buf, table + at) if at else 0


def check_schema(schema: pa.Schema) -> int:
    """The schema's version, or `CodecError('schema_mismatch')` unless it is a trajectory schema this build reads."""
    version = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    known = {str(v).encode(): v for v in READABLE_SCHEMA_VERSIONS}
    if version not in known:
        raise CodecError(
            "schema_mismatch", f"schema version {version!r}, this reader understands {list(READABLE_SCHEMA_VERSIONS)}"
        )
    number = known[version]
    reference = SCHEMAS[number]
    if not schema.equals(reference, check_metadata=False):
        try:
            expected = {f.name: f.type for f in reference}
            diffs = [f"{f.name}: {f.type}" for f in schema if expected.get(f.name) != f.type]
            detail = f"unexpected {diffs}, missing {sorted(set(expected) - set(schema.names))}"
        except UnicodeDecodeError:  # hostile bytes in field names
            detail = "field names are not UTF-8"
        raise CodecError("schema_mismatch", f"columns differ from schema v{number} ({detail})")
    return number


def group_from_record_batch(batch: pa.RecordBatch, *, validate: bool = True) -> TrajectoryGroup:
    """Build a group from one batch (all rows one group); see `decode_group` for errors."""
    version = check_schema(batch.schema)
    try:
        batch.validate(full=True)
    except pa.ArrowException as exc:
        raise CodecError("decode_error", f"invalid Arrow data: {exc}") from exc
    if batch.num_rows == 0:
        raise TrajectoryValidationError("a group needs at least one sample")
    for name in SCHEMAS[version].names:
        col = batch.column(name)
        if name != "reward" and col.null_count:
            raise CodecError("decode_error", f"column {name!r} has {col.null_count} nulls")
    group_id = _single_value(batch, "group_id")
    offsets, values = _token_columns(batch, group_id)
    col = batch.column
    group = TrajectoryGroup(
        group_id=group_id,
        prompt_id=_single_value(batch, "prompt_id"),
        generator_id=_single_value(batch, "generator_id"),
        trajectory_ids=tuple(col("trajectory_id").to_pylist()),
        offsets=offsets,
        **values,
        min_version=col("min_version").to_numpy(),
        max_version=col("max_version").to_numpy(),
        reward=col("reward").to_numpy(zero_copy_only=False).astype(np.float32, copy=False),
        reward_source=tuple(col("reward_source").to_pylist()),
        status=tuple(col("status").to_pylist()),
        finish_reason=tuple(col("finish_reason").to_pylist()),
        tags=tuple(tuple(t) for t in col("tags").to_pylist()),
        created_at_s=col("created_at_s").to_numpy(),
        gen_start_s=col("gen_start_s").to_numpy(),
        gen_end_s=col("gen_end_s").to_numpy(),
        episode_ids=tuple(col("episode_id").to_pylist()) if version >= 2 else (),
        branches=col("branch").to_numpy() if version >= 2 else None,
        **(_routes(batch, offsets, group_id) if version >= 3 else {}),
    )
    if validate:
        validate_group(group)
    return group


def _single_value(batch: pa.RecordBatch, name: str) -> str:
    values = set(batch.column(name).to_pylist())
    if len(values) != 1:
        raise TrajectoryValidationError(f"rows of one group disagree: {sorted(values)[:4]}", column=name)
    return values.pop()


def _token_columns(batch: pa.RecordBatch, group_id: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Shared int64 offsets (rebased to 0) and zero-copy flat values of the four per-token columns."""
    offsets: np.ndarray | None = None
    values: dict[str, np.ndarray] = {}
    for name in TOKEN_COLUMNS:
        col: pa.ListArray = batch.column(name)
        raw = col.offsets.to_numpy()
        flat = col.values
        if flat.null_count:
            raise CodecError("decode_error", f"column {name!r} has null elements")
        start, end = int(raw[0]), int(raw[-1])
        values[name] = flat.to_numpy(zero_copy_only=True)[start:end]
        rebased = raw.astype(np.int64) - start
        if offsets is None:
            offsets = rebased
        elif not np.array_equal(offsets, rebased):
            lengths, theirs = np.diff(offsets), np.diff(rebased)
            sample = int(np.flatnonzero(lengths != theirs)[0])
            raise TrajectoryValidationError(
                f"length {theirs[sample]} != tokens length {lengths[sample]}",
                group_id=group_id,
                sample=sample,
                column=name,
            )
    assert offsets is not None
    return offsets, values


def _routes(batch: pa.RecordBatch, offsets: np.ndarray, group_id: str) -> dict[str, np.ndarray | None]:
    """Zero-copy ``routes`` ``[tokens, layers, top_k]`` and ``route_versions`` of a schema-3 batch (None for dense)."""
    dims = {name: set(batch.column(name).to_pylist()) for name in ("route_layers", "route_top_k", "route_itemsize")}
    for name, values in dims.items():
        if len(values) != 1:
            raise TrajectoryValidationError(f"rows of one group disagree: {sorted(values)[:4]}", column=name)
    layers, top_k, itemsize = (dims[name].pop() for name in ("route_layers", "route_top_k", "route_itemsize"))
    route_col: pa.ListArray = batch.column("routes")
    version_col: pa.ListArray = batch.column("route_versions")
    raw_bytes, raw_versions = route_col.offsets.to_numpy(), version_col.offsets.to_numpy()
    if itemsize == 0:
        if raw_bytes[-1] != raw_bytes[0] or raw_versions[-1] != raw_versions[0] or layers or top_k:
            raise TrajectoryValidationError(
                "routes present but route_itemsize is 0", group_id=group_id, column="routes"
            )
        return {"routes": None, "route_versions": None}
    if itemsize not in (1, 2) or layers < 1 or top_k < 1 or layers * top_k * itemsize > MAX_ROUTE_BYTES_PER_TOKEN:
        raise TrajectoryValidationError(
            f"route layout {layers} x {top_k} of {itemsize}-byte ids is not one this build reads",
            group_id=group_id,
            column="routes",
        )
    width = layers * top_k * itemsize
    for name, raw, scale in (("routes", raw_bytes, width), ("route_versions", raw_versions, 1)):
        lengths = np.diff(raw.astype(np.int64))
        bad = np.flatnonzero(lengths != np.diff(offsets) * scale)
        if bad.size:
            sample = int(bad[0])
            raise TrajectoryValidationError(
                f"length {lengths[sample]} != tokens length {int(np.diff(offsets)[sample])} x {scale}",
                group_id=group_id,
                sample=sample,
                column=name,
            )
    flat = route_col.values.to_numpy(zero_copy_only=True)[int(raw_bytes[0]) : int(raw_bytes[-1])]
    dtype = np.dtype(np.uint8) if itemsize == 1 else np.dtype("<u2")
    routes = flat.view(dtype).reshape(-1, layers, top_k)
    versions = version_col.values.to_numpy(zero_copy_only=True)[int(raw_versions[0]) : int(raw_versions[-1])]
    return {"routes": routes if dtype.isnative else routes.astype(np.uint16), "route_versions": versions}


def write_parquet(groups: Iterable[TrajectoryGroup], path: str | Path) -> int:
    """Write groups (rows of a group stay contiguous) to one zstd Parquet file; returns the row count."""
    batches = [group_to_record_batch(g) for g in groups]
    table = pa.Table.from_batches(batches, schema=TRAJECTORY_SCHEMA)
    pq.write_table(table, str(path), compression=PARQUET_COMPRESSION)
    return table.num_rows


def read_parquet(path: str | Path, *, validate: bool = True) -> Iterator[TrajectoryGroup]:
    """Groups of a file written by `write_parquet`, in file order (consecutive rows with one group_id)."""
    table = pq.read_table(str(path))
    check_schema(table.schema)  # schema 1 files (written before episodes) read too
    table = table.combine_chunks()
    group_ids = table.column("group_id").to_numpy(zero_copy_only=False)
    if len(group_ids) == 0:
        return
    starts = np.flatnonzero(np.r_[True, group_ids[1:] != group_ids[:-1]])
    ends = np.r_[starts[1:], len(group_ids)]
    for start, end in zip(starts, ends, strict=True):
        batch = table.slice(int(start), int(end - start)).to_batches()[0]
        yield group_from_record_batch(batch, validate=validate)
