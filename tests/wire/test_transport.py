"""Trajectory transport against a real nats-server: dedupe, claim check, redelivery, outages, dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import struct
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import nats.js.errors
import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra import nats_server
from infra.stack import load_credentials
from pipeline.config import StreamConfig
from pipeline.wire.claim_check import CLAIM_CHECK_MAX_BYTES
from pipeline.wire.codec import TRAJECTORY_SCHEMA, encode_group, group_to_record_batch
from pipeline.wire.consumer import TrajectoryConsumer, ensure_trainer_consumer
from pipeline.wire.headers import H_CLAIM_CHECK, H_DLQ_REASON, H_MIN_VERSION, H_NUM_TOKENS
from pipeline.wire.jetstream import connect
from pipeline.wire.names import RunNames
from pipeline.wire.trajectories import TrajectoryPublisher, ensure_trajectory_streams, group_headers
from pipeline.wire.trajectory import Sample, TrajectoryGroup
from storage.filestore import FileStore
from storage.s3 import S3Options, S3Store
from tests.support.builders import wire_group


def _stream(**overrides) -> StreamConfig:
    """Small streams: JetStream reserves max_bytes up front, and the session's server holds many."""
    return StreamConfig(**{"max_bytes": 64 * 2**20, **overrides})


def _names() -> RunNames:
    return RunNames.for_run(f"t-{uuid.uuid4().hex[:10]}")


async def _setup(url: str, names: RunNames, stream: StreamConfig, **consumer_kw):
    nc = await connect(url, name="test")
    js = nc.jetstream(timeout=10)
    await ensure_trajectory_streams(js, names, stream)
    await ensure_trainer_consumer(js, names, **consumer_kw)
    return nc, js


