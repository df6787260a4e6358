"""A trajectory's MoE routes, assembled from its turns: each position's routes from the forward that wrote its KV.

An engine reports, per request, the routes of the positions it computed (`GenerateResult.routes` from
``routes_start``): a turn that extends a kept prefix brings only its new positions, so a prefix's routes travel once,
with the turn that computed them, and keep that turn's version even when the weights changed since. When the engine
computed a prefix again (its cache was gone), the recomputation is what the KV of the later positions attended to,
so its routes replace the earlier ones; those positions are counted (``recomputed``)::

    turn 1 (v6): prompt p0..p3 + reply r0 r1 r2      routes p0..r1 (r2 never fed), versions 6
    turn 2 (v7): + env e0 e1 + reply s0 s1, prefix kept    routes r2..s0, versions 7
    -> routes p0..s0, versions 6 6 6 6 6 6 7 7 7 7, s1: -1 (the last token has no route)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class RoutedTurn(Protocol):
    """What routes need of a turn (`pipeline.rl.turns.Turn`)."""

    token_ids: np.ndarray
    routes: np.ndarray | None
    route_versions: np.ndarray | None
    routes_start: int


@dataclass(frozen=True)
class TrajectoryRoutes:
    """``routes`` ``[tokens, layers, top_k]``, ``versions`` ``[tokens]`` int32 (-1: none), and ``recomputed``: how
    many positions a later forward computed again (a prefix cache miss: the later forward's routes are kept)."""

    routes: np.ndarray
    versions: np.ndarray
    recomputed: int = 0


def assemble_routes(turns: Sequence[RoutedTurn]) -> TrajectoryRoutes | None:
    """The routes of the trajectory the turns lay out, or None when no turn carries any (a dense model)."""
    routed = [t for t in turns if t.routes is not None]
    if not routed:
        return None
    total = sum(len(t.token_ids) for t in turns)
    first = np.asarray(routed[0].routes)
    routes = np.zeros((total, *first.shape[1:]), first.dtype)
    versions = np.full(total, -1, np.int32)
    recomputed = 0
    for turn in routed:
        rows, start = np.asarray(turn.routes), turn.routes_start
        assert turn.route_versions is not None
        end = start + len(rows)
        if rows.shape[1:] != first.shape[1:] or rows.dtype != first.dtype or not 0 <= start <= end <= total:
            raise ValueError(
                f"routes of positions {start}..{end} ({rows.dtype} {rows.shape}) do not fit a trajectory of {total} "
                f"tokens with routes {first.dtype} {first.shape[1:]}"
            )
        recomputed += int(np.count_nonzero(versions[start:end] >= 0))
        routes[start:end] = rows
        versions[start:end] = turn.route_versions
    return TrajectoryRoutes(routes, versions, recomputed)
