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

Anyone holding the run's NATS token can publish on the dead-letter subjects, so before either check an
entry must refer to a message that exists (`DeadLetterCheck`): a trajectory dead letter names a
sequence of the trajectory stream that holds that very group id (the stream keeps terminated
messages); a prompt dead letter names a sequence of the prompt queue that was used and no longer
holds that prompt (a dead-lettered prompt is terminated, so it leaves the work queue; one still
queued is held back for `DEAD_LETTER_HOLD_S`, the time its genuine termination can take, then
refused). Other entries (no or foreign original stream, a sequence never used or holding another id,
an unknown subject) are forged: counted (`DeadLetterCheck.forged`), logged and ignored, so the real
group still trains. What the check cannot tell: an original already removed by retention (accepted:
its slot must not leak), or a prompt a generator already took out of the queue.

Existing is not enough: a dead letter must also not cancel a group still in flight. Only the trainer may
publish trajectory dead letters (the stack's per-role NATS users, `infra/nats_server.py`), and on a server
without them the check still holds one naming a message this trainer did not terminate itself until the
trainer consumer's ack floor passes it (the message is then decided: trained, so its id is handled, or
terminated); a forged one naming a live group is thus never read before that group trained. Generators may
publish prompt dead letters, so one is refused while its group is stored above the ack floor
(`pipeline/wire/in_flight.py`): that group arrives and trains.

A returned id joins the trainer's handled ids, so a group that still turns up for it later (its
prompt was dead-lettered while a slow generator finished it) is skipped as a duplicate: one slot,
one decision. The watermark, the count (`TrainerState.dead_lettered_groups`) and the handled ids
are checkpointed together, so a resume reads on exactly where the checkpoint stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container, Sequence

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from actors.trainer.prompt_feed import admitted_index
from pipeline.wire.headers import H_MSG_ID
from pipeline.wire.in_flight import TooManyInFlight, in_flight_ids, trainer_ack_floor
from pipeline.wire.jetstream import DeadLetterEntry, read_dead_letters
from pipeline.wire.names import RunNames

log = logging.getLogger(__name__)

DEAD_LETTER_READS_PER_CALL = 256
"""Dead letters read per admission round at most (they are rare; a flood is read over several rounds)."""
DEAD_LETTER_HOLD_S = 30.0
"""How long a prompt dead letter whose prompt is still queued waits for its termination before it is refused
as forged (`DeadLetters.dispose` stores the copy, then terminates: one bounded request, 5 s at most)."""
CHECK_TIMEOUT_S = 5.0
"""Bound on one stream request of the check; a timeout leaves the entry to the next admission round."""
IN_FLIGHT_SCAN_LIMIT = 100_000
"""Trajectory messages above the ack floor one prompt dead letter's check reads (headers only) at most; past
it the entry waits for the backlog to drain."""


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