async def _drain(consumer: TrajectoryConsumer, expected: int, timeout_s: float = 20.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expected and time.monotonic() < deadline:
        batch = await consumer.fetch(timeout_s=0.5)
        got.extend(d.group.group_id for d in batch)
        await consumer.ack([d.seq for d in batch])
    return got


def test_publish_dedupes_by_group_id_and_consumer_acks_when_told(stack):
    async def main() -> None:
        names, stream = _names(), _stream(max_msg_bytes=8 * 2**20)
        nc, js = await _setup(stack.nats_url, names, stream)
        try:
            publisher = TrajectoryPublisher(js, names, stream)
            first = await publisher.publish_many([wire_group(f"g{i}", version=i) for i in range(5)])
            assert [r.seq for r in first] == [1, 2, 3, 4, 5] and not any(r.duplicate for r in first)
            again = await publisher.publish(wire_group("g2", version=2))
            assert again.duplicate and again.seq == 3
            consumer = await TrajectoryConsumer.bind(js, names, stream)
            batch = await consumer.fetch(max_groups=5)
            assert [d.seq for d in batch] == [1, 2]  # a 16 MiB fetch budget / 8 MiB largest message
            batch += await consumer.fetch(max_groups=1)
            assert [d.seq for d in batch] == [1, 2, 3]
            assert batch[2].group.group_id == "g2" and batch[2].msg.headers[H_MIN_VERSION] == "2"
            assert consumer.held_seqs == [1, 2, 3]
            assert await consumer.ack([1, 2, 3]) == 3
            rest = await _drain(consumer, 2)
            assert rest == ["g3", "g4"]
            info = await js.consumer_info(names.trajectory_stream, names.trainer_consumer)
            assert info.num_ack_pending == 0 and info.num_pending == 0
            assert (await js.stream_info(names.trajectory_stream)).state.messages == 5
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_fetch_never_returns_more_groups_than_asked_even_when_earlier_pulls_were_answered_late(stack):
    """A pull request the server answers after its fetch gave up leaves messages in the subscription, and nats-py's
    next fetch hands all of them over: the consumer keeps what goes beyond `max_groups` for the next fetches."""

    async def main() -> None:
        names, stream = _names(), _stream()
        nc, js = await _setup(stack.nats_url, names, stream)
        try:
            await TrajectoryPublisher(js, names, stream).publish_many([wire_group(f"g{i}") for i in range(6)])
            consumer = await TrajectoryConsumer.bind(js, names, stream)
            sub = consumer._sub
            # a late-answered pull request: 5 messages delivered to the subscription's inbox outside any fetch
            await nc.publish(sub._nms, b'{"batch": 5, "no_wait": true}', reply=sub._deliver)
            deadline = time.monotonic() + 20
            while sub._sub._pending_queue.qsize() < 5:
                assert time.monotonic() < deadline, "the pull request was not answered"
                await asyncio.sleep(0.01)
            got = []
            for want in (2, 2, 2):
                batch = await consumer.fetch(max_groups=want)
                assert 1 <= len(batch) <= want, [d.group.group_id for d in batch]
                got += [d.group.group_id for d in batch]
            got += await _drain(consumer, 6 - len(got))
            assert sorted(got) == [f"g{i}" for i in range(6)] and len(set(got)) == 6
        finally:
            await nc.close()

    asyncio.run(main())


def test_large_group_travels_by_claim_check(stack, tmp_path):
    async def main() -> None:
        names = _names()
        stream = _stream(max_inline_bytes=8192)
        store = FileStore(tmp_path / "store")
        nc, js = await _setup(stack.nats_url, names, stream)
        try:
            big, small = wire_group("big", num_tokens=2000), wire_group("small", num_tokens=16, num_samples=1)
            publisher = TrajectoryPublisher(js, names, stream, store)
            result = await publisher.publish(big)
            digest = hashlib.sha256(encode_group(big)).hexdigest()
            assert result.claim_check_key == f"{names.run}/trajectories/big.{digest}.arrow"
            assert result.payload_bytes < 300 and store.get(result.claim_check_key) == encode_group(big)
            assert (await publisher.publish(small)).claim_check_key is None
            consumer = await TrajectoryConsumer.bind(js, names, stream, store)
            batch = await consumer.fetch(timeout_s=2)
            assert [d.group.group_id for d in batch] == ["big", "small"]
            assert H_CLAIM_CHECK in batch[0].msg.headers
            np.testing.assert_array_equal(batch[0].group.tokens, big.tokens)
        finally:
            await nc.close()

    asyncio.run(main())


def test_groups_a_dead_trainer_held_unacked_come_back_to_the_trainer_that_resumes(stack):
    """Rank 0 alone binds the durable consumer; when it dies holding groups, its successor gets them again."""

    async def main() -> None:
        names, stream = _names(), _stream(fetch_batch=4, max_msg_bytes=2**20)
        nc, js = await _setup(stack.nats_url, names, stream, ack_wait_s=1.0)
        first_nc = await connect(stack.nats_url, name="trainer-first")
        try:
            await TrajectoryPublisher(js, names, stream).publish_many([wire_group(f"g{i}") for i in range(20)])
            first = await TrajectoryConsumer.bind(first_nc.jetstream(), names, stream)
            seen = await first.fetch(max_groups=3) + await first.fetch(max_groups=3)
            ids = [d.group.group_id for d in seen]
            assert len(ids) == len(set(ids)) == 6
            assert await first.ack([d.seq for d in seen[:3]]) == 3
            await first_nc.close()  # the trainer dies holding 3 groups unacked
            resumed_nc = await connect(stack.nats_url, name="trainer-resumed")
            try:
                resumed = await TrajectoryConsumer.bind(resumed_nc.jetstream(), names, stream)
                got = await _drain(resumed, 17, timeout_s=15)
            finally:
                await resumed_nc.close()
            assert sorted(got) == sorted(set(f"g{i}" for i in range(20)) - set(ids[:3]))  # each exactly once
        finally:
            await first_nc.close()
            await nc.close()

    asyncio.run(main())


# --- outages -------------------------------------------------------------------------------------------------


class _CuttableProxy:
    """A loopback TCP proxy whose live connections can be cut (and new ones refused) on demand."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0  # the port the OS gave it, once started
        self.accepting = True
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.accepting = False
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[nats_server.LocalServer]:
    with nats_server.run(tmp_path / "nats") as server:
        yield server


def test_no_loss_no_duplicate_across_connection_cut_and_server_restart(own_nats):
    num_groups = 60

    async def main() -> None:
        names = _names()
        stream = _stream(publish_ack_timeout_s=1.0, publish_retries=40)
        admin, js = await _setup(own_nats.url, names, stream)
        await admin.close()
        proxy = _CuttableProxy(own_nats.port)
        await proxy.start()
        pub_nc = await connect(f"nats://{own_nats.token}@127.0.0.1:{proxy.port}", name="publisher")
        publisher = TrajectoryPublisher(pub_nc.jetstream(timeout=5), names, stream)
        groups = [wire_group(f"g{i:03d}") for i in range(num_groups)]
        published: list[str] = []

        async def publish_all() -> None:
            for g in groups:
                await publisher.publish(g)
                published.append(g.group_id)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(publish_all())
        await asyncio.sleep(0.15)
        proxy.cut()  # the publisher's connection drops; reconnects are refused for a while
        await asyncio.sleep(1.0)
        proxy.accepting = True
        while len(published) < num_groups // 2:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(own_nats.stop)  # the server goes away ...
        await asyncio.sleep(0.5)
        await asyncio.to_thread(own_nats.start)  # ... and comes back on the same store dir and port
        await asyncio.wait_for(task, timeout=60)
        await pub_nc.close()
        await proxy.close()

        nc = await connect(own_nats.url, name="trainer")
        try:
            consumer = await TrajectoryConsumer.bind(nc.jetstream(timeout=10), names, stream)
            got = await _drain(consumer, num_groups + 1, timeout_s=8)
            assert sorted(got) == [g.group_id for g in groups]  # every id, each exactly once
            assert (await nc.jetstream().stream_info(names.trajectory_stream)).state.messages == num_groups
        finally:
            await nc.close()

    asyncio.run(main())


def test_an_unreachable_store_delays_a_claimed_group_and_never_stops_the_consumer(stack, tmp_path):
    """S3 refusing connections is transient: the claimed group is nak'ed (not dead-lettered, no crash), the
    groups behind it flow, and it is delivered once the store answers again."""

    async def main() -> None:
        names, stream = _names(), _stream(max_inline_bytes=8192)
        creds = load_credentials(stack.dir)
        options = dict(
            region=stack.region, access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key
        )
        prefix = f"test-claims/{uuid.uuid4().hex}"
        writer = S3Store(stack.bucket, prefix, S3Options(endpoint=stack.s3_endpoint, **options))
        proxy = _CuttableProxy(urlparse(stack.s3_endpoint).port)
        await proxy.start()
        proxy.cut()  # the trainer's path to the store is down
        reader = S3Store(
            stack.bucket,
            prefix,
            S3Options(endpoint=f"http://127.0.0.1:{proxy.port}", max_retries=0, connect_timeout_s=2, **options),
        )
        nc, js = await _setup(stack.nats_url, names, stream)
        try:
            publisher = TrajectoryPublisher(js, names, stream, writer)
            big = wire_group("big", num_tokens=2000)
            assert (await publisher.publish(big)).claim_check_key is not None
            await publisher.publish(wire_group("small", num_tokens=16, num_samples=1))
            consumer = await TrajectoryConsumer.bind(js, names, stream, reader)
            assert await _drain(consumer, 1) == ["small"]  # "big" (seq 1) was handled first, and given back
            assert not consumer.dead_letters.counts and consumer.held_seqs == []
            proxy.accepting = True
            batch: list = []
            deadline = time.monotonic() + 20
            while not batch:
                assert time.monotonic() < deadline, "the claimed group never came back"
                batch = await consumer.fetch(timeout_s=0.5)
            assert [d.group.group_id for d in batch] == ["big"] and batch[0].num_delivered >= 2
            np.testing.assert_array_equal(batch[0].group.tokens, big.tokens)
        finally:
            await nc.close()
            await proxy.close()
            writer.close()
            reader.close()

    asyncio.run(main())


# --- dead letters (hypothesis) ---------------------------------------------------------------------------------


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


@dataclass
class _Case:
    """One fuzz input: what to publish, what the store holds, and the expected outcome."""

    headers: dict[str, str]
    body: bytes
    reasons: set[str] | None
    """Acceptable dead-letter reasons; None: the transport must deliver the group intact."""
    objects: dict[str, bytes] = field(default_factory=dict)
    """Claim objects to put in the store first."""
    store_failures: int = 0
    """Store reads that raise ConnectionError before it works again (transient: the message is redelivered)."""
    expected: TrajectoryGroup | None = None


def _pointer(key: str, body: bytes, size: int | None = None) -> bytes:
    return orjson.dumps({"key": key, "bytes": len(body) if size is None else size, "sha256": _sha(body)})


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _one_sample_group(group_id: str, tokens: np.ndarray) -> TrajectoryGroup:
    mask = np.r_[np.zeros(8, np.uint8), np.ones(len(tokens) - 8, np.uint8)]
    sample = Sample(
        tokens=tokens.astype(np.int32),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0).astype(np.float32),
        versions=np.where(mask == 1, 3, -1).astype(np.int32),
    )
    return TrajectoryGroup.from_samples(group_id=group_id, prompt_id="p", generator_id="gen-0", samples=[sample])


def _bad_message(kind: str, data: st.DataObject, group_id: str, names: RunNames) -> _Case:
    """One kind of bad input for group `group_id` of run `names` (content seeded alike for every example)."""
    good = wire_group(group_id, seed="bad-group")
    headers = group_headers(good)
    if kind == "random_bytes":
        return _Case(headers, data.draw(st.binary(max_size=2048)), {"decode_error"})
    if kind == "truncated":
        # A fraction, not an index: the body holds this example's random group id, so its compressed length
        # differs between hypothesis's replays of one example, and a draw bounded by it would differ too.
        body = encode_group(good)
        cut = data.draw(st.floats(0, 1, exclude_max=True))
        return _Case(headers, body[: int(cut * len(body))], {"decode_error"})
    if kind == "wrong_schema":
        cols = data.draw(st.lists(st.sampled_from(["tokens", "reward", "x"]), min_size=1, max_size=3, unique=True))
        batch = pa.record_batch([pa.array(np.arange(3, dtype=np.int64)) for _ in cols], names=cols)
        return _Case(headers, _ipc(batch), {"schema_mismatch"})
    if kind == "lengths_disagree":
        batch = group_to_record_batch(good)
        column = data.draw(st.sampled_from(["loss_mask", "logprobs", "versions"]))
        values = batch.column(column).to_pylist()
        values[1] = values[1][: -data.draw(st.integers(1, 5))]
        fixed = batch.set_column(
            batch.schema.get_field_index(column),
            TRAJECTORY_SCHEMA.field(column),
            pa.array(values, TRAJECTORY_SCHEMA.field(column).type),
        )
        return _Case(headers, _ipc(fixed), {"validation_error"})
    if kind == "huge_length":
        raw = bytearray(encode_group(good))
        pattern = struct.pack("<q", good.num_tokens * 4)  # a zstd buffer's declared uncompressed length
        at = raw.find(pattern)
        raw[at : at + 8] = struct.pack("<q", data.draw(st.sampled_from([2**31, 2**40, 2**62])))
        return _Case(headers, bytes(raw), {"too_large"})
    if kind == "decompression_bomb":  # a few KB that inflate to megabytes more than the headers announce
        return _Case(headers, _bomb_body(), {"too_large"})
    if kind == "tokens_header_mismatch":
        said = good.num_tokens + data.draw(st.sampled_from([-1, 1, 64]))
        return _Case({**headers, H_NUM_TOKENS: str(said)}, encode_group(good), {"header_mismatch"})
    body = encode_group(good)
    own_key = names.trajectory_key(group_id, _sha(body))
    if kind == "missing_claim":
        return _Case({**headers, H_CLAIM_CHECK: own_key}, _pointer(own_key, body), {"claim_check_missing"})
    if kind == "invalid_claim_key":  # keys that escape the prefix, and a size past the limit: refused unread
        key = data.draw(st.sampled_from(["../x", "/a", f"{names.run}/../{own_key}", f"{names.run}//x", "a/./b", "big"]))
        size = CLAIM_CHECK_MAX_BYTES + 1 if key == "big" else None
        key = own_key if key == "big" else key
        objects = {own_key: body} if size else {}
        return _Case({**headers, H_CLAIM_CHECK: key}, _pointer(key, body, size), {"claim_check_invalid"}, objects)
    if kind == "foreign_claim":  # a readable object of another run or group: never fetched
        other = data.draw(st.sampled_from(["run", "group", "digest"]))
        if other == "run":
            key = RunNames.for_run(f"other-{names.run}").trajectory_key(group_id, _sha(body))
        elif other == "group":
            key = names.trajectory_key(f"other-{group_id}", _sha(body))
        else:
            key = names.trajectory_key(group_id, "0" * 64)
        return _Case({**headers, H_CLAIM_CHECK: key}, _pointer(key, body), {"claim_check_foreign"}, {key: body})
    if kind == "size_mismatch":
        pointer = _pointer(own_key, body, len(body) + data.draw(st.sampled_from([-1, 1, 4096])))
        return _Case({**headers, H_CLAIM_CHECK: own_key}, pointer, {"claim_check_mismatch"}, {own_key: body})
    if kind == "store_down":  # transient: redelivered with backoff, delivered once the store answers
        failures = data.draw(st.integers(1, 2))
        return _Case(
            {**headers, H_CLAIM_CHECK: own_key}, _pointer(own_key, body), None, {own_key: body}, failures, good
        )
    # Out-of-vocab ids and over-long samples are decided at the trainer's door (actors/trainer), which knows
    # the model's vocabulary and context and dead-letters them with a reason; the transport must deliver them
    # intact (decode succeeds) so that the trainer can.
    if kind == "out_of_vocab_token":
        tokens = np.arange(48) % 1000
        tokens[data.draw(st.integers(8, 47))] = data.draw(st.sampled_from([2**20, 2**31 - 1]))
        group = _one_sample_group(group_id, tokens)
        return _Case(group_headers(group), encode_group(group), None, expected=group)
    if kind == "over_long_sample":
        group = _one_sample_group(group_id, np.arange(data.draw(st.sampled_from([2**17, 2**18 + 1]))) % 997)
        return _Case(group_headers(group), encode_group(group), None, expected=group)
    assert kind == "random_headers"
    junk = data.draw(
        st.dictionaries(
            st.sampled_from(["Leeway-Schema-Version", "Leeway-Min-Version", "X"]),
            st.text("0123456789abc-", max_size=4),
            max_size=3,
        )
    )
    return _Case(junk, body, {"schema_mismatch", "bad_headers", "header_mismatch"})


@functools.cache
def _bomb_body() -> bytes:
    """One sample of 2^21 zero tokens: ~27 MB decoded from a few KB (built once for every example)."""
    bomb = _one_sample_group("bomb", np.zeros(1 << 21, np.int64))
    body = encode_group(bomb)
    assert len(body) < 64 * 1024
    return body


class _FlakyStore(FileStore):
    """A FileStore whose next `failures` reads raise ConnectionError, as an unreachable S3 endpoint does."""

    failures = 0

    def _maybe_fail(self, key: str) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError(f"store unreachable reading {key!r}")

    def size(self, key: str) -> int:
        self._maybe_fail(key)
        return super().size(key)

    def get(self, key: str) -> bytes:
        self._maybe_fail(key)
        return super().get(key)


@pytest.fixture(scope="module")
def fuzz_env(stack, tmp_path_factory):
    """One loop, connection and consumer for all hypothesis examples (each example costs milliseconds)."""
    loop = asyncio.new_event_loop()
    names, stream = _names(), _stream()
    nc, js = loop.run_until_complete(_setup(stack.nats_url, names, stream))
    store = _FlakyStore(tmp_path_factory.mktemp("claims"))
    consumer = loop.run_until_complete(TrajectoryConsumer.bind(js, names, stream, store))
    yield loop, js, names, consumer, store
    loop.run_until_complete(nc.close())
    loop.close()


KINDS = [
    "random_bytes",
    "truncated",
    "wrong_schema",
    "lengths_disagree",
    "huge_length",
    "decompression_bomb",
    "tokens_header_mismatch",
    "missing_claim",
    "invalid_claim_key",
    "foreign_claim",
    "size_mismatch",
    "store_down",
    "out_of_vocab_token",
    "over_long_sample",
    "random_headers",
]


async def _last_dead_letter(js, names: RunNames):
    try:
        return await js.get_last_msg(names.dead_letter_stream, names.trajectory_dead_letter_subject)
    except nats.js.errors.NotFoundError:
        return None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_bad_messages_end_in_dead_letters_and_the_consumer_keeps_going(fuzz_env, kind, data):
    loop, js, names, consumer, store = fuzz_env
    msg_id = f"raw-{uuid.uuid4().hex[:12]}"
    case = _bad_message(kind, data, msg_id, names)
    wanted = {f"ok-{msg_id}"} | ({msg_id} if case.reasons is None else set())

    async def main() -> None:
        for key, obj in case.objects.items():
            store.put(key, obj)
        store.failures = case.store_failures
        await js.publish(names.trajectory_subject, case.body, headers={**case.headers, "Nats-Msg-Id": msg_id})
        await TrajectoryPublisher(js, names, _stream()).publish(wire_group(f"ok-{msg_id}"))
        got: dict[str, object] = {}
        deadline = time.monotonic() + 20
        while not wanted <= set(got):
            assert time.monotonic() < deadline, ("consumer blocked", kind, sorted(got))
            batch = await consumer.fetch(timeout_s=0.5)
            got.update({d.group.group_id: d for d in batch})
            await consumer.ack([d.seq for d in batch])
        assert set(got) == wanted, kind  # a bad one never reaches the trainer; a transient one does, once
        last = await _last_dead_letter(js, names)
        if case.reasons is None:
            assert last is None or last.headers["Leeway-Original-Msg-Id"] != msg_id, (kind, last.headers)
            delivery = got[msg_id]
            assert delivery.num_delivered == case.store_failures + 1 and store.failures == 0
            np.testing.assert_array_equal(delivery.group.tokens, case.expected.tokens)
            return
        assert last.headers[H_DLQ_REASON] in case.reasons, (kind, last.headers)
        assert last.headers["Leeway-Original-Msg-Id"] == msg_id
        assert last.data == case.body or (not case.body and not last.data)

    try:
        loop.run_until_complete(main())
    finally:
        store.failures = 0


def test_jetstream_unavailable_in_a_fetch_is_ridden_out_not_raised(stack):
    """A fetch answered "service unavailable" (503) returns nothing instead of raising, and the consumer gets
    its groups once JetStream answers again. Caused for real by removing the consumer the fetch asks: the
    server answers its fetch requests with the same 503 as when it disabled JetStream (a full store)."""

    async def main() -> None:
        names, stream = _names(), _stream()
        nc, js = await _setup(stack.nats_url, names, stream)
        try:
            consumer = await TrajectoryConsumer.bind(js, names, stream)
            await js.delete_consumer(names.trajectory_stream, names.trainer_consumer)
            assert await consumer.fetch(timeout_s=0.3) == []  # was: ServiceUnavailableError out of fetch
            assert await consumer.fetch(timeout_s=0.3) == []
            await ensure_trainer_consumer(js, names)  # back
            await TrajectoryPublisher(js, names, stream).publish(wire_group("g0", version=0))
            assert await _drain(consumer, 1) == ["g0"]
        finally:
            await nc.close()

    asyncio.run(main())
