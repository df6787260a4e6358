"""The weight-delta codec: exact round trips for any bits, and loud failure for any bad blob."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.tools.bench.weights_workload import codec_stats, synthetic_versions, transformer_shapes
from storage.delta_codec import (
    CHUNK_ELEMS,
    apply_delta,
    changed_fraction,
    encode_delta,
    encode_xor_zstd_baseline,
    entropy_bound_bytes,
    index_value_baseline_bytes,
    tensor_bits,
)
from storage.delta_streams import decode_positions, encode_positions, from_ordered, to_ordered

_PATTERNS = ("none", "all", "sparse", "runs", "ends", "ulp")


def _pair(width: int, size: int, pattern: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Old bits and new bits of `size` elements that differ where `pattern` says."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(f"<u{width}")
    old = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    changed = np.zeros(size, dtype=bool)
    if pattern == "all":
        changed[:] = True
    elif pattern in ("sparse", "ulp"):
        changed = rng.random(size) < rng.choice([0.001, 0.02, 0.3, 0.7])
    elif pattern == "runs":
        for start in rng.integers(0, max(size, 1), 3):
            changed[start : start + rng.integers(1, 50)] = True
    elif pattern == "ends" and size:
        changed[[0, -1]] = True
    new = old.copy()
    if pattern == "ulp":  # the RL case: a one-ulp move up or down, wrapping at the ends of the range
        new[changed] += rng.choice(np.array([1, np.iinfo(dtype).max], dtype=dtype), int(changed.sum()))
    else:
        new[changed] ^= rng.integers(1, np.iinfo(dtype).max, int(changed.sum()), dtype=dtype, endpoint=True)
    return old, new


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    width=st.sampled_from([2, 4]),
    size=st.one_of(st.integers(0, 70), st.integers(0, 5000)),
    pattern=st.sampled_from(_PATTERNS),
    chunk_elems=st.sampled_from([1, 7, 256, CHUNK_ELEMS]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_bit_exact_and_independent_of_threads(
    width: int, size: int, pattern: str, chunk_elems: int, seed: int
) -> None:
    old, new = _pair(width, size, pattern, seed)
    blob = encode_delta(old, new, chunk_elems=chunk_elems)
    assert encode_delta(old, new, threads=3, chunk_elems=chunk_elems) == blob
    for threads in (1, 3):
        target = old.copy()
        apply_delta(target, blob, threads=threads)
        np.testing.assert_array_equal(target, new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_float_tensors_round_trip_through_their_bits_in_place(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(10_001, generator=generator) * 0.02
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40])
    old = torch.cat([master, special]).to(dtype)
    new = torch.cat([master + 1e-5 * torch.randn(10_001, generator=generator), special.flip(0)]).to(dtype)
    blob = encode_delta(tensor_bits(old), tensor_bits(new))
    apply_delta(tensor_bits(old), blob, threads=2)
    assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))


def test_gap_larger_than_2_pow_24_round_trips() -> None:
    size = (1 << 25) + 5
    old = np.zeros(size, dtype=np.uint16)
    new = old.copy()
    new[:1000] = 1  # dense start keeps the Rice parameter small, so the big gap takes the escape path
    new[-1] = 7
    blob = encode_delta(old, new, chunk_elems=1 << 26)
    assert len(blob) < 1000
    apply_delta(old, blob)
    np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("gaps", [[0, 0, 0], [2**33, 5, 2**40], [3] * 1000 + [2**32 + 1], [2**24 + 1], [700] * 50])
def test_position_coder_round_trips_gaps_beyond_2_pow_32(gaps: list[int]) -> None:
    positions = np.cumsum(np.array(gaps, dtype=np.int64) + 1) - 1
    shift, escapes, planes = encode_positions(positions)
    decoded = decode_positions(shift, np.frombuffer(escapes, "<u8"), planes, positions.size, int(positions[-1]) + 1)
    np.testing.assert_array_equal(decoded, positions)


def test_ordered_mapping_is_a_bijection_that_sorts_like_floats() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    ordered = to_ordered(bits)
    assert np.unique(ordered).size == 1 << 16
    np.testing.assert_array_equal(from_ordered(ordered), bits)
    floats = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    finite = np.isfinite(floats)
    order = np.argsort(ordered[finite], kind="stable")
    assert np.all(np.diff(floats[finite][order]) >= 0)


def _ulp_blob() -> tuple[np.ndarray, np.ndarray, bytes]:
    old, new = _pair(2, 20_000, "ulp", seed=1)
    return old, new, encode_delta(old, new, chunk_elems=4096)


def test_every_single_byte_corruption_raises_and_leaves_target_untouched() -> None:
    old, _, blob = _ulp_blob()
    for index in range(len(blob)):
        corrupted = bytearray(blob)
        corrupted[index] ^= 0x10
        target = old.copy()
        with pytest.raises(ValueError):
            apply_delta(target, bytes(corrupted))
        np.testing.assert_array_equal(target, old)


def test_truncated_or_padded_blob_raises() -> None:
    old, _, blob = _ulp_blob()
    for length in [0, 3, 20, len(blob) // 2, len(blob) - 1]:
        with pytest.raises(ValueError):
            apply_delta(old.copy(), blob[:length])
    with pytest.raises(ValueError, match="trailing"):
        apply_delta(old.copy(), blob + b"\0")


def test_blob_for_another_size_or_width_raises_naming_both() -> None:
    old, _, blob = _ulp_blob()
    with pytest.raises(ValueError, match="20000 elements of 16 bits, target has 19999"):
        apply_delta(old[:-1].copy(), blob)
    with pytest.raises(ValueError, match="target has 10000 of 32"):
        apply_delta(old.view(np.uint32).copy(), blob)
    with pytest.raises(ValueError, match="int16"):
        apply_delta(old.view(np.int16).copy(), blob)
    with pytest.raises(ValueError, match="differ in dtype or size"):
        encode_delta(old, old[:-1])


def test_tensor_bits_is_a_zero_copy_view_and_rejects_other_dtypes() -> None:
    tensor = torch.zeros(4, dtype=torch.bfloat16)
    tensor_bits(tensor)[1] = 0x3F80  # 1.0 in bf16
    assert tensor[1].item() == 1.0
    assert tensor_bits(torch.zeros(3, dtype=torch.float32)).dtype == np.uint32
    with pytest.raises(ValueError, match=r"torch\.int64"):
        tensor_bits(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bits(torch.zeros(4, 4, dtype=torch.float16).t())


def test_sparse_ulp_delta_is_near_entropy_and_beats_baselines() -> None:
    rng = np.random.default_rng(3)
    old = tensor_bits(torch.from_numpy(rng.normal(0, 0.02, 1 << 20).astype(np.float32)).to(torch.bfloat16))
    new = old.copy()
    changed = rng.random(old.size) < 0.015
    new[changed] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), int(changed.sum()))
    delta_bytes = len(encode_delta(old, new))
    assert changed_fraction(old, new) == pytest.approx(0.015, rel=0.05)
    assert delta_bytes <= 1.2 * entropy_bound_bytes(old, new)
    assert delta_bytes < 0.7 * len(encode_xor_zstd_baseline(old, new))
    assert index_value_baseline_bytes(old, new) == int(changed.sum()) * 6


def test_bounds_are_zero_for_identical_and_empty_arrays() -> None:
    old = np.arange(100, dtype=np.uint16)
    assert entropy_bound_bytes(old, old) == 0.0
    assert changed_fraction(old[:0], old[:0]) == 0.0
    assert index_value_baseline_bytes(old, old) == 0


def test_workload_yields_hf_named_bf16_versions_that_codec_stats_round_trips() -> None:
    shapes = transformer_shapes(200_000)
    assert "model.layers.0.self_attn.q_proj.weight" in shapes
    versions = list(synthetic_versions(200_000, lr=1e-5, steps=2, warmup=2))
    assert len(versions) == 3
    assert all(t.dtype == torch.bfloat16 for t in versions[0].values())
    assert torch.all(versions[0]["model.norm.weight"] != 0)
    stats = codec_stats(versions[0], versions[1], timing_repeats=1)
    assert stats["bit_exact"]
    assert 0 < stats["changed_fraction"] < 0.5
    assert stats["delta_bytes"] < stats["xor_zstd1_bytes"] < stats["full_bytes"]


def test_a_moe_workload_has_hf_expert_tensors_whose_bytes_codec_stats_counts_apart() -> None:
    shapes = transformer_shapes(400_000, experts=8)
    experts = {name: shape for name, shape in shapes.items() if ".mlp.experts." in name}
    assert len(experts) == 2 * 4 and all(shape[0] == 8 for shape in experts.values())
    assert "model.layers.0.mlp.gate.weight" in shapes and "model.layers.0.mlp.up_proj.weight" not in shapes
    prev, new = list(synthetic_versions(400_000, lr=1e-5, steps=1, warmup=1, experts=8))
    stats = codec_stats(prev, new, timing_repeats=1)
    expert_elements = sum(math.prod(shape) for shape in experts.values())
    assert stats["expert_full_bytes"] == 2 * expert_elements  # bf16
    assert 0 < stats["expert_delta_bytes"] < stats["delta_bytes"] and stats["bit_exact"]