class DeadLetterCheck:
    """Which dead letters refer to a message that exists (see the module docstring); `forged` counts the rest."""

    def __init__(
        self,
        js: JetStreamContext,
        names: RunNames,
        *,
        clock: Callable[[], float] = time.monotonic,
        terminated: Container[int] = frozenset(),
        trajectory_letters_trusted: bool = False,
    ) -> None:
        self._js = js
        self._names = names
        self._clock = clock
        self._terminated = terminated
        """Trajectory seqs this trainer dead-lettered itself (`DeadLetters.terminated`): decided, trusted at once."""
        self._trajectory_letters_trusted = trajectory_letters_trusted
        """Only trainers (and the operator) can write trajectory dead letters on this server (per-role users): one
        naming a message that holds its group is trusted at once, also those an earlier trainer process wrote
        (`terminated` is this process's only; waiting for the ack floor could hold their slots past a restart)."""
        self.forged = 0
        """Dead letters refused as forged or unknown since this trainer started."""
        self._held_since: dict[int, float] = {}

    async def genuine(self, entries: Sequence[DeadLetterEntry], watermark: int) -> tuple[list[DeadLetterEntry], int]:
        """The genuine ones among `entries` (read up to `watermark`), and the watermark to keep.

        An entry that cannot be decided now (its prompt is still queued, or the server did not answer) stops
        the round: the watermark stays just before it, so the next round reads it (and those after) again."""
        out: list[DeadLetterEntry] = []
        for entry in entries:
            try:
                why = await self._forged_because(entry)
            except (nats.errors.Error, asyncio.TimeoutError, TooManyInFlight) as exc:
                log.debug("dead letter %d not checked this round: %s: %s", entry.seq, type(exc).__name__, exc)
                return out, entry.seq - 1
            if why == _IN_FLIGHT:  # its group is not decided yet: read it again once it is
                log.debug("dead letter %d names seq %s, still in flight: held", entry.seq, entry.original_seq)
                return out, entry.seq - 1
            if why == _WAIT:
                first = self._held_since.setdefault(entry.seq, self._clock())
                if self._clock() - first < DEAD_LETTER_HOLD_S:
                    return out, entry.seq - 1
                why = f"its prompt is still queued {DEAD_LETTER_HOLD_S:.0f} s later"
            self._held_since.pop(entry.seq, None)
            if why is None:
                out.append(entry)
                continue
            self.forged += 1
            log.warning(
                "ignoring dead letter %d (%s, id %r, original %s seq %s): %s; %d forged or unknown so far",
                entry.seq,
                entry.subject,
                entry.original_id,
                entry.original_stream,
                entry.original_seq,
                why,
                self.forged,
            )
        return out, watermark

    async def _forged_because(self, entry: DeadLetterEntry) -> str | None:
        """None: genuine; `_WAIT`: not decidable yet; else why it is refused."""
        names = self._names
        if entry.subject == names.trajectory_dead_letter_subject:
            stream, kept = names.trajectory_stream, True
        elif entry.subject == names.prompt_dead_letter_subject:
            stream, kept = names.prompt_stream, False
        else:
            return f"subject {entry.subject!r} is no dead-letter subject of run {names.run!r}"
        if entry.original_id is None or entry.original_seq is None or entry.original_stream != stream:
            return f"it names no original message of stream {stream}"
        if entry.original_seq < 1:  # not below the first seq by retention: no stream ever had it
            return f"{stream} has no seq {entry.original_seq} (sequences start at 1)"
        try:
            raw = await asyncio.wait_for(self._js.get_msg(stream, seq=entry.original_seq), CHECK_TIMEOUT_S)
        except nats.js.errors.NotFoundError:
            info = await asyncio.wait_for(self._js.stream_info(stream), CHECK_TIMEOUT_S)
            if entry.original_seq > info.state.last_seq:
                return f"{stream} never had seq {entry.original_seq} (last {info.state.last_seq})"
            if kept and entry.original_seq >= info.state.first_seq:
                return f"{stream} seq {entry.original_seq} was deleted, not dead-lettered"
            if kept:
                return None  # removed by retention
            return await self._group_stored(entry.original_id)  # taken out of the work queue
        held = (raw.headers or {}).get(H_MSG_ID)
        if held != entry.original_id:
            return f"{stream} seq {entry.original_seq} holds {held!r}, not {entry.original_id!r}"
        if not kept:
            return _WAIT
        if entry.original_seq in self._terminated or self._trajectory_letters_trusted:
            return None
        floor = await trainer_ack_floor(self._js, names)
        return None if entry.original_seq <= floor else _IN_FLIGHT

    async def _group_stored(self, group_id: str) -> str | None:
        """Why a prompt dead letter for `group_id` is refused: its group is stored and not decided yet (it will
        train), or None."""
        found = await in_flight_ids(self._js, self._names, {group_id}, limit=IN_FLIGHT_SCAN_LIMIT)
        if group_id in found:
            stream = self._names.trajectory_stream
            return f"its group is stored in {stream} at seq {found[group_id]}, in flight: it trains"
        return None


_WAIT = "wait"
_IN_FLIGHT = "in flight"
