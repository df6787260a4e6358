"""How often resumed trainers re-read each group past the checkpoint's watermark, counted across resumes.

A resumed trainer re-reads the trajectory stream from `consumed_seq + 1` through an `ack none` replay
reader (`pipeline/wire/replay.py`), which counts no deliveries, and JetStream's `max_deliver` covers the
durable consumer only. A group that kills the trainer (a backend crash, an OOM) is never committed, so
it stays past the watermark and every resume would train it again: a crash loop no limit ends.

So the trainer keeps its own count, in a small JSON object it alone writes::

    <run>/trainer/resume_reads.json   {"format": 1, "reads": {"<stream seq>": [count, "<group id>"], ...}}

`LiveSession.fetch` adds one read for every group the catch-up hands the loop and stores the counts
*before* it returns them, so a group that kills the trainer has its read on record. A group read more
than the limit (the durable consumer's handled deliveries, `TrajectoryConsumer.max_deliver`) is not
returned: it is dead-lettered as `max_deliveries` (`dead_letter_stored`, a copy of the stored message,
deduplicated by the same `Nats-Msg-Id` the consumer's dead letters carry), and its admission slot comes
back through the dead-letter stream like any other (`actors/trainer/slots.py`). Entries at or below a
later resume's watermark are forgotten (those sequences were decided in a committed step).

The count is of reads, as JetStream counts deliveries: a group read by resumes that all died of
something else (a SIGKILL before the next checkpoint) counts too, so the limit is the consumer's,
large (20), not one. Every group of the batch that kills the step is read as often as the culprit (the
stream order, hence the batch, is the same on every resume), so its batch mates are dead-lettered with
it: inspectable, their slots returned, never trained twice nor silently lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.js.errors
import orjson
from nats.js import JetStreamContext

from pipeline.wire.consumer import Delivery
from pipeline.wire.headers import H_DLQ_BODY_OMITTED
from pipeline.wire.jetstream import dead_letter_headers
from pipeline.wire.names import RunNames
from pipeline.wire.retry import retry_async
from storage.objectstore import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)

READS_FORMAT = 1
"""Version of `resume_reads.json`; another is ignored with a warning (counting starts again)."""
DEAD_LETTER_TIMEOUT_S = 5.0
"""Bound on one read of the stored message or one dead-letter publish (the caller retries)."""
POISON_REASON = "max_deliveries"
"""The dead-letter reason: the same as the consumer's for a group delivered past its limit."""


def resume_reads_key(run: str) -> str:
    return f"{run}/trainer/resume_reads.json"


class ResumeReads:
    """The counts of one run (see the module docstring); `read` counts, `save` stores them."""

    def __init__(self, store: ObjectStore, run: str, reads: dict[int, tuple[int, str]] | None = None) -> None:
        self.store = store
        self.run = run
        self.reads: dict[int, tuple[int, str]] = dict(reads or {})
        """Stream seq -> (reads so far, group id)."""

    @classmethod
    def load(cls, store: ObjectStore, run: str, *, after_seq: int) -> ResumeReads:
        """The stored counts of the sequences past `after_seq` (the watermark being resumed from).

        Missing: none. Unreadable (not ours, truncated): logged at WARNING naming the key, and counting
        starts again; refusing to resume over a counter would be worse than re-counting."""
        key = resume_reads_key(run)
        try:
            raw = orjson.loads(store.get(key))
            if not isinstance(raw, dict) or raw.get("format") != READS_FORMAT:
                raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else None!r}")
            reads = {int(seq): (int(entry[0]), str(entry[1])) for seq, entry in raw["reads"].items()}
        except ObjectNotFound:
            return cls(store, run)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            log.warning("%s is unreadable (%s); counting resume reads from zero", key, exc)
            return cls(store, run)
        return cls(store, run, {seq: entry for seq, entry in reads.items() if seq > after_seq})

    def read(self, seq: int, group_id: str) -> int:
        """Count one more read of `seq`; returns the reads so far, this one included."""
        count = self.reads.get(seq, (0, group_id))[0] + 1
        self.reads[seq] = (count, group_id)
        return count

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"format": READS_FORMAT, "reads": {str(s): [n, g] for s, (n, g) in sorted(self.reads.items())}}
        )

    def save(self) -> None:
        self.store.put(resume_reads_key(self.run), self.to_json())

    async def screen(
        self, deliveries: Sequence[Delivery], js: JetStreamContext, names: RunNames, *, limit: int, max_body: int
    ) -> tuple[list[Delivery], list[str]]:
        """Count a read of each re-read group and store the counts before any of them can train; dead-letter
        the groups read more than `limit` times instead. Returns the groups to hand on and the ids dead-lettered.

        Both writes are retried; one that still fails ends the run with the counts on record, so the next
        resume dead-letters the group again instead of training it."""
        counted = [(d, self.read(d.seq, d.group.group_id)) for d in deliveries]
        await retry_async(lambda: asyncio.to_thread(self.save), what="storing the resume read counts")
        keep: list[Delivery] = []
        poisoned: list[str] = []
        for delivery, count in counted:
            if count <= limit:
                keep.append(delivery)
                continue
            seq, group_id = delivery.seq, delivery.group.group_id
            detail = f"re-read {count} times by resumed trainers without a committed step (limit {limit})"
            log.error("group %s (stream seq %d) %s: dead-lettered as %s", group_id, seq, detail, POISON_REASON)
            await retry_async(
                lambda: dead_letter_stored(js, names, seq, POISON_REASON, detail, max_body=max_body),  # noqa: B023
                what=f"dead-lettering group {group_id} (stream seq {seq})",
            )
            poisoned.append(group_id)
        return keep, poisoned


async def dead_letter_stored(
    js: JetStreamContext, names: RunNames, seq: int, reason: str, detail: str, *, max_body: int
) -> None:
    """Copy trajectory-stream message `seq` (as stored) to the trajectory dead-letter subject with `reason`.

    The headers are those `pipeline.wire.jetstream.DeadLetters` writes, `Nats-Msg-Id` = `<stream>:<seq>`
    included, so a dead letter of the same message by the consumer and by a resume is stored once. A body
    over `max_body` bytes is left out (`Leeway-Original-Body-Omitted-Bytes`). Raises on a NATS error."""
    stream = names.trajectory_stream
    try:
        raw = await js.get_msg(stream, seq=seq)
    except nats.js.errors.NotFoundError:  # retention removed it since it was read: nothing left to copy
        log.warning("%s seq %d is gone (retention) before its dead letter (%s) was written", stream, seq, reason)
        return
    headers = dead_letter_headers(raw.headers, reason, detail, stream=stream, seq=seq, subject=str(raw.subject))
    body = raw.data or b""
    if len(body) > max_body:
        headers[H_DLQ_BODY_OMITTED] = str(len(body))
        body = b""
    await js.publish(names.trajectory_dead_letter_subject, body, timeout=DEAD_LETTER_TIMEOUT_S, headers=headers)
