"""The torch engine's parked slots: finished sequences whose KV cache is kept for a next turn that extends them.

A slot is parked under the ids its cache holds (prompt + reply but the last sampled token), at most ``limit``
slots, least recently parked first out. A prompt that begins with a parked slot's ids (the longest such, leaving
a token to compute) takes that slot: a hit. A parked slot dropped before such a prompt came (a weight update drops
them all; a full cache or a new request's need evicts one) is remembered, the latest
`DROPPED_PREFIXES_PER_SLOT` x ``limit`` of them, so that the positions a later prompt extending it had computed
again are counted (for a mixture-of-experts model: routed again, under the current weights).

Not thread-safe: the engine calls it under its scheduler lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DROPPED_PREFIXES_PER_SLOT = 2
"""Dropped prefixes remembered per parked slot allowed (a weight update drops every parked slot at once; a next
turn usually comes soon after)."""


class ParkedPrefixes:
    """Parked slots and the prefixes dropped since (see the module docstring); ``limit`` 0 parks nothing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.slots: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        """Free slots whose cache still holds these ids' keys and values, least recently parked first."""
        self._dropped: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def park(self, slot: int, ids: tuple[int, ...]) -> None:
        if not self.limit:
            return
        self.slots[slot] = ids
        self.slots.move_to_end(slot)
        while len(self.slots) > self.limit:
            self._forget(self.slots.popitem(last=False)[1])

    def evict(self, slot: int) -> None:
        """A new request takes ``slot`` (parked or not) for a prompt it does not extend."""
        if slot in self.slots:
            self._forget(self.slots.pop(slot))

    def drop_all(self) -> None:
        """Their caches are no longer trusted (other weights, or a forward that failed half-way)."""
        for ids in self.slots.values():
            self._forget(ids)
        self.slots.clear()

    def take_longest(self, prompt: Sequence[int]) -> tuple[int | None, int, int]:
        """(slot, cached length, recomputed positions) for ``prompt``: the parked slot holding the longest prefix
        of it that leaves a token to compute, unparked (None, 0 when none does), and how many positions past the
        cached length a dropped prefix of it held (counted once: that prefix is forgotten)."""
        best, length = None, 0
        for slot, ids in self.slots.items():
            if length < len(ids) < len(prompt) and tuple(prompt[: len(ids)]) == ids:
                best, length = slot, len(ids)
        if best is not None:
            del self.slots[best]
        longest = max(
            (ids for ids in self._dropped if length < len(ids) < len(prompt) and tuple(prompt[: len(ids)]) == ids),
            key=len,
            default=None,
        )
        recomputed = 0
        if longest is not None:
            del self._dropped[longest]
            recomputed = len(longest) - length
        return best, length, recomputed

    def _forget(self, ids: tuple[int, ...]) -> None:
        self._dropped[ids] = None
        self._dropped.move_to_end(ids)
        while len(self._dropped) > DROPPED_PREFIXES_PER_SLOT * self.limit:
            self._dropped.popitem(last=False)
