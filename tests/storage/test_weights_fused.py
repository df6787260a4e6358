"""The one-pass publish (encode + hash + copy into reused buffers) and apply (apply + undo log + hash)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import storage.publisher as publisher
import storage.subscriber as subscriber
import storage.weights as weights
from storage.filestore import FileStore
from storage.weights import WeightPublisher, WeightPullError, WeightSubscriber
from storage.weights_base import byte_view
from tests.support.stores import FaultyStore

CONFIG = "cfg"


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher, "SEGMENT_ELEMS", 700)


def _versions(count: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Odd sizes on purpose: segments and tensors that end inside an 8-byte word."""
    g = torch.Generator().manual_seed(seed)
    out = [
        {
            "big.weight": (torch.randn(2101, generator=g) * 0.02).bfloat16(),
            "odd.weight": (torch.randn(7, generator=g) * 0.02).bfloat16(),
            "mat.weight": (torch.randn(33, 41, generator=g) * 0.02).bfloat16(),
        }
    ]
    for _ in range(1, count):
        out.append({n: torch.where(torch.rand(t.shape, generator=g) < 0.1, t + 0.01, t) for n, t in out[-1].items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


def test_the_facade_reexports_the_public_names() -> None:
    assert weights.WeightPublisher is publisher.WeightPublisher
    assert weights.WeightSubscriber is subscriber.WeightSubscriber
    assert weights.PullPlan is subscriber.PullPlan
    for name in weights.__all__:
        assert hasattr(weights, name), name


def test_a_publisher_keeps_private_copies_so_callers_may_reuse_their_tensors(tmp_path: Path) -> None:
    versions = _versions(4)
    store = FileStore(tmp_path)
    live = _clone(versions[0])  # one dict the "trainer" updates in place, as an optimizer does
    with WeightPublisher(store, "r", model_config_hash=CONFIG, full_every=100) as pub:
        with WeightSubscriber(store, "r") as sub:
            for v, tensors in enumerate(versions):
                for name, t in tensors.items():
                    live[name].copy_(t)
                assert pub.publish(v, live).kind == ("full" if v == 0 else "delta")
                # a publisher that kept `live` as its base would diff the next version against itself: an
                # empty delta, which the subscriber's hash check refuses
                assert sub.pull(v) == v and _same(sub.tensors, tensors)


def test_delta_publishes_reuse_the_buffers_of_the_version_before_last(tmp_path: Path) -> None:
    versions = _versions(5)
    with WeightPublisher(FileStore(tmp_path), "r", model_config_hash=CONFIG, full_every=100) as pub:
        ptrs = []
        for v, tensors in enumerate(versions):
            pub.publish(v, tensors)
            ptrs.append({n: t.data_ptr() for n, t in pub._prev.items()})  # type: ignore[union-attr]
        assert ptrs[3] == ptrs[1] and ptrs[4] == ptrs[2] and ptrs[2] != ptrs[1]


def test_converted_inputs_are_published_in_the_served_dtype(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(40, 30, generator=g, requires_grad=True), "t": torch.randn(30, 40, generator=g).t()}
    store = FileStore(tmp_path)
    with WeightPublisher(store, "r", model_config_hash=CONFIG) as pub, WeightSubscriber(store, "r") as sub:
        for v in range(3):
            with torch.no_grad():
                base["w"].add_(0.05)
            pub.publish(v, base)  # fp32, one of them not contiguous: converted to bf16 copies
            sub.pull(v)
            assert _same(sub.tensors, {n: t.detach().bfloat16().contiguous() for n, t in base.items()})


def test_a_failed_upload_keeps_the_base_so_the_retry_is_still_a_delta(tmp_path: Path) -> None:
    versions = _versions(4)
    store = FileStore(tmp_path)
    down = [False]
    flaky = FaultyStore(
        store, lambda method, key: OSError("store unavailable") if down[0] and method == "put" else None
    )
    with WeightPublisher(flaky, "r", model_config_hash=CONFIG, full_every=100) as pub:
        for v in range(3):
            pub.publish(v, versions[v])
        down[0] = True
        with pytest.raises(OSError, match="store unavailable"):
            pub.publish(3, versions[3])
        down[0] = False
        assert pub.publish(3, versions[3]).kind == "delta"
    with WeightSubscriber(store, "r") as sub:
        sub.pull(2)
        assert sub.plan(2, 3).versions == (3,) and sub.pull(3) == 3 and _same(sub.tensors, versions[3])


@pytest.mark.parametrize("offset", [0, 3, 8])
@pytest.mark.parametrize("nbytes", [0, 5, 8, 64, 1003])
def test_the_undo_log_restores_any_segment_exactly(offset: int, nbytes: int) -> None:
    rng = np.random.default_rng(offset * 1000 + nbytes)
    tensor = torch.from_numpy(rng.integers(0, 1 << 16, size=600, dtype=np.uint16)).view(torch.bfloat16)
    original = tensor.clone()
    raw = byte_view(tensor)
    before = raw[offset : offset + nbytes].copy()
    flip = rng.random(nbytes) < 0.2
    raw[offset : offset + nbytes][flip] ^= rng.integers(1, 256, size=int(flip.sum()), dtype=np.uint8)
    change = subscriber._change("t", offset, raw[offset : offset + nbytes], before)
    assert change.word_positions.size + change.tail_positions.size <= int(flip.sum())  # O(changes)
    subscriber._rollback({"t": tensor}, [change])
    assert torch.equal(tensor.view(torch.int16), original.view(torch.int16))


def test_a_delta_that_fails_after_writing_leaves_the_tensors_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = _versions(3)
    store = FileStore(tmp_path)
    with WeightPublisher(store, "r", model_config_hash=CONFIG, full_every=100) as pub:
        for v, tensors in enumerate(versions):
            pub.publish(v, tensors)
    real_apply = subscriber.apply_delta
    calls = []

    def apply_then_fail_on_odd(bits: np.ndarray, blob: memoryview) -> None:
        calls.append(bits.size)
        real_apply(bits, blob)
        if bits.size == 7:  # the odd tensor: written, then rejected, like a chunk failing late
            bits[:] = 0xFFFF
            raise ValueError("late chunk failure")

    with WeightSubscriber(store, "r") as sub:
        sub.pull(0)
        held = _clone(sub.tensors)
        monkeypatch.setattr(subscriber, "apply_delta", apply_then_fail_on_odd)
        with pytest.raises(WeightPullError) as err:
            sub.pull(2)
        assert err.value.tensor == "odd.weight" and sub.version == 0
        assert _same(sub.tensors, held)
        assert len(calls) > 3  # other tensors were applied in the same version before the rollback
        monkeypatch.setattr(subscriber, "apply_delta", real_apply)
        assert sub.pull(2) == 2 and _same(sub.tensors, versions[2])


def test_a_silently_wrong_apply_is_caught_by_the_hash_retried_then_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = _versions(3)
    store = FileStore(tmp_path)
    with WeightPublisher(store, "r", model_config_hash=CONFIG, full_every=100) as pub:
        for v, tensors in enumerate(versions):
            pub.publish(v, tensors)
    real_apply = subscriber.apply_delta
    mat_calls = []

    def apply_with_a_flipped_bit(bits: np.ndarray, blob: memoryview) -> None:
        real_apply(bits, blob)
        if bits.size == 33 * 41 - 700 * 1:  # the second segment of mat.weight
            mat_calls.append(1)
            bits[5] ^= 1

    with WeightSubscriber(store, "r") as sub:
        sub.pull(1)
        held = _clone(sub.tensors)
        monkeypatch.setattr(subscriber, "apply_delta", apply_with_a_flipped_bit)
        with pytest.raises(WeightPullError) as err:
            sub.pull(2)
        assert err.value.tensor == "mat.weight" and "hash mismatch" in str(err.value)
        assert len(mat_calls) >= 3  # the delta, its refetch, then the full-snapshot fallback's chain
        assert _same(sub.tensors, held) and sub.version == 1


def test_an_unexpected_error_while_applying_rolls_back_and_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = _versions(2)
    store = FileStore(tmp_path)
    with WeightPublisher(store, "r", model_config_hash=CONFIG, full_every=100) as pub:
        for v, tensors in enumerate(versions):
            pub.publish(v, tensors)
    real_apply = subscriber.apply_delta

    def buggy_apply(bits: np.ndarray, blob: memoryview) -> None:
        real_apply(bits, blob)
        if bits.size == 1:  # the last segment of big.weight, after the others were applied
            raise RuntimeError("a bug, not a bad blob")

    with WeightSubscriber(store, "r") as sub:
        sub.pull(0)
        held = _clone(sub.tensors)
        monkeypatch.setattr(subscriber, "apply_delta", buggy_apply)
        with pytest.raises(RuntimeError, match="a bug"):
            sub.pull(1)
        assert _same(sub.tensors, held) and sub.version == 0
