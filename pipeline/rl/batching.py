"""From received trajectory groups to what a trainer step trains on: cap, validity, advantages, filter.

Pure logic, no I/O: the trainer loop feeds groups in and gets back `PreparedGroup`s, each either
trainable (with one `TrainSequence` per sample, the record the training backend consumes as is;
masked samples carry an all-zero loss mask) or not, with the reason. The order of decisions is the
one `docs/design.md` ("Rewards, groups and failures") argues for:

    group ──► door: every token id < the model's vocabulary, every sample within its context (else refused)
          ──► staleness cap (`pipeline/rl/staleness.py`) against the trainer's version V
          ──► validity: status ok/truncated/format_error with a verifier reward; dropped samples invalid
          ──► advantages over the valid samples only (GRPO or RLOO)
          ──► trainable only if at least two valid samples disagree, else "filtered"

A refused group (`check_model_limits`) is never prepared: a token id past the vocabulary or a sample
longer than the model's context would fail inside the training step (a device assert, out of memory)
and fail again on every resume, so the trainer dead-letters it instead.

A masked sample (infra failure, missing reward, dropped by the cap) is in no baseline and no
denominator: its tokens reach the backend with loss mask 0, so only its presence is visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.rl.advantages import compute_advantages, valid_mask
from pipeline.rl.staleness import CapPolicy, apply_staleness_cap
from pipeline.wire.trajectory import TrajectoryGroup

DROP_CAP = "staleness_cap"
DROP_FILTER = "no_disagreement"
REFUSE_VOCAB = "token_out_of_vocab"
"""Refusal reason: a token id >= the model's vocabulary size."""
REFUSE_TOO_LONG = "sample_too_long"
"""Refusal reason: a sample with more tokens than the model has positions."""
REFUSE_ROUTES = "routes_mismatch"
"""Refusal reason: routes of another layout than the model's MoE layers, or an expert id past its experts (replaying
them would index outside the router's experts on every resume)."""


@dataclass(frozen=True)
class ModelLimits:
    """What a group must fit to reach the training step (`TrainingBackend.model_limits`)."""

    vocab_size: int
    max_positions: int | None
    """None: the model names no context length (no length check)."""
    routes: tuple[int, int, int] | None = None
    """A MoE model's (layers, top_k, num_experts) (`actors.moe.RouteShape`); None for a dense model."""


@dataclass(frozen=True)
class Refusal:
    """Why a group can never be trained by this model: a stable `reason` code and a `detail` naming the sample."""

    reason: str
    detail: str


def check_model_limits(group: TrajectoryGroup, limits: ModelLimits) -> Refusal | None:
    """None if every token id is < `limits.vocab_size` and every sample fits `limits.max_positions`.

    Negative ids never get here (`TrajectoryGroup` validation refuses them). The detail names the
    first offending sample (index and trajectory id) and the value.
    """
    for i in range(group.num_samples):
        s = group.token_slice(i)
        tokens = group.tokens[s]
        where = f"sample {i} ({group.trajectory_ids[i]!r})"
        if tokens.size and int(tokens.max()) >= limits.vocab_size:
            position = int(np.argmax(tokens >= limits.vocab_size))
            return Refusal(
                REFUSE_VOCAB,
                f"{where}: token id {int(tokens[position])} at position {position} >= the model's vocabulary "
                f"size {limits.vocab_size}",
            )
        if limits.max_positions is not None and tokens.size > limits.max_positions:
            return Refusal(
                REFUSE_TOO_LONG,
                f"{where}: {tokens.size} tokens > the model's context of {limits.max_positions} positions",
            )
    return _check_route_limits(group, limits)


