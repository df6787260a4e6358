"""The prompt work queue: the trainer admits prompts, generators take them, each prompt is done once.

    trainer ── PromptQueue.admit(prompt) ──► leeway.<run>.prompts (stream LEEWAY_<run>_PROMPTS, work queue)
                                                   │ durable pull consumer "generators", shared
    generator ◄── PromptQueue.take() ◄─────────────┘ PromptLease: in_progress() while rolling out,
                                                     done() only after the group is published

One message per prompt: the `pipeline.wire.prompts.Prompt` as JSON (its ``schema_version``, answer, tags,
metadata and the admission ``policy_version`` included), ``Nats-Msg-Id`` = prompt id, so admitting a prompt
twice stores it once. Publishes are bounded and retried like the trajectories' (`pipeline/wire/jetstream.py`).
A message that does not decode, or is in a schema version this build does not read, is dead-lettered
(reason `bad_prompt`), never dropped; a generator that
finds a prompt it can never roll out (`PromptLease.reject`, e.g. ``invalid_token_ids``) dead-letters it too,
so it neither comes back forever nor takes a batch down with it.
A generator that dies holding a prompt stops heartbeating; after `prompt_ack_wait_s` the server
redelivers the prompt to another generator. A generator runs a prompt on its first `prompt_max_deliver`
deliveries; a later one is not run but dead-lettered (reason `max_deliveries`) and terminated, so a prompt
that kills every generator ends up inspectable instead of looping or vanishing.

The server allows unlimited deliveries (`PROMPT_SERVER_MAX_DELIVER`): the limit is the generators' (`receive`
in `pipeline/wire/jetstream.py`), and past it a delivery only tries to store the dead letter, nak'ed with a
growing delay while that fails. A server-side limit would strand the prompt (still in the work queue, never
delivered again, its admission slot held for good) whenever the dead-letter stream is away or full for its
last delivery, or the generator holding that delivery dies; with none it is dead-lettered once the
dead-letter stream takes writes again, whatever happened meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from pipeline.wire.headers import H_MSG_ID
from pipeline.wire.jetstream import (
    ACK_TIMEOUT_S,
    DUPLICATE_WINDOW_S,
    BoundedPublisher,
    DeadLetterError,
    DeadLetters,
    PublishSettings,
    ensure_stream,
    pull,
    receive,
)
from pipeline.wire.names import RunNames
from pipeline.wire.prompts import Prompt, PromptError

PROMPT_FETCH_TIMEOUT_S = 1.0
"""Default long-poll of one `take`; returns [] after it."""
PROMPT_SERVER_MAX_DELIVER = -1
"""The prompt consumer's server-side delivery limit: none. `prompt_max_deliver` is enforced by the generators,
and the deliveries past it (dead-letter tries, not runs) never run out; see the module docstring."""


class PromptSettings(PublishSettings, Protocol):
    """The `stream` config fields (`pipeline.config.StreamConfig`) the prompt queue reads, publish ones included."""

    prompt_ack_wait_s: float
    prompt_max_deliver: int
    max_msg_bytes: int
    replicas: int


def queue_prompt(prompt: Prompt, policy_version: int) -> Prompt:
    """A task's prompt as the trainer admits it: stamped with the version the trainer held at admission."""
    return replace(prompt, policy_version=int(policy_version))


@dataclass(eq=False)
class PromptLease:
    """A prompt held by one generator until `done()` (after its group is published), `release()` (give it
    back) or `reject()` (dead-letter it: it can never succeed)."""

    prompt: Prompt
    msg: Msg
    num_delivered: int
    dead_letters: DeadLetters

    async def in_progress(self) -> None:
        """Heartbeat: resets the ack wait, so a long rollout keeps its prompt."""
        await self.msg.in_progress()

    async def done(self) -> None:
        """The group is published: remove the prompt from the queue (confirmed by the server)."""
        await self.msg.ack_sync(timeout=ACK_TIMEOUT_S)

    async def release(self, delay_s: float | None = None) -> None:
        """Give the prompt back for another generator (e.g. on shutdown)."""
        await self.msg.nak(delay=delay_s)

    async def reject(self, reason: str, detail: str) -> None:
        """Dead-letter the prompt (original bytes, `reason`, `detail`) and terminate it, for a prompt no retry
        can roll out. If the dead letter cannot be stored, the prompt is nak'ed and comes back later (then past
        `prompt_max_deliver` it is dead-lettered as `max_deliveries`, tried again until stored)."""
        await self.dead_letters.dispose(self.msg, reason, detail)


