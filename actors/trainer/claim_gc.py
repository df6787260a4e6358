"""Deleting claim-check objects (`pipeline/wire/claim_check.py`) the run no longer needs, so a long run's
object store does not fill with every large group it ever trained.

An object is needed while its message can still be delivered or replayed: until the trainer acks the
group (trained, dropped or refused in a committed step) and, for `leeway replay` and `--replay`, while
the trajectory stream still holds the message; and a resume re-reads (and trains again) every group
after its checkpoint's watermark. So the consumer notes the (stream seq, key) of every claim-checked
group it acks; the live session moves them into the checkpointed state and, once a checkpoint is
written, deletes those at or below its watermark that `stream.claim_gc` allows:

- `after_retention` (default): seqs below the stream's first sequence (retention removed the message);
- `after_ack`: every acked one at once (a replay of those groups then skips them, counted, as
  `claim_check_missing`);
- `never`: none (nothing is recorded either).

Objects of dead-lettered groups are not recorded: the dead letter keeps pointing at them for a person to
inspect. Acks since the last checkpoint are lost with a killed trainer, and so are their records: at most a
checkpoint interval of objects per crash is left behind (`leeway purge` removes a run's objects whole).
A failed delete keeps the record and is tried again at the next checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from nats.js import JetStreamContext

from pipeline.wire.names import RunNames
from storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

STREAM_INFO_TIMEOUT_S = 5.0


async def collect_claims(
    js: JetStreamContext,
    store: ObjectStore,
    names: RunNames,
    pending: Sequence[tuple[int, str]],
    *,
    policy: str,
    up_to_seq: int,
) -> list[tuple[int, str]]:
    """Delete the objects of `pending` at or below `up_to_seq` (a written checkpoint's watermark) that `policy`
    allows now; returns the records still to keep."""
    if policy == "never" or not pending:
        return []
    if policy == "after_ack":
        first_seq = None
    else:
        try:
            info = await asyncio.wait_for(js.stream_info(names.trajectory_stream), STREAM_INFO_TIMEOUT_S)
        except Exception as exc:  # a boundary: the records wait for the next checkpoint
            log.warning("claim objects not collected this time (stream info: %s: %s)", type(exc).__name__, exc)
            return list(pending)
        first_seq = int(info.state.first_seq)
    doomed = [(seq, key) for seq, key in pending if seq <= up_to_seq and (first_seq is None or seq < first_seq)]
    if not doomed:
        return list(pending)
    try:
        await asyncio.to_thread(store.delete_many, [key for _, key in doomed])
    except Exception as exc:  # a boundary: kept, tried again at the next checkpoint
        log.warning(
            "deleting %d claim objects failed (%s: %s); tried again later", len(doomed), type(exc).__name__, exc
        )
        return list(pending)
    log.info("deleted %d claim objects of acked groups (%s)", len(doomed), policy)
    gone = set(doomed)
    return [(seq, key) for seq, key in pending if (seq, key) not in gone]
