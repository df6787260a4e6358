"""Claim checks: the key its run and group imply, a HEAD before the GET, create-only digest keys, transient
store failures retried, and a delivery limit on the trainer's consumer so no message loops through resumes."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest
from botocore.exceptions import EndpointConnectionError

from infra.stack import StackState, load_credentials
from pipeline.config import StreamConfig
from pipeline.wire.claim_check import CLAIM_CHECK_MAX_BYTES, ClaimUnavailable, fetch_claim, parse_claim_check
from pipeline.wire.codec import encode_group
from pipeline.wire.consumer import (
    MAX_DELIVER_DEAD_LETTER_TRIES,
    TRAINER_MAX_DELIVER,
    TrajectoryConsumer,
    ensure_trainer_consumer,
)
from pipeline.wire.headers import H_CLAIM_CHECK, H_DLQ_REASON, H_MSG_ID
from pipeline.wire.jetstream import DeadLetterError, connect, handled_deliveries
from pipeline.wire.names import RunNames
from pipeline.wire.replay import ReplayReader, ReplaySelection
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from storage.filestore import FileStore
from storage.s3 import S3Options, S3Store


def _group(group_id: str, seed: int, num_tokens: int = 2000) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    mask = np.r_[np.zeros(8, np.uint8), np.ones(num_tokens - 8, np.uint8)]
    sample = Sample(
        tokens=rng.integers(0, 151_936, num_tokens).astype(np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32),
        versions=np.where(mask == 1, 1, -1).astype(np.int32),
    )
    return TrajectoryGroup.from_samples(group_id=group_id, prompt_id="p", generator_id="gen", samples=[sample])


def _stream(**overrides: object) -> StreamConfig:
    return StreamConfig(**{"max_bytes": 64 * 2**20, "max_inline_bytes": 8192, **overrides})


def _names() -> RunNames:
    return RunNames.for_run(f"c-{uuid.uuid4().hex[:10]}")


def _s3(stack: StackState, prefix: str) -> S3Store:
    creds = load_credentials(stack.dir)
    options = S3Options(
        endpoint=stack.s3_endpoint,
        region=stack.region,
        access_key_id=creds.access_key_id,
        secret_access_key=creds.secret_access_key,
    )
    return S3Store(stack.bucket, prefix, options)


# --- pure: the pointer and the fetch ----------------------------------------------------------------------------


def _pointer(key: str, size: int, sha256: str) -> bytes:
    return orjson.dumps({"key": key, "bytes": size, "sha256": sha256})


def test_a_pointer_must_name_exactly_its_own_runs_key_for_its_group() -> None:
    names, body = RunNames.for_run("run-a"), b"0123456789"
    sha = hashlib.sha256(body).hexdigest()
    own = f"run-a/trajectories/g1.{sha}.arrow"
    assert parse_claim_check({H_MSG_ID: "g1", H_CLAIM_CHECK: own}, _pointer(own, 10, sha), names) == (own, 10, sha)
    cases = [
        ("../x", 10, sha, "claim_check_invalid"),
        ("/a", 10, sha, "claim_check_invalid"),
        (f"run-a/../{own}", 10, sha, "claim_check_invalid"),
        (own, CLAIM_CHECK_MAX_BYTES + 1, sha, "claim_check_invalid"),
        (own, -1, sha, "claim_check_invalid"),
        (own, 10, "00", "claim_check_invalid"),
        (f"run-b/trajectories/g1.{sha}.arrow", 10, sha, "claim_check_foreign"),
        (f"run-a/trajectories/g2.{sha}.arrow", 10, sha, "claim_check_foreign"),
        (f"run-a/trajectories/g1.{'0' * 64}.arrow", 10, sha, "claim_check_foreign"),
        ("run-a/trajectories/g1.arrow", 10, sha, "claim_check_foreign"),  # a key without the digest
    ]
    for key, size, digest, reason in cases:
        with pytest.raises(DeadLetterError) as caught:
            parse_claim_check({H_MSG_ID: "g1", H_CLAIM_CHECK: key}, _pointer(key, size, digest), names)
        assert caught.value.reason == reason, (key, size, digest, caught.value)
    with pytest.raises(DeadLetterError, match="claim_check_invalid"):
        parse_claim_check({H_MSG_ID: "g1", H_CLAIM_CHECK: own}, b"[1, 2]", names)


class _RecordingStore(FileStore):
    """A FileStore that records its reads and, while `error` is set, raises it instead (a store that is down)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: list[str] = []
        self.error: BaseException | None = None

    def size(self, key: str) -> int:
        self.calls.append("size")
        if self.error is not None:
            raise self.error
        return super().size(key)

    def get(self, key: str) -> bytes:
        self.calls.append("get")
        return super().get(key)


