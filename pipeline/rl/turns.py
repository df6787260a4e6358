"""Turns: how a trajectory's tokens line up. Tokens in, tokens out.

A trajectory is the token ids the sampler saw and produced, in order, as turns::

    turn      prompt            policy reply          env message     policy reply
    tokens    <bos> 3 1 4 >     4 1 3 <eos>           | n o |         4 1 3 <eos>
    loss_mask 0     0 0 0 0     1 1 1 1               0 0 0 0         1 1 1 1
    versions  -1   -1 -1 -1 -1  7 7 8 8               -1 -1 -1 -1     8 8 8 8
    logprobs  0     0 0 0 0     behaviour log-probs   0 0 0 0         behaviour log-probs

Policy tokens carry the engine's per-token version and behaviour log-prob (the version may change inside
a reply: in-flight weight update). Prompt and environment tokens carry loss mask 0, version -1, log-prob 0.
Nothing is re-tokenized: the environment sees decoded text (`decode`), but the trajectory keeps the sampled ids,
and an environment message given as text is tokenized once, on its own, its special-token text kept as plain
characters (`pipeline/chat/literal.py`).

`assemble` lays turns out as the four per-token arrays (`pipeline.rl.routes` the routes of a MoE model's turns); `Trajectory` is those arrays with what a sample says
about its turns (how the last reply finished, how many replies), the input of the one sample builder
(`pipeline.rl.scoring.build_sample`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from pipeline.rl.engine_records import GenerateResult
from pipeline.rl.routes import TrajectoryRoutes, assemble_routes
from pipeline.wire.trajectory import FinishReason

if TYPE_CHECKING:
    from pipeline.rl.prompt_ids import Tokenizer


@dataclass
class Turn:
    """A run of tokens from one source: ``prompt`` and ``env`` turns have loss mask 0 and version -1."""

    kind: Literal["prompt", "policy", "env"]
    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason | None = None
    routes: np.ndarray | None = None
    """MoE models, policy turns: the routes the engine reported for this request (`pipeline.rl.routes`)."""
    route_versions: np.ndarray | None = None
    routes_start: int = 0
    """The trajectory position of ``routes[0]`` (the request's context is every token before this turn's)."""

    @classmethod
    def context(cls, kind: Literal["prompt", "env"], token_ids: Sequence[int] | np.ndarray) -> Turn:
        ids = np.asarray(token_ids, dtype=np.int32)
        return cls(kind, ids, np.zeros(len(ids), np.float32), np.full(len(ids), -1, np.int32))

    @classmethod
    def policy(cls, result: GenerateResult) -> Turn:
        return cls(
            "policy",
            np.asarray(result.token_ids, np.int32),
            np.asarray(result.logprobs, np.float32),
            np.asarray(result.versions, np.int32),
            result.finish_reason,
            routes=result.routes,
            route_versions=result.route_versions,
            routes_start=result.routes_start,
        )

    def without_stop(self, stop_token_ids: Sequence[int]) -> np.ndarray:
        """The turn's ids without a final stop token (a policy reply that finished with ``stop``)."""
        ids = self.token_ids
        if self.kind == "policy" and self.finish_reason == "stop" and len(ids) and int(ids[-1]) in stop_token_ids:
            return ids[:-1]
        return ids


def assemble(turns: Sequence[Turn]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32, loss_mask uint8, logprobs float32, versions int32) of the turns, concatenated."""
    tokens = np.concatenate([t.token_ids for t in turns]).astype(np.int32)
    loss_mask = np.concatenate([np.full(len(t.token_ids), t.kind == "policy", np.uint8) for t in turns])
    logprobs = np.concatenate([t.logprobs for t in turns]).astype(np.float32)
    versions = np.concatenate([t.versions for t in turns]).astype(np.int32)
    return tokens, loss_mask, logprobs, versions


@dataclass(frozen=True)
class Trajectory:
    """A trajectory's per-token arrays (as `assemble` lays them out) and what its turns were: ``finish_reason``
    of its last policy reply (``abort`` when it has none) and ``num_turns``, its number of policy replies."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    num_turns: int
    routes: TrajectoryRoutes | None = None

    @classmethod
    def of(cls, turns: Sequence[Turn]) -> Trajectory:
        policy = [t for t in turns if t.kind == "policy"]
        finish_reason = (policy[-1].finish_reason if policy else None) or "abort"
        return cls(*assemble(turns), finish_reason=finish_reason, num_turns=len(policy), routes=assemble_routes(turns))


def decode(tokenizer: Tokenizer, ids: np.ndarray) -> str:
    """Special tokens are kept in the text, so a verifier sees e.g. a stray ``<pad>`` as a format error."""
    return tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