async def ensure_prompt_queue(js: JetStreamContext, names: RunNames, stream: PromptSettings) -> None:
    """The work-queue stream and the generators' durable consumer (idempotent)."""
    await ensure_stream(
        js,
        StreamConfig(
            name=names.prompt_stream,
            subjects=[names.prompt_subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_msg_size=stream.max_msg_bytes,
            num_replicas=stream.replicas,
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
    )
    config = ConsumerConfig(
        durable_name=names.generator_consumer,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=stream.prompt_ack_wait_s,
        max_deliver=PROMPT_SERVER_MAX_DELIVER,
        filter_subject=names.prompt_subject,
    )
    await js.add_consumer(names.prompt_stream, config)


class PromptQueue:
    """Both ends of the queue; the trainer calls `admit`, generators call `take`."""

    def __init__(self, js: JetStreamContext, names: RunNames, stream: PromptSettings) -> None:
        self._js = js
        self._names = names
        self._stream = stream
        self._publisher = BoundedPublisher(js, stream)
        self._sub: JetStreamContext.PullSubscription | None = None
        self.dead_letters = DeadLetters(js, names.prompt_dead_letter_subject)

    async def admit(self, prompt: Prompt) -> bool:
        """Enqueue a prompt (`Nats-Msg-Id` = prompt id); False if the queue already had it (deduped).

        Raises `pipeline.wire.jetstream.PublishError` when the server does not confirm it after the retries."""
        ack, _ = await self._publisher.publish(
            self._names.prompt_subject,
            prompt.to_json(),
            {H_MSG_ID: prompt.prompt_id},
            stream_name=self._names.prompt_stream,
        )
        return not ack.duplicate

    async def admit_many(self, prompts: Iterable[Prompt]) -> int:
        """Enqueue several; returns how many were new."""
        results = await asyncio.gather(*(self.admit(p) for p in prompts))
        return sum(results)

    async def take(self, max_prompts: int = 1, timeout_s: float = PROMPT_FETCH_TIMEOUT_S) -> list[PromptLease]:
        """Up to `max_prompts` leases; [] when none arrived within `timeout_s`. Bad prompts are dead-lettered."""
        if self._sub is None:
            self._sub = await self._js.pull_subscribe_bind(
                self._names.generator_consumer, stream=self._names.prompt_stream
            )
        leases = []
        for msg in await pull(self._sub, max_prompts, timeout_s):
            lease = await self._receive(msg)
            if lease is not None:
                leases.append(lease)
        return leases

    async def _receive(self, msg: Msg) -> PromptLease | None:
        max_deliver = self._stream.prompt_max_deliver
        prompt = await receive(msg, self.dead_letters, max_deliver=max_deliver, decode=_decode_prompt)
        if prompt is None:
            return None
        return PromptLease(prompt, msg, msg.metadata.num_delivered, self.dead_letters)

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            self._sub = None


async def _decode_prompt(msg: Msg) -> Prompt:
    """The prompt of `msg`; a payload that is not a valid prompt record is a `bad_prompt` dead letter."""
    try:
        return Prompt.from_json(msg.data)
    except PromptError as exc:
        raise DeadLetterError("bad_prompt", str(exc)) from exc


__all__: Sequence[str] = [
    "Prompt",
    "PromptError",
    "PromptLease",
    "PromptQueue",
    "ensure_prompt_queue",
    "queue_prompt",
]
