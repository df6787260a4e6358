"""Weight store failure and bad-input behaviour, on the real SeaweedFS S3 of the `stack` fixture."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import torch

from infra.stack import StackState
from storage.delta_codec import tensor_bits
from storage.manifest import Manifest, ManifestError, latest_key, manifest_key
from storage.objectstore import ObjectStore
from storage.weights import VersionConflict, WeightPublisher, WeightPullError, WeightSubscriber, list_versions
from tests.support.stores import FaultyStore, s3_store

CONFIG = "cfg"
RACE_TRIALS = 3


@pytest.fixture
def store(stack: StackState) -> Iterator[ObjectStore]:
    """S3 only: these failures are the ones a remote store has."""
    with s3_store(stack, f"test-weights-failures/{uuid.uuid4().hex}") as s:
        yield s


def _versions(count: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = [{"a.weight": (torch.randn(40, 30, generator=g) * 0.02).bfloat16(), "b.weight": torch.ones(31).bfloat16()}]
    for _ in range(1, count):
        out.append({n: torch.where(torch.rand(t.shape, generator=g) < 0.05, t + 0.01, t) for n, t in out[-1].items()})
    return out


def _published(store: ObjectStore, run: str, count: int, **kwargs: object) -> list[dict[str, torch.Tensor]]:
    versions = _versions(count)
    with WeightPublisher(store, run, model_config_hash=CONFIG, **kwargs) as pub:  # type: ignore[arg-type]
        for v, tensors in enumerate(versions):
            pub.publish(v, tensors)
    return versions


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in tensors.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def _subscriber_at(store: ObjectStore, run: str, version: int) -> WeightSubscriber:
    sub = WeightSubscriber(store, run, model_config_hash=CONFIG)
    sub.pull(version)
    return sub


def _delta_part(store: ObjectStore, run: str, version: int) -> str:
    return _subscriber_at(store, run, 0).manifest(version).parts[0].key


def test_a_publish_killed_before_its_manifest_leaves_no_visible_version(store: ObjectStore) -> None:
    versions = _versions(3)
    killed: list[str] = []

    def killed_before_its_manifest(method: str, key: str) -> BaseException | None:
        """The manifest write of version 2 is where the process dies; nothing it tries afterwards lands."""
        if killed:
            return ConnectionError("the publisher was killed: nothing more reaches the store")
        if key == manifest_key("killed", 2):
            killed.append(key)
            return KeyboardInterrupt("publisher killed between parts and manifest")
        return None

    pub = WeightPublisher(FaultyStore(store, killed_before_its_manifest), "killed", model_config_hash=CONFIG)
    pub.publish(0, versions[0])
    pub.publish(1, versions[1])
    sub = _subscriber_at(store, "killed", 1)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(2, versions[2])
    assert any("/v00000002/part-" in k for k in store.list("killed/")), "the parts did go up"
    assert sub.latest_version() == 1 and list_versions(store, "killed") == [0, 1]
    assert sub.pull() == 1 and _same(sub.tensors, versions[1])
    with pytest.raises(ManifestError, match="does not exist"):
        sub.pull(2)
    assert _same(sub.tensors, versions[1])
    with WeightPublisher(store, "killed", model_config_hash=CONFIG) as restarted:  # the version can still be published
        restarted.publish(2, versions[2])
    assert sub.pull() == 2 and _same(sub.tensors, versions[2])


def test_two_publishers_racing_for_one_version_have_exactly_one_winner(store: ObjectStore) -> None:
    for trial in range(RACE_TRIALS):
        run = f"race{trial}"
        candidates = [_versions(1)[0], {n: t + 1 for n, t in _versions(1)[0].items()}]
        outcomes: dict[int, object] = {}
        barrier = threading.Barrier(2)

        def publish(
            i: int,
            run: str = run,
            candidates: list = candidates,
            outcomes: dict = outcomes,
            barrier: threading.Barrier = barrier,
        ) -> None:
            with WeightPublisher(store, run, model_config_hash=CONFIG) as pub:
                barrier.wait()
                try:
                    outcomes[i] = pub.publish(0, candidates[i])
                except VersionConflict as exc:
                    outcomes[i] = exc

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, o in outcomes.items() if not isinstance(o, VersionConflict)]
        assert len(winners) == 1, outcomes
        loser = outcomes[1 - winners[0]]
        assert isinstance(loser, VersionConflict) and "already published" in str(loser)
        sub = _subscriber_at(store, run, 0)
        assert _same(sub.tensors, candidates[winners[0]])
        referenced = {p.key for p in sub.manifest(0).parts} | {manifest_key(run, 0)}
        assert set(store.list(f"{run}/weights/v")) == referenced, "the loser removed its own parts"


def test_a_corrupted_part_is_rejected_naming_version_part_and_tensor_with_tensors_unchanged(
    store: ObjectStore,
) -> None:
    _published(store, "corrupt", 3)
    sub = _subscriber_at(store, "corrupt", 1)
    before = _snapshot(sub.tensors)
    key = _delta_part(store, "corrupt", 2)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF
    store.put(key, bytes(data))
    with pytest.raises(WeightPullError) as info:
        sub.pull(2)
    err = info.value
    assert (err.version, err.part) == (2, key) and err.tensor in sub.tensors
    assert "version 2" in str(err) and key in str(err) and "hash mismatch" in str(err)
    assert _same(sub.tensors, before) and sub.version == 1


def test_a_missing_part_is_rejected_and_the_tensors_stay_as_they_were(store: ObjectStore) -> None:
    _published(store, "missing", 3)
    sub = _subscriber_at(store, "missing", 1)
    before = _snapshot(sub.tensors)
    key = _delta_part(store, "missing", 2)
    store.delete(key)
    with pytest.raises(WeightPullError, match="part is missing") as info:
        sub.pull(2)
    assert info.value.part == key and _same(sub.tensors, before)


def test_a_part_corrupted_once_in_transit_is_fetched_again(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    versions = _published(store, "flaky", 3)
    sub = _subscriber_at(store, "flaky", 1)
    key = _delta_part(store, "flaky", 2)
    real_get, seen = store.get, []

    def flaky_get(k: str) -> bytes:
        data = real_get(k)
        if k == key and not seen:
            seen.append(k)
            return data[:-1]
        return data

    monkeypatch.setattr(store, "get", flaky_get)
    sub.pull(2)
    assert seen and _same(sub.tensors, versions[2])


def test_held_tensors_that_went_bad_fall_back_to_the_full_snapshot(store: ObjectStore) -> None:
    versions = _published(store, "fallback", 3)
    sub = _subscriber_at(store, "fallback", 1)
    tensor_bits(sub.tensors["a.weight"])[5] ^= 1  # local corruption the subscriber does not know about
    sub.pull(2)  # delta: hash mismatch, retried, then the full snapshot + deltas
    assert _same(sub.tensors, versions[2])


@pytest.mark.parametrize("damage", ["truncated", "invalid", "other-run"])
def test_a_bad_manifest_is_rejected_with_a_clear_error_and_the_tensors_unchanged(
    store: ObjectStore, damage: str
) -> None:
    _published(store, "bad", 3)
    _published(store, "other", 3)
    sub = _subscriber_at(store, "bad", 1)
    before = _snapshot(sub.tensors)
    key = manifest_key("bad", 2)
    good = store.get(key)
    replacement = {
        "truncated": good[: len(good) // 2],
        "invalid": b'{"schema": 1, "run": "bad", "version": 2}',
        "other-run": store.get(manifest_key("other", 2)),
    }[damage]
    store.put(key, replacement)
    expected = {"truncated": "not valid JSON", "invalid": "invalid manifest", "other-run": "run 'other'"}[damage]
    with pytest.raises(ManifestError, match=expected) as info:
        sub.pull(2)
    assert key in str(info.value)
    assert _same(sub.tensors, before) and sub.version == 1


def test_retention_keeps_what_a_reader_may_be_pulling_within_grace(store: ObjectStore) -> None:
    now = [1000.0]
    versions = _versions(8)
    pub = WeightPublisher(
        store, "retain", model_config_hash=CONFIG, full_every=3, keep_versions=1, grace_s=10.0, clock=lambda: now[0]
    )
    for v, tensors in enumerate(versions):
        now[0] += 4.0  # a version every 4 s: the two before the latest are still within the 10 s grace
        pub.publish(v, tensors)
    # latest 7; 4, 5 and 6 were superseded < 10 s ago (a reader may be pulling them); 4 needs its chain to 3
    assert list_versions(store, "retain") == [3, 4, 5, 6, 7]
    now[0] += 60.0
    pub.prune()
    assert list_versions(store, "retain") == [6, 7]
    sub = WeightSubscriber(store, "retain", model_config_hash=CONFIG)
    sub.pull()
    assert _same(sub.tensors, versions[7])
    pub.close()


class _FailOnce:
    """A `FaultyStore` fault: once armed, the first `method` call on `key` fails with a ConnectionError (an
    outage), but only after `after` (a (method, key) call) was asked, if given. `failed` records it."""

    def __init__(self, method: str, key: str, after: tuple[str, str] | None = None) -> None:
        self.method, self.key, self.after = method, key, after
        self.armed = False
        self.failed: list[str] = []
        self._seen_after = after is None

    def __call__(self, method: str, key: str) -> BaseException | None:
        if not self.armed or self.failed:
            return None
        if (method, key) == (self.method, self.key) and self._seen_after:
            self.failed.append(f"{method} {key}")
            return ConnectionError(f"injected: {method} {key} failed once")
        if (method, key) == self.after:
            self._seen_after = True
        return None


def _assert_published_intact(store: ObjectStore, run: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """LATEST is at `version`, a fresh subscriber pulls it bit-exactly, and every part of every version exists."""
    with WeightSubscriber(store, run, model_config_hash=CONFIG) as sub:
        assert sub.latest_version() == version
        assert sub.pull() == version and _same(sub.tensors, tensors)
        for v in list_versions(store, run):
            missing = [p.key for p in sub.manifest(v).parts if not store.exists(p.key)]
            assert missing == [], f"version {v} names parts that are gone: {missing}"


@pytest.mark.parametrize("where", ["latest-swap", "manifest-read-back"])
def test_a_publish_retried_after_a_failure_past_its_manifest_adopts_its_own_commit(
    store: ObjectStore, where: str
) -> None:
    run = f"retry-{where}"
    versions = _versions(4)
    manifest = manifest_key(run, 2)
    if where == "latest-swap":  # the manifest is committed, LATEST's compare-and-swap fails once
        fault = _FailOnce("put_if_match", latest_key(run))
    else:  # the manifest landed, reading it back fails once
        fault = _FailOnce("get_with_etag", manifest, after=("put_if_absent", manifest))
    with WeightPublisher(FaultyStore(store, fault), run, model_config_hash=CONFIG) as pub:
        pub.publish(0, versions[0])
        pub.publish(1, versions[1])
        fault.armed = True
        with pytest.raises(ConnectionError, match="injected"):
            pub.publish(2, versions[2])
        assert fault.failed, "the fault was injected"
        first = Manifest.from_json(store.get(manifest), key=manifest)
        again = pub.publish(2, versions[2])  # the retry the trainer's session makes
        assert again.publish_id == first.publish_id, "the retry adopted its own committed manifest"
        _assert_published_intact(store, run, 2, versions[2])
        assert pub.publish(3, versions[3]).kind == "delta", "the adopted version is the next delta's base"
    _assert_published_intact(store, run, 3, versions[3])
    manifests = [Manifest.from_json(store.get(k), key=k) for k in (manifest_key(run, v) for v in range(4))]
    referenced = {manifest_key(run, v) for v in range(4)} | {p.key for m in manifests for p in m.parts}
    assert set(store.list(f"{run}/weights/v")) == referenced, "the retry left no orphaned parts"