def _check_route_limits(group: TrajectoryGroup, limits: ModelLimits) -> Refusal | None:
    if group.routes is None:
        return None
    layout = tuple(group.routes.shape[1:])
    if limits.routes is None or layout != limits.routes[:2]:
        model = "a dense model" if limits.routes is None else f"{limits.routes[0]} MoE layers x top-{limits.routes[1]}"
        return Refusal(REFUSE_ROUTES, f"routes of {layout[0]} layers x top-{layout[1]} for {model}")
    if group.routes.size and int(group.routes.max()) >= limits.routes[2]:
        flat = int(np.argmax(group.routes.reshape(len(group.routes), -1).max(axis=1) >= limits.routes[2]))
        sample = int(np.searchsorted(group.offsets, flat, side="right")) - 1
        return Refusal(
            REFUSE_ROUTES,
            f"sample {sample} ({group.trajectory_ids[sample]!r}): expert id {int(group.routes[flat].max())} at "
            f"position {flat - int(group.offsets[sample])} >= the model's {limits.routes[2]} experts",
        )
    return None


@dataclass(frozen=True)
class GroupPolicy:
    """The config a group decision depends on (a copy of the relevant fields, so this stays pure)."""

    max_staleness: int | None
    """None: no cap (replay with the cap switched off)."""
    cap_policy: CapPolicy = "drop_trajectory"
    estimator: str = "grpo"
    std_normalize: bool = False


@dataclass(frozen=True, eq=False)
class TrainSequence:
    """One sample to train on, as the training backend consumes it (`actors/trainer/backends/base.py`).

    Columns line up by position (a 3-token prompt, 4 generated tokens; position 0 never has a log-prob)::

        position             0     1     2     3      4      5      6
        tokens               151   9707  25    785    3681   374    151643
        loss_mask            0     0     0     1      1      1      1
        behaviour_logprobs   0.0   0.0   0.0   -0.01  -2.30  -0.00  -0.12   # log mu(token_t | tokens_<t)
        versions             -1    -1    -1    6      6      7      7
        logprobs (backend)   0.0   lp1   lp2   lp3    lp4    lp5    lp6     # log pi(token_t | tokens_<t)

    ``advantage`` is one float for the whole sample or a float32 array per token (only its values at
    loss tokens matter). A mixture-of-experts sample may carry the sampler's ``routes``
    (``[T, layers, top_k]`` expert ids, one row per position) and ``route_versions`` (``[T]`` int32, the
    version whose forward chose them; -1 = no route recorded for that position, e.g. the last token,
    which the sampler never fed): the trainer replays them under ``moe.routing_replay``. Both or neither. ``proximal_logprobs`` (optional) are the trainer's log-probs under the
    weights at the step's start, for ``decoupled_ppo``; compute them with `TrainingBackend.logprobs`.
    An invalid (masked) sample must arrive with ``loss_mask`` all zero: the backend never decides
    what is trainable. ``loss_mask[0]`` must be 0, since the first token has no context to predict it.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    advantage: float | np.ndarray = 0.0
    proximal_logprobs: np.ndarray | None = None
    sample_id: str = ""
    routes: np.ndarray | None = None
    route_versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        where = f"TrainSequence {self.sample_id!r}"
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{where}: tokens must be a non-empty 1-D integer array, got {tokens.dtype} shape {tokens.shape}"
            )
        columns = {
            "loss_mask": self.loss_mask,
            "behaviour_logprobs": self.behaviour_logprobs,
            "versions": self.versions,
            "proximal_logprobs": self.proximal_logprobs,
        }
        if not np.isscalar(self.advantage):
            columns["advantage"] = self.advantage
        for name, column in columns.items():
            if column is not None and np.shape(column) != tokens.shape:
                raise ValueError(f"{where}: {name} has shape {np.shape(column)}, tokens have {tokens.shape}")
        if np.asarray(self.loss_mask)[0]:
            raise ValueError(f"{where}: loss_mask[0] is 1, but position 0 has no log-prob (nothing precedes it)")
        _check_routes(where, tokens.shape[0], self.routes, self.route_versions)

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.tokens).shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def advantages_per_token(self) -> np.ndarray:
        """The advantage broadcast to every position, float32."""
        return np.broadcast_to(np.asarray(self.advantage, dtype=np.float32), (self.num_tokens,))


def _check_routes(where: str, num_tokens: int, routes: np.ndarray | None, versions: np.ndarray | None) -> None:
    """Routes ``[T, layers, top_k]`` of non-negative integers and route_versions ``[T]`` integers, both or neither."""
    if routes is None and versions is None:
        return
    if routes is None or versions is None:
        missing = "routes" if routes is None else "route_versions"
        raise ValueError(f"{where}: {missing} is None, but the other route column is set (both or neither)")
    routes, versions = np.asarray(routes), np.asarray(versions)
    if routes.ndim != 3 or routes.shape[0] != num_tokens or not np.issubdtype(routes.dtype, np.integer):
        raise ValueError(
            f"{where}: routes must be an integer array [{num_tokens} tokens, layers, top_k], "
            f"got {routes.dtype} shape {routes.shape}"
        )
    if routes.size and int(routes.min()) < 0:
        raise ValueError(f"{where}: routes hold a negative expert id {int(routes.min())}")
    if versions.shape != (num_tokens,) or not np.issubdtype(versions.dtype, np.integer):
        raise ValueError(
            f"{where}: route_versions must be an integer array [{num_tokens}], got {versions.dtype} shape {versions.shape}"
        )


@dataclass
class PreparedGroup:
    """One group after the decisions above; `samples` is empty unless `trainable`."""

    group: TrajectoryGroup
    trainable: bool
    drop_reason: str | None
    samples: list[TrainSequence] = field(default_factory=list)
    valid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    kept_by_cap: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    num_stale_tokens: int = 0

    @property
    def group_id(self) -> str:
        return self.group.group_id


def _rewards(group: TrajectoryGroup) -> list[float | None]:
    return [None if np.isnan(r) else float(r) for r in group.reward]


def _first_token_unmasked(mask: np.ndarray) -> np.ndarray:
    """Position 0 has no context to predict it; a loss mask never covers it (prompts are never empty)."""
    if mask.size and mask[0]:
        mask = mask.copy()
        mask[0] = 0
    return mask


def _routes_of(group: TrajectoryGroup, s: slice) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The sample's routes and their versions (None, None for a dense model's group)."""
    if group.routes is None or group.route_versions is None:
        return None, None
    return group.routes[s], group.route_versions[s]