def test_fetch_claim_heads_before_it_gets_and_tells_permanent_from_transient_failures(tmp_path: Path) -> None:
    store, body = _RecordingStore(tmp_path), b"0123456789"
    sha = hashlib.sha256(body).hexdigest()
    store.put("r/trajectories/g.arrow", body)
    with pytest.raises(DeadLetterError, match="claim_check_mismatch"):
        fetch_claim(store, "r/trajectories/g.arrow", 11, sha)
    assert store.calls == ["size"]  # the size is refused before a byte is downloaded
    assert fetch_claim(store, "r/trajectories/g.arrow", 10, sha) == body
    with pytest.raises(DeadLetterError, match="claim_check_mismatch"):
        fetch_claim(store, "r/trajectories/g.arrow", 10, "0" * 64)
    with pytest.raises(DeadLetterError, match="claim_check_missing"):
        fetch_claim(store, "r/trajectories/nowhere.arrow", 10, sha)
    for error in (ConnectionError("refused"), TimeoutError("slow"), EndpointConnectionError(endpoint_url="http://x")):
        store.error = error
        with pytest.raises(ClaimUnavailable, match=type(error).__name__):
            fetch_claim(store, "r/trajectories/g.arrow", 10, sha)


# --- against the real servers -----------------------------------------------------------------------------------


def test_a_regenerated_group_never_overwrites_the_claim_object_of_the_first(stack: StackState) -> None:
    """Same group id, other bytes (a prompt redelivered after its generator died): the stream keeps the first
    message (deduped by id), and that message and its replay must still read the first bytes."""
    names, stream = _names(), _stream()
    store = _s3(stack, f"test-claims/{uuid.uuid4().hex}")
    first, second = _group("g", seed=1), _group("g", seed=2)

    async def main() -> None:
        nc = await connect(stack.nats_url, name="test")
        try:
            js = nc.jetstream(timeout=10)
            await ensure_trajectory_streams(js, names, stream)
            await ensure_trainer_consumer(js, names)
            publisher = TrajectoryPublisher(js, names, stream, store)
            a, b = await publisher.publish(first), await publisher.publish(second)
            assert b.duplicate and a.claim_check_key != b.claim_check_key
            again = await publisher.publish(first)  # a retried publish finds its object there: left as it is
            assert again.duplicate and again.claim_check_key == a.claim_check_key
            assert store.get(a.claim_check_key) == encode_group(first)
            consumer = await TrajectoryConsumer.bind(js, names, stream, store)
            batch = await consumer.fetch(timeout_s=5)
            assert [d.group.group_id for d in batch] == ["g"] and not consumer.dead_letters.counts
            np.testing.assert_array_equal(batch[0].group.tokens, first.tokens)
            reader = await ReplayReader.open(js, names, stream, store, ReplaySelection())
            replayed = [d async for d in reader]
            assert [d.seq for d in replayed] == [1] and not reader.stats.skipped
            np.testing.assert_array_equal(replayed[0].group.tokens, first.tokens)
        finally:
            await nc.close()
            store.close()

    asyncio.run(main())


