"""Which groups are still in flight on the trajectory stream: past the trainer's ack floor, by id, headers only.

The trainer must not let a dead letter cancel a group that exists (`actors/trainer/slots.py`): a generator may
publish prompt dead letters, so one naming the prompt of a group already stored would otherwise return its
slot and mark it handled, and the real group would be acked as a duplicate, never trained. Every stored group
is either at or below the trainer consumer's ack floor (acked or terminated: decided) or above it (in flight),
so the ids above the floor are read here through an ephemeral `ack none`, headers-only consumer: no body is
transferred, and the range is bounded by the groups admission lets be outstanding.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pipeline.wire.headers import H_MSG_ID
from pipeline.wire.names import RunNames

SCAN_BATCH = 256
"""Headers fetched per request."""
SCAN_TIMEOUT_S = 5.0
"""Bound on one request of the scan."""
SCAN_INACTIVE_S = 30.0
"""The server removes a scan consumer left behind (a trainer killed mid-scan) after this long."""


class TooManyInFlight(Exception):
    """More messages above the ack floor than the caller lets one scan read: undecided, ask again later."""


async def trainer_ack_floor(js: JetStreamContext, names: RunNames) -> int:
    """The trajectory stream seq at and below which the trainer's durable consumer has acked or terminated every
    message (0 when the consumer does not exist yet)."""
    try:
        info = await asyncio.wait_for(js.consumer_info(names.trajectory_stream, names.trainer_consumer), SCAN_TIMEOUT_S)
    except nats.js.errors.NotFoundError:
        return 0
    return int(info.ack_floor.stream_seq) if info.ack_floor is not None else 0


async def in_flight_ids(js: JetStreamContext, names: RunNames, wanted: set[str], *, limit: int) -> dict[str, int]:
    """The stream seq of each id of `wanted` stored above the trainer's ack floor (a group not decided yet).

    Raises `TooManyInFlight` past `limit` messages to read, and NATS errors or timeouts as they come."""
    floor = await trainer_ack_floor(js, names)
    info = await asyncio.wait_for(js.stream_info(names.trajectory_stream), SCAN_TIMEOUT_S)
    start, last = max(floor + 1, int(info.state.first_seq)), int(info.state.last_seq)
    if not wanted or last < start:
        return {}
    if last - start + 1 > limit:
        raise TooManyInFlight(f"{last - start + 1} messages above the ack floor {floor} (limit {limit})")
    config = ConsumerConfig(
        name=f"in-flight-{uuid.uuid4().hex}",
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        filter_subject=names.trajectory_subject,
        headers_only=True,
        inactive_threshold=SCAN_INACTIVE_S,
        mem_storage=True,
    )
    await asyncio.wait_for(js.add_consumer(names.trajectory_stream, config), SCAN_TIMEOUT_S)
    sub = await js.pull_subscribe_bind(config.name, stream=names.trajectory_stream)
    found: dict[str, int] = {}
    try:
        seq = start - 1
        while seq < last:
            msgs = await sub.fetch(SCAN_BATCH, timeout=SCAN_TIMEOUT_S)
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                group_id = (msg.headers or {}).get(H_MSG_ID)
                if group_id in wanted and seq <= last:
                    found.setdefault(group_id, seq)
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await sub.unsubscribe()
            await asyncio.wait_for(js.delete_consumer(names.trajectory_stream, config.name), SCAN_TIMEOUT_S)
    return found
