"""Admission slots of prompts and groups dead-lettered before they reached the trainer.

Admission (`pipeline/rl/staleness.py`) keeps `admitted - trained - dropped` groups outstanding. A group
the trainer drops or dead-letters gives its slot back when it is decided. But a prompt dead-lettered
by the prompt queue (`max_deliveries`: it killed every generator that took it) and a group
dead-lettered by the trajectory consumer (it failed to decode) never reach the trainer: without
this module their slots would stay taken until admission stalls and the queue-wait timeout ends
the run. So the trainer reads the run's dead-letter stream (both subjects) from a watermark,
`TrainerState.dead_letter_seq`, and returns one slot per dead-lettered id that

- is an id the trainer admitted (`<task prompt id>.<i>` with `i` below `TrainerState.admitted`;
  a prompt id is also its group's id), so a stray publisher cannot widen admission; and
- is not handled yet (trained, dropped, refused, or returned before) nor in the open batch: a
  group the trainer dead-letters itself is counted by its step, not again here.

A returned id joins the trainer's handled ids, so a group that still turns up for it later (its
prompt was dead-lettered while a slow generator finished it) is skipped as a duplicate: one slot,
one decision. The watermark, the count (`TrainerState.dead_lettered_groups`) and the handled ids
are checkpointed together, so a resume reads on exactly where the checkpoint stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from actors.trainer.prompt_feed import admitted_index
from pipeline.wire.names import RunNames
from pipeline.wire.transport import H_DLQ_MSG_ID, H_DLQ_REASON

log = logging.getLogger(__name__)

DEAD_LETTER_READS_PER_CALL = 256
"""Dead letters read per admission round at most (they are rare; a flood is read over several rounds)."""
DEAD_LETTER_READ_TIMEOUT_S = 2.0
"""Bound on one stream-info or message-get request to the dead-letter stream."""


@dataclass(frozen=True)
class DeadLetterEntry:
    """One message of the run's dead-letter stream, as far as admission cares."""

    seq: int
    subject: str
    reason: str
    original_id: str | None
    """The dead-lettered message's `Nats-Msg-Id` (a prompt's or a group's id); None if it had none."""


def slots_to_return(entries: Sequence[DeadLetterEntry], *, admitted: int, is_known: Callable[[str], bool]) -> list[str]:
    """The ids among `entries` whose admission slot comes back (see the module docstring), each once."""
    out: list[str] = []
    for entry in entries:
        group_id = entry.original_id
        if group_id is None or group_id in out or is_known(group_id):
            continue
        index = admitted_index(group_id)
        if index is None or index >= admitted:
            continue
        out.append(group_id)
    return out


async def read_dead_letters(
    js: JetStreamContext, names: RunNames, *, after_seq: int, limit: int = DEAD_LETTER_READS_PER_CALL
) -> tuple[list[DeadLetterEntry], int]:
    """Dead letters stored after stream sequence `after_seq` (at most `limit`), and the new watermark.

    Entries removed by the stream's retention before they were read are logged (their slots cannot
    be returned). Raises the NATS error if the server does not answer; the caller tries again later.
    """
    info = await js.stream_info(names.dead_letter_stream)
    first, last = int(info.state.first_seq), int(info.state.last_seq)
    if last <= after_seq:
        return [], after_seq
    if first > after_seq + 1:
        log.warning(
            "dead-letter stream: seqs %d..%d were removed by retention before the trainer read them; "
            "their admission slots are not returned",
            after_seq + 1,
            first - 1,
        )
    entries: list[DeadLetterEntry] = []
    watermark = max(after_seq, first - 1)
    seq = watermark + 1
    while seq <= last and len(entries) < limit:
        try:
            raw = await asyncio.wait_for(
                js.get_msg(names.dead_letter_stream, seq=seq, subject=names.dead_letter_subjects, next=True),
                DEAD_LETTER_READ_TIMEOUT_S,
            )
        except nats.js.errors.NotFoundError:
            watermark = last
            break
        headers = raw.headers or {}
        entries.append(
            DeadLetterEntry(int(raw.seq), str(raw.subject), headers.get(H_DLQ_REASON, ""), headers.get(H_DLQ_MSG_ID))
        )
        watermark = int(raw.seq)
        seq = watermark + 1
    return entries, watermark


async def read_dead_letters_quietly(
    js: JetStreamContext, names: RunNames, *, after_seq: int
) -> tuple[list[DeadLetterEntry], int]:
    """`read_dead_letters`, but a server that does not answer now yields nothing (admission tries again)."""
    try:
        return await read_dead_letters(js, names, after_seq=after_seq)
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        log.debug("dead-letter stream not read this round: %s: %s", type(exc).__name__, exc)
        return [], after_seq