def prepare_group(group: TrajectoryGroup, *, version: int, policy: GroupPolicy) -> PreparedGroup:
    """Apply the cap, validity and advantages to one group at trainer version `version`."""
    versions = [group.versions[group.token_slice(i)] for i in range(group.num_samples)]
    masks = [group.loss_mask[group.token_slice(i)] for i in range(group.num_samples)]
    if policy.max_staleness is None:
        keep = np.ones(group.num_samples, dtype=bool)
        cap_masks: Sequence[np.ndarray] = masks
        stale_tokens = 0
    else:
        decision = apply_staleness_cap(
            versions, masks, current_version=version, max_staleness=policy.max_staleness, policy=policy.cap_policy
        )
        keep, cap_masks, stale_tokens = decision.keep, decision.loss_masks, decision.num_stale_tokens
    rewards = _rewards(group)
    valid = valid_mask(rewards, group.status, group.reward_source) & keep
    prepared = PreparedGroup(group, False, None, valid=valid, kept_by_cap=keep, num_stale_tokens=stale_tokens)
    if not keep.any():
        prepared.drop_reason = DROP_CAP
        return prepared
    advantages, trainable = compute_advantages(
        rewards,
        valid,
        estimator=policy.estimator,
        std_normalize=policy.std_normalize,
    )
    if not trainable:
        uncapped_valid = valid_mask(rewards, group.status, group.reward_source)
        capped_away = not keep.all() and compute_advantages(rewards, uncapped_valid)[1]
        prepared.drop_reason = DROP_CAP if capped_away else DROP_FILTER
        return prepared
    prepared.trainable = True
    for i in range(group.num_samples):
        s = group.token_slice(i)
        mask = np.asarray(cap_masks[i], dtype=np.uint8) if valid[i] else np.zeros(s.stop - s.start, dtype=np.uint8)
        routes, route_versions = _routes_of(group, s)
        prepared.samples.append(
            TrainSequence(
                tokens=group.tokens[s],
                loss_mask=_first_token_unmasked(mask),
                behaviour_logprobs=group.logprobs[s],
                versions=group.versions[s],
                advantage=float(advantages[i]),
                sample_id=group.trajectory_ids[i],
                routes=routes,
                route_versions=route_versions,
            )
        )
    return prepared
