"""Weight version store: publish, plan, pull, retention; against FileStore and the real SeaweedFS S3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import storage.publisher as publisher
from storage.filestore import FileStore
from storage.manifest import Manifest, ManifestError, PartSpec, TensorSpec, config_hash, latest_key
from storage.objectstore import ObjectStore
from storage.retention import versions_to_delete
from storage.weights import PullPlan, WeightPublisher, WeightSubscriber, list_versions

CONFIG_HASH = config_hash({"model": "tiny", "hidden": 8})


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split tensors into several delta blobs, as large tensors are in production."""
    monkeypatch.setattr(publisher, "SEGMENT_ELEMS", 700)


def _model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": (torch.randn(64, 33, generator=g) * 0.02).to(dtype),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(37, 29, generator=g) * 0.02).to(dtype),
        "model.norm.weight": torch.ones(33, dtype=dtype),
        "model.empty": torch.empty(0, 5, dtype=dtype),
    }


def _step(tensors: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """The next version: a small random subset of elements moved, like a bf16 cast after a small step."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in tensors.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        noise = torch.randn(t.shape, generator=g).to(t.dtype) * 0.01
        out[name] = torch.where(mask, t + noise, t)
    return out


def _publish_series(store: ObjectStore, run: str, count: int, **kwargs: object) -> list[dict[str, torch.Tensor]]:
    versions = [_model()]
    for v in range(1, count):
        versions.append(_step(versions[-1], v))
    with WeightPublisher(store, run, model_config_hash=CONFIG_HASH, **kwargs) as pub:  # type: ignore[arg-type]
        for v, tensors in enumerate(versions):
            pub.publish(v, tensors)
    return versions


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and torch.equal(
            a[n].view(-1).view(torch.int16 if a[n].element_size() == 2 else torch.int32),
            b[n].view(-1).view(torch.int16 if b[n].element_size() == 2 else torch.int32),
        )
        for n in a
    )


def test_a_subscriber_following_every_version_is_bit_exact_and_keeps_its_tensor_objects(store: ObjectStore) -> None:
    versions = _publish_series(store, "run1", 6, full_every=4)
    sub = WeightSubscriber(store, "run1", model_config_hash=CONFIG_HASH)
    sub.pull(0)
    held = dict(sub.tensors)
    for v in range(1, 6):
        assert sub.pull(v) == v
        assert _bits_equal(sub.tensors, versions[v])
        assert all(sub.tensors[n] is held[n] for n in held)
    assert sub.latest_version() == 5 and list_versions(store, "run1") == [0, 1, 2, 3, 4, 5]
    sub.close()


def test_a_new_subscriber_pulls_latest_through_the_newest_full_snapshot(store: ObjectStore) -> None:
    versions = _publish_series(store, "run2", 7, full_every=4)
    sub = WeightSubscriber(store, "run2")
    assert sub.pull() == 6
    assert _bits_equal(sub.tensors, versions[6])
    assert sub.plan(None, 6) == PullPlan(None, 6, (4, 5, 6), True, sub.plan(None, 6).num_bytes)
    sub.close()


def test_plan_takes_the_delta_chain_when_it_is_smaller_and_the_snapshot_when_not(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _publish_series(store, "run3", 9, full_every=8)
    sub = WeightSubscriber(store, "run3")
    assert sub.plan(5, 7).versions == (6, 7) and not sub.plan(5, 7).from_full
    assert sub.plan(7, 8).versions == (8,) and sub.plan(7, 8).from_full  # 8 is a full snapshot: no chain through it
    deltas = [sub.manifest(v).num_bytes for v in range(1, 8)]
    one_to_seven = sub.plan(1, 7)
    assert one_to_seven.from_full == (sum(deltas[1:]) > sub.manifest(0).num_bytes + sum(deltas))
    assert sub.plan(3, 2).from_full  # going back: only via the snapshot


def test_fp16_and_fp32_versions_round_trip_exactly(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    for dtype in (torch.float16, torch.float32):
        run = f"run-{str(dtype).split('.')[-1]}"
        v0 = _model(dtype=dtype)
        v1 = _step(v0, 1, fraction=0.3)
        with WeightPublisher(store, run, model_config_hash=CONFIG_HASH, dtype=dtype) as pub:
            pub.publish(0, v0)
            pub.publish(1, v1)
        sub = WeightSubscriber(store, run)
        sub.pull(0)
        sub.pull(1)
        assert _bits_equal(sub.tensors, v1) and sub.manifest(1).kind == "delta"


def test_latest_never_moves_backward(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    versions = _publish_series(store, "run4", 3)
    with WeightPublisher(store, "run4", model_config_hash=CONFIG_HASH) as late:
        late.publish(7, versions[2])
        late.publish(5, versions[1])  # a slow publisher finishing an older version
    assert WeightSubscriber(store, "run4").latest_version() == 7


def test_a_resumed_publisher_starts_with_a_full_snapshot_whose_parent_is_the_latest(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    versions = _publish_series(store, "run5", 3, full_every=50)
    with WeightPublisher(store, "run5", model_config_hash=CONFIG_HASH) as resumed:
        m = resumed.publish(resumed.latest_version() + 1, _step(versions[2], 3))
    assert (m.kind, m.parent_version, m.base_version) == ("full", 2, None)


def test_held_tensors_given_at_start_are_checked_before_deltas_are_applied(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    versions = _publish_series(store, "run6", 3)
    good = WeightSubscriber(store, "run6", tensors={n: t.clone() for n, t in versions[1].items()}, version=1)
    assert good.plan(1, 2).versions == (2,)
    good.pull(2)
    assert _bits_equal(good.tensors, versions[2])
    wrong = WeightSubscriber(store, "run6", tensors={n: t.clone() for n, t in versions[0].items()}, version=1)
    wrong.pull(2)  # not what version 1 hashes to: it takes the full snapshot path instead
    assert _bits_equal(wrong.tensors, versions[2])


def test_a_subscriber_refuses_another_model_config(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _publish_series(store, "run7", 1)
    sub = WeightSubscriber(store, "run7", model_config_hash=config_hash({"model": "other"}))
    with pytest.raises(ManifestError, match="model config hash"):
        sub.pull()
    assert sub.tensors == {} and sub.version is None


def _fake_manifest(version: int, *, full: bool, base: int | None, published_at: float) -> Manifest:
    spec = TensorSpec("w", "bfloat16", (1,), "0" * 64)
    part = PartSpec(f"r/weights/v{version:08d}/part-00000-x.lwd", 1, "0" * 64, ("w",))
    return Manifest(
        run="r",
        version=version,
        kind="full" if full else "delta",
        base_version=None if full else base,
        parent_version=base,
        anchor_version=version if full else 0,
        model_config_hash="h",
        publish_id="p",
        published_at=published_at,
        tensors=(spec,),
        parts=(part,),
        codec="safetensors" if full else "lwdc1",
    )


def test_retention_keeps_the_newest_versions_their_chains_and_anything_still_in_grace() -> None:
    full_every = 4
    manifests = {
        v: _fake_manifest(v, full=v % full_every == 0, base=v - 1 if v else None, published_at=100.0 + v)
        for v in range(11)
    }
    kw = dict(latest=10, keep_versions=2, now=1000.0)
    # keep 9, 10, their chain back to the full snapshot 8; version 11 is mid-publish (no LATEST yet)
    manifests[11] = _fake_manifest(11, full=False, base=10, published_at=111.0)
    assert versions_to_delete(manifests, set(), grace_s=0.0, **kw) == list(range(8))
    # versions superseded less than grace_s ago may be mid-pull: keep 6 and 7, and so their chain 4, 5
    assert versions_to_delete(manifests, set(), grace_s=1000.0 - 107.5, **kw) == [0, 1, 2, 3]
    # a killed publish (no manifest) below the kept window is garbage; above it, maybe in progress
    assert versions_to_delete(manifests, {3, 12}, grace_s=0.0, **kw) == list(range(8))


def test_retention_on_the_store_deletes_old_versions_and_keeps_pullable_ones(store: ObjectStore) -> None:
    versions = _publish_series(store, "run8", 10, full_every=4, keep_versions=2, grace_s=0.0)
    assert list_versions(store, "run8") == [8, 9]
    assert not any("/v0000000" + str(v) in k for k in store.list("run8/") for v in range(8))
    assert latest_key("run8") in store.list("run8/")
    sub = WeightSubscriber(store, "run8")
    sub.pull()
    assert _bits_equal(sub.tensors, versions[9])
