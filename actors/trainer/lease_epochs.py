"""Lease epochs: which trainer held the run from when on, so that a resume never loads a checkpoint written by
a trainer that had lost the run's lease.

A trainer cut off from NATS fences itself before anyone can take its lease over (`actors/trainer/run_lease.py`),
but a write it sent just before its fence can still land after the takeover, and a fence is only as good as the
holder's clock. So every trainer that takes the lease records a new *epoch* in the store before it reads or
writes anything else of the run::

    <run>/trainer/lease_epochs/e0000000003.json
        {"format": 1, "epoch": 3, "holder": {host, pid, since_s, holder, lease_revision, epoch},
         "checkpoints": {"40": "<attempt>", ...}}        the complete checkpoints when the epoch began

numbered one past the newest record and written create-only (two takers never share a number; only the lease
holder writes one). Its holder token goes into every checkpoint manifest and weight manifest it writes.

A checkpoint of epoch `e` whose version and attempt the next record after `e` does not list was committed after
the lease had passed on: its writer had lost the lease (`superseded_by`). A resume skips it with a WARNING naming
both holders (`actors/trainer/checkpoints.py`, `resumable_checkpoints`). The lease is exclusive, so the records'
order is the order of the takes, and the rule needs no clock of any machine. A checkpoint without a holder epoch
(written before epochs existed) is judged as before: by its manifest alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from storage.objectstore import ObjectNotFound, ObjectStore, PreconditionFailed

log = logging.getLogger(__name__)

EPOCHS_FORMAT = 1
"""Version of an epoch record; a record of another format is ignored with a warning."""
BEGIN_TRIES = 16
"""Numbers tried by `begin_epoch` when a record of the number it chose appeared meanwhile (never, with one holder)."""


def epochs_prefix(run: str) -> str:
    return f"{run}/trainer/lease_epochs/"


def epoch_key(run: str, epoch: int) -> str:
    return f"{epochs_prefix(run)}e{epoch:010d}.json"


@dataclass(frozen=True)
class EpochRecord:
    """One take of the run's lease: its number, its holder token, and the checkpoints it found complete."""

    epoch: int
    holder: Mapping[str, Any]
    checkpoints: Mapping[int, str | None]
    """Version -> attempt of every complete checkpoint when the epoch began (None: a manifest without attempt)."""

    def lists(self, version: int, attempt: str | None) -> bool:
        return version in self.checkpoints and self.checkpoints[version] == attempt


def describe_holder(holder: Mapping[str, Any]) -> str:
    """`host 'h' pid 12 (holder h-12-ab12cd34, lease epoch 3)`, from a token; for log lines and refusals."""
    return (
        f"host {holder.get('host')!r} pid {holder.get('pid')} "
        f"(holder {holder.get('holder')}, lease epoch {holder.get('epoch')})"
    )


def holder_epoch(holder: object) -> int | None:
    """The epoch of a holder token read back from a manifest; None when there is none (or it is not a number)."""
    epoch = holder.get("epoch") if isinstance(holder, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def read_epochs(store: ObjectStore, run: str) -> list[EpochRecord]:
    """Every readable epoch record of `run`, oldest first. An unreadable one is skipped with a WARNING naming it."""
    records = []
    for key in store.list(epochs_prefix(run)):
        try:
            raw = orjson.loads(store.get(key))
            if not isinstance(raw, dict) or raw.get("format") != EPOCHS_FORMAT:
                raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else None!r}")
            checkpoints = {int(v): (None if a is None else str(a)) for v, a in raw["checkpoints"].items()}
            records.append(EpochRecord(int(raw["epoch"]), dict(raw["holder"]), checkpoints))
        except ObjectNotFound:
            continue
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("lease epoch record %s is unreadable (%s); ignored", key, exc)
    return sorted(records, key=lambda r: r.epoch)


def begin_epoch(
    store: ObjectStore, run: str, holder: Mapping[str, Any], checkpoints: Mapping[int, str | None]
) -> dict[str, Any]:
    """Record the epoch of a lease just taken (see the module docstring); returns `holder` with its `epoch`.

    `checkpoints`: version -> attempt of the run's complete checkpoints now (`committed_attempts`)."""
    known = read_epochs(store, run)
    epoch = (known[-1].epoch if known else 0) + 1
    for _ in range(BEGIN_TRIES):
        token = {**holder, "epoch": epoch}
        record = {
            "format": EPOCHS_FORMAT,
            "epoch": epoch,
            "holder": token,
            "checkpoints": {str(v): a for v, a in sorted(checkpoints.items())},
        }
        try:
            store.put_if_absent(epoch_key(run, epoch), orjson.dumps(record))
        except PreconditionFailed:
            epoch += 1
            continue
        log.info("run %s: lease epoch %d begins (%d complete checkpoints before it)", run, epoch, len(checkpoints))
        return token
    raise RuntimeError(f"run {run}: could not record a lease epoch under {epochs_prefix(run)} ({BEGIN_TRIES} taken)")


def superseded_by(records: list[EpochRecord], epoch: int, version: int, attempt: str | None) -> EpochRecord | None:
    """The epoch that began before checkpoint (`version`, `attempt`) of holder epoch `epoch` was committed, if one
    did: the first record after `epoch`, when it does not list that checkpoint. None: the checkpoint is valid."""
    after = next((r for r in records if r.epoch > epoch), None)
    return None if after is None or after.lists(version, attempt) else after
