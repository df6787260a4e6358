"""Arrow IPC codec: lossless round trip into numpy views, and clean errors for every kind of bad bytes."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.wire.codec import (
    SCHEMAS,
    TRAJECTORY_SCHEMA,
    CodecError,
    decode_group,
    encode_group,
    group_to_record_batch,
    inflated_size,
    read_parquet,
    write_parquet,
)
from pipeline.wire.trajectory import Sample, TrajectoryGroup, TrajectoryValidationError


def _sample(rng: np.random.Generator, n: int = 64, prompt: int = 8, reward: float | None = 1.0) -> Sample:
    mask = np.r_[np.zeros(prompt, np.uint8), np.ones(n - prompt, np.uint8)]
    versions = np.where(mask == 1, 3, -1).astype(np.int32)
    versions[prompt + (n - prompt) // 2 :] = 4
    return Sample(
        tokens=rng.integers(0, 151_936, n).astype(np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -rng.exponential(0.3, n), 0).astype(np.float32),
        versions=versions,
        reward=reward,
        reward_source="verifier" if reward is not None else "none",
        tags=("math", "easy"),
        finish_reason="stop",
        gen_start_s=1.0,
        gen_end_s=2.0,
    )


def _group(group_id: str = "g-1", num_samples: int = 4, seed: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    samples = [_sample(rng, n=32 + 8 * i, reward=None if i == 1 else float(i)) for i in range(num_samples)]
    return TrajectoryGroup.from_samples(group_id=group_id, prompt_id="p-1", generator_id="gen-0", samples=samples)


def _ipc(batch: pa.RecordBatch, compression: str | None = "zstd") -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _assert_same(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    for name in (
        "group_id",
        "prompt_id",
        "generator_id",
        "trajectory_ids",
        "reward_source",
        "status",
        "finish_reason",
        "tags",
    ):
        assert getattr(a, name) == getattr(b, name), name
    for name in (
        "offsets",
        "tokens",
        "loss_mask",
        "logprobs",
        "versions",
        "min_version",
        "max_version",
        "created_at_s",
        "gen_start_s",
        "gen_end_s",
    ):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(np.isnan(a.reward), np.isnan(b.reward))


def test_round_trip_is_lossless_and_hands_out_read_only_numpy():
    g = _group()
    out = decode_group(encode_group(g))
    _assert_same(g, out)
    assert isinstance(out.tokens, np.ndarray) and out.tokens.dtype == np.int32
    assert not out.tokens.flags.writeable  # a view of the Arrow buffer, not a copy
    assert out.sample(1).reward is None and out.sample(2).reward == 2.0


def test_encoded_size_is_compressed():
    rng = np.random.default_rng(1)
    g = TrajectoryGroup.from_samples(
        group_id="g", prompt_id="p", generator_id="x", samples=[_sample(rng, n=4096, prompt=512) for _ in range(8)]
    )
    assert len(encode_group(g)) / g.num_tokens < 7.0


def test_wrong_schema_is_a_schema_mismatch():
    batch = pa.record_batch([pa.array([1, 2, 3])], names=["tokens"])
    with pytest.raises(CodecError) as info:
        decode_group(_ipc(batch))
    assert info.value.reason == "schema_mismatch"
    batch = group_to_record_batch(_group()).replace_schema_metadata({b"leeway.schema_version": b"4"})
    with pytest.raises(CodecError, match="schema version"):
        decode_group(_ipc(batch))
    batch = group_to_record_batch(_group()).replace_schema_metadata({b"leeway.schema_version": b"1"})
    with pytest.raises(CodecError, match="columns differ from schema v1"):  # v3 columns under a v1 label
        decode_group(_ipc(batch))


def test_episode_ids_and_branches_round_trip_and_schema_1_messages_still_read(tmp_path) -> None:
    rng = np.random.default_rng(3)
    samples = [
        dataclasses.replace(_sample(rng, n=12, prompt=4), episode_id=f"ep-{i // 2}", branch=i % 2) for i in range(4)
    ]
    g = TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=samples)
    out = decode_group(encode_group(g))
    assert out.episode_ids == ("ep-0", "ep-0", "ep-1", "ep-1") and out.branches.tolist() == [0, 1, 0, 1]
    assert out.sample(3).episode_id == "ep-1" and out.sample(3).branch == 1
    write_parquet([g], tmp_path / "g.parquet")
    (back,) = read_parquet(tmp_path / "g.parquet")
    assert back.episode_ids == g.episode_ids and back.branches.tolist() == [0, 1, 0, 1]
    # a message written by a schema-1 build: the old columns, the old label
    v2 = group_to_record_batch(g)
    v1 = pa.record_batch([v2.column(name) for name in SCHEMAS[1].names], schema=SCHEMAS[1])
    old = decode_group(_ipc(v1))
    assert old.episode_ids == ("",) * 4 and old.branches.tolist() == [0] * 4
    np.testing.assert_array_equal(old.tokens, g.tokens)
    pq.write_table(pa.Table.from_batches([v1]), tmp_path / "old.parquet")
    (old_file,) = read_parquet(tmp_path / "old.parquet")
    assert old_file.trajectory_ids == g.trajectory_ids and old_file.episode_ids == ("",) * 4


def test_a_negative_branch_or_a_bad_episode_id_names_sample_and_column() -> None:
    rng = np.random.default_rng(4)
    bad_branch = [_sample(rng, n=6, prompt=2), dataclasses.replace(_sample(rng, n=6, prompt=2), branch=-1)]
    with pytest.raises(TrajectoryValidationError, match="sample 1 column 'branch'"):
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=bad_branch)
    bad_episode = [dataclasses.replace(_sample(rng, n=6, prompt=2), episode_id="a/b")]
    with pytest.raises(TrajectoryValidationError, match="sample 0 column 'episode_id'"):
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=bad_episode)


def test_disagreeing_list_lengths_name_sample_and_column():
    batch = group_to_record_batch(_group())
    logprobs = batch.column("logprobs").to_pylist()
    logprobs[2] = logprobs[2][:-3]
    bad = batch.set_column(
        batch.schema.get_field_index("logprobs"),
        TRAJECTORY_SCHEMA.field("logprobs"),
        pa.array(logprobs, pa.list_(pa.float32())),
    )
    with pytest.raises(TrajectoryValidationError) as info:
        decode_group(_ipc(bad))
    assert info.value.sample == 2 and info.value.column == "logprobs"


def test_huge_declared_lengths_and_offsets_are_refused_before_numpy_sees_them():
    """Patch every (0, num_tokens) int32 pair: list lengths in the metadata and offsets in the body."""
    g = _group(num_samples=1)
    data = _ipc(group_to_record_batch(g), compression=None)
    pattern = struct.pack("<ii", 0, g.num_tokens)
    hits = [i for i in range(len(data) - 7) if data[i : i + 8] == pattern]
    refused = 0
    for at in hits:
        bad = data[:at] + struct.pack("<ii", 0, 2**31 - 1) + data[at + 8 :]
        try:
            _assert_same(g, decode_group(bad))  # a pair that was not a length: harmless
        except CodecError as exc:
            assert exc.reason == "decode_error"
            refused += 1
    assert refused >= 8  # 4 declared child lengths + 4 offsets buffers at least


def test_huge_declared_decompressed_length_is_a_decode_error():
    g = _group(num_samples=1)
    data = bytearray(encode_group(g))
    declared = struct.pack("<q", g.num_tokens * 4)  # the zstd tokens buffer's uncompressed-length prefix
    at = data.find(declared)
    assert at > 0
    data[at : at + 8] = struct.pack("<q", 2**40)
    with pytest.raises(CodecError):
        decode_group(bytes(data))


def test_a_decompression_bomb_is_refused_from_the_metadata_before_inflating():
    """A few KB of zstd that would inflate to 13 MB: refused as `too_large` under a 1 MB cap."""
    bomb = _zeros_group(1 << 20)
    data = encode_group(bomb)
    assert len(data) < 64 * 1024
    assert inflated_size(pa.py_buffer(data)) >= bomb.num_tokens * 13
    with pytest.raises(CodecError) as refused:
        decode_group(data, max_decoded_bytes=1024 * 1024)
    assert refused.value.reason == "too_large"
    assert decode_group(data).num_tokens == bomb.num_tokens  # under the default cap it is an honest group


def test_a_declared_terabyte_is_refused_as_too_large_without_allocating_it():
    g = _group(num_samples=1)
    data = bytearray(encode_group(g))
    at = data.find(struct.pack("<q", g.num_tokens * 4))  # the zstd tokens buffer's uncompressed-length prefix
    data[at : at + 8] = struct.pack("<q", 2**40)
    with pytest.raises(CodecError) as refused:
        decode_group(bytes(data))
    assert refused.value.reason == "too_large"


def test_inflated_size_counts_raw_and_compressed_buffers_alike():
    batch = group_to_record_batch(_group())
    raw, packed = _ipc(batch, compression=None), _ipc(batch)
    assert inflated_size(pa.py_buffer(raw)) == inflated_size(pa.py_buffer(packed)) > 0


def _zeros_group(num_tokens: int) -> TrajectoryGroup:
    mask = np.r_[np.zeros(8, np.uint8), np.ones(num_tokens - 8, np.uint8)]
    sample = Sample(
        tokens=np.zeros(num_tokens, np.int32),
        loss_mask=mask,
        logprobs=np.zeros(num_tokens, np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32),
    )
    return TrajectoryGroup.from_samples(group_id="bomb", prompt_id="p", generator_id="gen-0", samples=[sample])


def test_truncated_streams_are_decode_errors():
    data = encode_group(_group())
    for cut in (0, 7, len(data) // 3, len(data) // 2, len(data) - 9):
        with pytest.raises(CodecError):
            decode_group(data[:cut])


def test_two_batches_are_refused():
    batch = group_to_record_batch(_group())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
        w.write_batch(batch)
    with pytest.raises(CodecError, match="exactly one"):
        decode_group(sink.getvalue())


def test_nulls_in_required_columns_are_refused():
    batch = group_to_record_batch(_group())
    status = pa.array([None, "ok", "ok", "ok"], pa.string())
    bad = batch.set_column(batch.schema.get_field_index("status"), TRAJECTORY_SCHEMA.field("status"), status)
    with pytest.raises(CodecError, match="nulls"):
        decode_group(_ipc(bad))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes_raise_only_codec_errors(data):
    with pytest.raises((CodecError, TrajectoryValidationError)):
        decode_group(data)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_corrupted_valid_streams_raise_only_clean_errors(data):
    encoded = bytearray(encode_group(_group(num_samples=2)))
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(encoded) - 1))
        encoded[at] = data.draw(st.integers(0, 255))
    try:
        decode_group(bytes(encoded))
    except (CodecError, TrajectoryValidationError):
        pass  # any outcome but a crash or another exception type is fine; intact bytes may still decode


def test_parquet_round_trip_keeps_groups_in_order(tmp_path):
    groups = [_group(f"g-{i}", num_samples=2 + i % 3, seed=i) for i in range(5)]
    path = tmp_path / "part.parquet"
    assert write_parquet(groups, path) == sum(g.num_samples for g in groups)
    back = list(read_parquet(path))
    assert [g.group_id for g in back] == [g.group_id for g in groups]
    for a, b in zip(groups, back, strict=True):
        _assert_same(a, b)


def _routed(rng: np.random.Generator, sample: Sample, layers: int, top_k: int, dtype: type) -> Sample:
    n = len(sample.tokens)
    experts = 256 if dtype is np.uint8 else 1024
    versions = np.full(n, 3, np.int32)
    versions[n // 2 :], versions[-1] = 4, -1  # the last sampled token was never fed: no route
    routes = rng.integers(0, experts, (n, layers, top_k)).astype(dtype)
    return dataclasses.replace(sample, routes=routes, route_versions=versions)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routes_round_trip_through_ipc_and_parquet_and_older_schemas_read_as_dense(tmp_path, dtype) -> None:
    rng = np.random.default_rng(5)
    samples = [_routed(rng, _sample(rng, n=20 + i, prompt=4), 3, 2, dtype) for i in range(3)]
    samples.append(_sample(rng, n=10, prompt=4))  # a sample without routes in a MoE group: zeros, version -1
    g = TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=samples)
    assert g.routes is not None and g.routes.shape == (g.num_tokens, 3, 2) and g.routes.dtype == dtype
    out = decode_group(encode_group(g))
    _assert_same(g, out)
    np.testing.assert_array_equal(out.routes, g.routes)
    np.testing.assert_array_equal(out.route_versions, g.route_versions)
    assert out.routes.dtype == dtype and not out.routes.flags.writeable  # zero-copy views
    np.testing.assert_array_equal(out.sample(1).routes, samples[1].routes)
    assert out.sample(3).route_versions.tolist() == [-1] * 10 and not out.sample(3).routes.any()
    write_parquet([g, _group()], tmp_path / "g.parquet")
    back, dense = read_parquet(tmp_path / "g.parquet")
    np.testing.assert_array_equal(back.routes, g.routes)
    assert dense.routes is None and dense.route_versions is None
    v2 = pa.record_batch([group_to_record_batch(g).column(name) for name in SCHEMAS[2].names], schema=SCHEMAS[2])
    old = decode_group(_ipc(v2))  # a schema-2 message: no routes
    assert old.routes is None and old.route_versions is None
    np.testing.assert_array_equal(old.tokens, g.tokens)


def test_routes_that_do_not_fit_their_tokens_name_sample_and_column() -> None:
    rng = np.random.default_rng(6)
    good = _routed(rng, _sample(rng, n=12, prompt=4), 2, 2, np.uint8)
    short = dataclasses.replace(good, routes=good.routes[:-1])
    with pytest.raises(TrajectoryValidationError, match="sample 1 column 'routes'"):
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[good, short])
    wide = dataclasses.replace(good, routes=good.routes.astype(np.int32))
    with pytest.raises(TrajectoryValidationError, match="column 'routes'"):
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[wide])
    bad_versions = dataclasses.replace(good, route_versions=np.full(12, -2, np.int32))
    with pytest.raises(TrajectoryValidationError, match="column 'route_versions'"):
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[bad_versions])
    # a message whose route bytes disagree with its tokens is refused, naming the sample
    batch = group_to_record_batch(
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[good, good])
    )
    routes = batch.column("routes")
    cut = pa.ListArray.from_arrays(pa.array([0, 48, 95], pa.int32()), routes.values.slice(0, 95))
    index = batch.schema.get_field_index("routes")
    broken = batch.set_column(index, batch.schema.field(index), cut).replace_schema_metadata(batch.schema.metadata)
    with pytest.raises(TrajectoryValidationError, match="sample 1 column 'routes'"):
        decode_group(_ipc(broken))


def test_a_route_layout_past_the_per_position_bound_is_refused_before_any_size_is_taken_from_it() -> None:
    rng = np.random.default_rng(7)
    good = _routed(rng, _sample(rng, n=12, prompt=4), 2, 2, np.uint8)
    batch = group_to_record_batch(
        TrajectoryGroup.from_samples(group_id="g", prompt_id="p", generator_id="x", samples=[good])
    )
    for name in ("route_layers", "route_top_k"):
        index = batch.schema.get_field_index(name)
        batch = batch.set_column(index, batch.schema.field(index), pa.array([2**31 - 1], pa.int32()))
    batch = batch.replace_schema_metadata(group_to_record_batch(_group()).schema.metadata)
    with pytest.raises(TrajectoryValidationError, match="route layout 2147483647 x 2147483647"):
        decode_group(_ipc(batch))
