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

import nats.errors
from nats.js import JetStreamContext

from actors.trainer.prompt_feed import admitted_index
from pipeline.wire.jetstream import DeadLetterEntry, read_dead_letters
from pipeline.wire.names import RunNames

log = logging.getLogger(__name__)

DEAD_LETTER_READS_PER_CALL = 256
"""Dead letters read per admission round at most (they are rare; a flood is read over several rounds)."""


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


async def read_dead_letters_quietly(
    js: JetStreamContext, names: RunNames, *, after_seq: int
) -> tuple[list[DeadLetterEntry], int]:
    """The run's dead letters after `after_seq` (`pipeline.wire.jetstream.read_dead_letters`), and the new
    watermark; a server that does not answer now yields nothing (admission tries again next round).

    Entries removed by retention before they were read are skipped (logged there): their slots cannot come back."""
    try:
        return await read_dead_letters(js, names, after_seq=after_seq, limit=DEAD_LETTER_READS_PER_CALL)
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        log.debug("dead-letter stream not read this round: %s: %s", type(exc).__name__, exc)
        return [], after_seq