def test_a_group_redelivered_past_max_deliver_is_dead_lettered_instead_of_looping(stack: StackState) -> None:
    """A group that kills the trainer comes back on every resume; after `max_deliver` deliveries it stops."""
    names, stream = _names(), _stream()

    async def main() -> None:
        nc = await connect(stack.nats_url, name="test")
        try:
            js = nc.jetstream(timeout=10)
            await ensure_trajectory_streams(js, names, stream)
            await ensure_trainer_consumer(js, names, max_deliver=2)
            await TrajectoryPublisher(js, names, stream).publish(_group("poison", seed=3, num_tokens=32))
            for delivery in (1, 2):  # each trainer takes it and dies before the step commits
                consumer = await TrajectoryConsumer.bind(js, names, stream)
                assert consumer.max_deliver == 2
                batch = await consumer.fetch(timeout_s=5)
                assert [(d.group.group_id, d.num_delivered) for d in batch] == [("poison", delivery)]
                await consumer.nak([batch[0].seq])
                await consumer.close()
            consumer = await TrajectoryConsumer.bind(js, names, stream)
            deadline = time.monotonic() + 20
            while not consumer.dead_letters.counts:
                assert time.monotonic() < deadline, "the third delivery never came"
                assert await consumer.fetch(timeout_s=0.5) == []
            assert consumer.dead_letters.counts == {"max_deliveries": 1}
            last = await js.get_last_msg(names.dead_letter_stream, names.trajectory_dead_letter_subject)
            assert last.headers[H_DLQ_REASON] == "max_deliveries" and last.headers["Leeway-Original-Msg-Id"] == "poison"
            info = await js.consumer_info(names.trajectory_stream, names.trainer_consumer)
            assert info.num_ack_pending == 0 and info.num_pending == 0
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_consumer_handles_the_deliveries_its_server_limit_leaves_after_the_dead_letter_tries() -> None:
    assert handled_deliveries(TRAINER_MAX_DELIVER + MAX_DELIVER_DEAD_LETTER_TRIES, MAX_DELIVER_DEAD_LETTER_TRIES) == 20
    for unset in (None, -1, 0, MAX_DELIVER_DEAD_LETTER_TRIES):  # not made by ensure_trainer_consumer: refused
        with pytest.raises(ValueError, match="max_deliver"):
            handled_deliveries(unset, MAX_DELIVER_DEAD_LETTER_TRIES)


def test_ensure_trainer_consumer_brings_an_existing_consumer_up_to_date_and_keeps_its_position(
    stack: StackState,
) -> None:
    """A trainer resumed with other consumer settings updates the durable consumer; its acks stand."""
    names, stream = _names(), _stream()

    async def main() -> None:
        nc = await connect(stack.nats_url, name="test")
        try:
            js = nc.jetstream(timeout=10)
            await ensure_trajectory_streams(js, names, stream)
            await ensure_trainer_consumer(js, names, max_deliver=5)
            await TrajectoryPublisher(js, names, stream).publish_many(
                [_group(f"g{i}", seed=i, num_tokens=32) for i in range(3)]
            )
            consumer = await TrajectoryConsumer.bind(js, names, stream)
            assert consumer.max_deliver == 5
            batch = await consumer.fetch(max_groups=1, timeout_s=5)
            assert await consumer.ack([d.seq for d in batch]) == 1
            await consumer.close()
            await ensure_trainer_consumer(js, names)  # the resumed trainer, with the default limit
            info = await js.consumer_info(names.trajectory_stream, names.trainer_consumer)
            assert info.config.max_deliver == TRAINER_MAX_DELIVER + MAX_DELIVER_DEAD_LETTER_TRIES
            assert info.ack_floor.stream_seq == 1
            consumer = await TrajectoryConsumer.bind(js, names, stream)
            assert consumer.max_deliver == TRAINER_MAX_DELIVER
            rest = await consumer.fetch(timeout_s=5)
            assert [d.group.group_id for d in rest] == ["g1", "g2"]
        finally:
            await nc.close()

    asyncio.run(main())
