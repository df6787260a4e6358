"""The trajectory record, schema version 3: one `TrajectoryGroup` = all samples of one prompt.

A group crosses process boundaries (generator -> NATS -> trainer, and into Parquet for replay), so
its layout is fixed and versioned (`SCHEMA_VERSION`), and everything that enters or leaves the wire
is validated here first. Per-token columns are held as one flat numpy array per column plus one
shared offsets array (`offsets[i]:offsets[i + 1]` is sample `i`), never as Python lists per token:
the codec hands Arrow buffers straight to numpy.

How the per-token columns line up (one sample: a 3-token prompt, 4 generated tokens, the weights
swapped from version 6 to 7 between two decode steps; version -1 and mask 0 for prompt tokens)::

    position   0     1     2     3      4      5      6
    tokens     151   9707  25    785    3681   374    151643
    loss_mask  0     0     0     1      1      1      1
    logprobs   0.0   0.0   0.0   -0.01  -2.30  -0.00  -0.12   # behaviour log-prob of the sampled token
    versions   -1    -1    -1    6      6      7      7       # weights that computed that token's logits
    -> min_version = 6, max_version = 7 (over loss tokens only; -1 when a sample has none)

Tool or environment output inside a multi-turn rollout looks like the prompt: mask 0, version -1.
A reward is trusted only when a verifier wrote it: `reward` is present exactly when
`reward_source == "verifier"`.

Schema 2 added ``episode_id`` and ``branch`` per sample: an agent episode through the generator's endpoint
may become several samples (its branches), which carry the episode's id (its session) and their branch index;
other samples carry ``""`` and 0. Readers take schema 1 messages too, with those defaults.

Schema 3 added the routes of mixture-of-experts models (routing replay, `actors/moe.py`): per position, the expert
ids each MoE layer chose in the forward that wrote that position's KV (``routes``, ``[tokens, layers, top_k]``,
uint8 up to 256 experts, else uint16), and the policy version of that forward (``route_versions``, -1 where the
position has no route: the last sampled token, which was never fed, or a prefix the engine did not report)::

    position        0     1     2     3      4      5      6
    route_versions  6     6     6     6      7      7      -1   # a prompt prefilled by 6, the swap after token 4
    routes[:, l]    [1,5] [0,5] [2,3] [5,7]  [1,2]  [0,1]  [0,0]

Groups of dense models carry none (``routes`` None); schema 1 and 2 messages read as such.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

SCHEMA_VERSION = 3
"""Bumped on any change of columns or their meaning; carried in every message header and in the Arrow schema."""
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
"""Versions this build decodes: schema 1 lacks ``episode_id`` and ``branch`` (read as ``""`` and 0), schemas 1 and
2 lack routes (read as a dense model's group)."""
ROUTE_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))
MAX_ROUTE_BYTES_PER_TOKEN = 1 << 16
"""The most route bytes one position may take (256 layers x 128 experts of uint16 ids); a message claiming more is
refused before any size is computed from its claim."""
"""Expert ids: uint8 when a layer has at most 256 experts, uint16 otherwise."""

LOGPROB_MAX = 1e-3
"""Largest accepted behaviour log-prob of a loss token: log-softmax may round slightly above 0, never more."""

ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}$")
"""Ids: group ids become object-store keys and Nats-Msg-Id headers, so no '/', spaces or leading '.'."""

TOKEN_COLUMNS = ("tokens", "loss_mask", "logprobs", "versions")
"""The per-token list columns; all of one sample have the same length."""


Status = Literal["ok", "truncated", "format_error", "infra_error", "aborted"]
"""How a rollout ended (meanings in `pipeline.rl.scoring`). ``infra_error`` and ``aborted`` carry no reward."""
STATUSES: tuple[str, ...] = get_args(Status)

RewardSource = Literal["verifier", "none"]
"""Who wrote the reward. Anything but a verifier's reward is masked out of loss and baseline."""
REWARD_SOURCES: tuple[str, ...] = get_args(RewardSource)

FinishReason = Literal["stop", "length", "abort", "prompt_too_long"]
"""``stop``: a stop token was sampled (and is the last returned token); ``length``: the new-token
budget or the model's context ran out; ``abort``: the engine's abort cut the request;
``prompt_too_long``: the prompt left no room for one new token in the engine's maximum length (no tokens)."""


class TrajectoryValidationError(ValueError):
    """A group breaks the schema's invariants; `sample` (row index or None) and `column` say where."""

    def __init__(self, message: str, *, group_id: str = "", sample: int | None = None, column: str = "") -> None:
        where = f"group {group_id!r}" if group_id else "group"
        if sample is not None:
            where += f" sample {sample}"
        if column:
            where += f" column {column!r}"
        super().__init__(f"{where}: {message}")
        self.group_id = group_id
        self.sample = sample
        self.column = column


@dataclass(frozen=True)
class Sample:
    """One trajectory as a rollout builds it (`pipeline.rl.scoring.build_sample`): a row of the group record.

    ``tokens``/``loss_mask``/``logprobs``/``versions`` align index by index (module docstring).
    ``reward`` is None exactly when ``reward_source == "none"``. `trajectory_id` None means
    ``<group_id>:<index>``. ``gen_start_s``/``gen_end_s`` are Unix seconds (NaN if unknown) and travel
    on the wire; ``num_turns``, ``gen_s``, ``verify_s`` and ``info`` stay in the generator (metrics, logs).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float | None = None
    reward_source: RewardSource = "none"
    status: Status = "ok"
    finish_reason: FinishReason | Literal[""] = ""
    tags: Sequence[str] = ()
    trajectory_id: str | None = None
    gen_start_s: float = math.nan
    gen_end_s: float = math.nan
    num_turns: int = 1
    gen_s: float = 0.0
    verify_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    episode_id: str = ""
    """The agent episode (endpoint session) this sample is a branch of; "" outside agent episodes."""
    branch: int = 0
    """The sample's branch index within its episode."""
    routes: np.ndarray | None = None
    """MoE models: ``[tokens, layers, top_k]`` expert ids per position (module docstring); None for a dense model."""
    route_versions: np.ndarray | None = None
    """int32 per position with ``routes``: the version of the forward that chose them, -1 for none."""


@dataclass(frozen=True, eq=False)
class TrajectoryGroup:
    """All samples of one prompt, column-wise. Build with `from_samples` (validates) or via the codec.

    Per-token columns: flat `tokens` (int32), `loss_mask` (uint8), `logprobs` (float32), `versions`
    (int32), and `offsets` (int64, length num_samples + 1, starting at 0) shared by all four. Per-sample
    columns are numpy arrays (`min_version`, `max_version`, `reward` with NaN for null, timings) or
    tuples of str (`trajectory_ids`, `reward_source`, `status`, `finish_reason`, `tags`).
    Arrays may be read-only views of a received message's buffers; treat the group as immutable.
    """

    group_id: str
    prompt_id: str
    generator_id: str
    trajectory_ids: tuple[str, ...]
    offsets: np.ndarray
    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    min_version: np.ndarray
    max_version: np.ndarray
    reward: np.ndarray
    reward_source: tuple[str, ...]
    status: tuple[str, ...]
    finish_reason: tuple[str, ...]
    tags: tuple[tuple[str, ...], ...]
    created_at_s: np.ndarray
    gen_start_s: np.ndarray
    gen_end_s: np.ndarray
    episode_ids: tuple[str, ...] = ()
    """Per sample (schema 2); empty means every sample is ``""`` (filled by `__post_init__`)."""
    branches: np.ndarray | None = None
    """Per sample, int32 (schema 2); None means every sample is branch 0 (filled by `__post_init__`)."""
    routes: np.ndarray | None = None
    """Flat ``[num_tokens, layers, top_k]`` uint8/uint16 sharing ``offsets`` (schema 3); None for a dense model."""
    route_versions: np.ndarray | None = None
    """Flat int32 ``[num_tokens]`` beside ``routes`` (-1: no route for that position)."""

    def __post_init__(self) -> None:
        n = len(self.trajectory_ids)
        if not self.episode_ids:
            object.__setattr__(self, "episode_ids", ("",) * n)
        if self.branches is None:
            object.__setattr__(self, "branches", np.zeros(n, dtype=np.int32))

    @property
    def num_samples(self) -> int:
        return len(self.trajectory_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def group_min_version(self) -> int:
        """Oldest policy version of any loss token in the group (-1 if no sample has loss tokens)."""
        trained = self.min_version[self.min_version >= 0]
        return int(trained.min()) if trained.size else -1

    @property
    def group_max_version(self) -> int:
        """Newest policy version of any loss token in the group (-1 if none)."""
        return int(self.max_version.max()) if self.max_version.size else -1

    def token_slice(self, sample: int) -> slice:
        return slice(int(self.offsets[sample]), int(self.offsets[sample + 1]))

    def sample(self, index: int) -> Sample:
        """Sample `index` as views into the flat columns (no copy)."""
        s = self.token_slice(index)
        reward = float(self.reward[index])
        return Sample(
            tokens=self.tokens[s],
            loss_mask=self.loss_mask[s],
            logprobs=self.logprobs[s],
            versions=self.versions[s],
            reward=None if math.isnan(reward) else reward,
            reward_source=self.reward_source[index],
            status=self.status[index],
            finish_reason=self.finish_reason[index],
            tags=self.tags[index],
            trajectory_id=self.trajectory_ids[index],
            gen_start_s=float(self.gen_start_s[index]),
            gen_end_s=float(self.gen_end_s[index]),
            episode_id=self.episode_ids[index],
            branch=int(self.branches[index]),  # type: ignore[index]
            routes=None if self.routes is None else self.routes[s],
            route_versions=None if self.route_versions is None else self.route_versions[s],
        )

    @classmethod
    def from_samples(
        cls,
        *,
        group_id: str,
        prompt_id: str,
        generator_id: str,
        samples: Sequence[Sample],
        created_at_s: float | None = None,
    ) -> TrajectoryGroup:
        """Concatenate per-sample arrays into one validated group (raises `TrajectoryValidationError`).

        Lengths are checked per sample before concatenation, so the error names the sample whose
        columns disagree rather than a downstream misalignment.
        """
        if not samples:
            raise TrajectoryValidationError("a group needs at least one sample", group_id=group_id)
        for i, s in enumerate(samples):
            n = np.asarray(s.tokens).shape
            for name in TOKEN_COLUMNS:
                arr = np.asarray(getattr(s, name))
                if arr.ndim != 1:
                    raise TrajectoryValidationError(
                        f"expected a 1-d array, got shape {arr.shape}", group_id=group_id, sample=i, column=name
                    )
                if arr.shape != n:
                    raise TrajectoryValidationError(
                        f"length {arr.shape[0]} != tokens length {n[0]}", group_id=group_id, sample=i, column=name
                    )
        lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        versions = _concat(samples, "versions", np.int32, group_id)
        loss_mask = _concat(samples, "loss_mask", np.uint8, group_id)
        min_v, max_v = loss_version_range(versions, loss_mask, offsets)
        routes, route_versions = _concat_routes(samples, group_id)
        now = time.time() if created_at_s is None else created_at_s
        group = cls(
            group_id=group_id,
            prompt_id=prompt_id,
            generator_id=generator_id,
            trajectory_ids=tuple(s.trajectory_id or f"{group_id}:{i}" for i, s in enumerate(samples)),
            offsets=offsets,
            tokens=_concat(samples, "tokens", np.int32, group_id),
            loss_mask=loss_mask,
            logprobs=_concat(samples, "logprobs", np.float32, group_id),
            versions=versions,
            min_version=min_v,
            max_version=max_v,
            reward=np.array([math.nan if s.reward is None else s.reward for s in samples], dtype=np.float32),
            reward_source=tuple(str(s.reward_source) for s in samples),
            status=tuple(str(s.status) for s in samples),
            finish_reason=tuple(s.finish_reason for s in samples),
            tags=tuple(tuple(s.tags) for s in samples),
            created_at_s=np.full(len(samples), now, dtype=np.float64),
            gen_start_s=np.array([s.gen_start_s for s in samples], dtype=np.float64),
            gen_end_s=np.array([s.gen_end_s for s in samples], dtype=np.float64),
            episode_ids=tuple(s.episode_id for s in samples),
            branches=np.array([s.branch for s in samples], dtype=np.int64),
            routes=routes,
            route_versions=route_versions,
        )
        validate_group(group)
        return group


def _concat_routes(samples: Sequence[Sample], group_id: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The samples' routes as flat columns; a sample without routes in a group with some gets rows of zeros with
    version -1 (a failure sample of a MoE model: nothing to replay). None, None when no sample has routes."""
    with_routes = [s for s in samples if s.routes is not None]
    if not with_routes:
        return None, None
    first = np.asarray(with_routes[0].routes)
    if first.ndim != 3 or first.dtype not in ROUTE_DTYPES:
        raise TrajectoryValidationError(
            f"expected [tokens, layers, top_k] uint8 or uint16, got {first.dtype} {first.shape}",
            group_id=group_id,
            column="routes",
        )
    width, dtype = first.shape[1:], first.dtype
    routes, versions = [], []
    for i, s in enumerate(samples):
        n = len(s.tokens)
        if s.routes is None:
            routes.append(np.zeros((n, *width), dtype))
            versions.append(np.full(n, -1, np.int32))
            continue
        r, v = np.asarray(s.routes), np.asarray(s.route_versions if s.route_versions is not None else ())
        if r.shape != (n, *width) or r.dtype != dtype:
            raise TrajectoryValidationError(
                f"{r.dtype} {r.shape}, expected {dtype} {(n, *width)}", group_id=group_id, sample=i, column="routes"
            )
        if v.shape != (n,) or not np.issubdtype(v.dtype, np.integer):
            raise TrajectoryValidationError(
                f"{v.dtype} {v.shape}, expected {n} integers", group_id=group_id, sample=i, column="route_versions"
            )
        routes.append(r)
        versions.append(v.astype(np.int32))
    return np.concatenate(routes), np.concatenate(versions)


def _concat(samples: Sequence[Sample], name: str, dtype: type, group_id: str) -> np.ndarray:
    """Concatenate one token column, refusing lossy casts (e.g. float token ids, out-of-range ints)."""
    parts = []
    for i, s in enumerate(samples):
        arr = np.asarray(getattr(s, name))
        if arr.size and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise TrajectoryValidationError(
                f"dtype {arr.dtype} cannot be stored as {np.dtype(dtype)}", group_id=group_id, sample=i, column=name
            )
        cast = arr.astype(dtype, copy=False)
        if arr.size and np.issubdtype(arr.dtype, np.integer) and not np.array_equal(cast, arr):
            raise TrajectoryValidationError(
                f"values out of range for {np.dtype(dtype)}", group_id=group_id, sample=i, column=name
            )
        parts.append(cast)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def loss_version_range(
    versions: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (min, max) policy version over loss tokens, -1 for a sample with none; vectorised."""
    n = len(offsets) - 1
    lo = np.full(n, -1, dtype=np.int32)
    hi = np.full(n, -1, dtype=np.int32)
    if n == 0 or versions.size == 0:
        return lo, hi
    big = np.iinfo(np.int32).max
    masked = np.where(loss_mask.astype(bool), versions, big)
    starts = offsets[:-1]
    nonempty = offsets[1:] > starts
    if nonempty.any():
        mins = np.minimum.reduceat(masked, starts[nonempty])
        maxs = np.maximum.reduceat(np.where(loss_mask.astype(bool), versions, -1), starts[nonempty])
        has_loss = mins != big
        lo[np.flatnonzero(nonempty)[has_loss]] = mins[has_loss]
        hi[np.flatnonzero(nonempty)[has_loss]] = maxs[has_loss]
    return lo, hi


def _first_bad(bad: np.ndarray, offsets: np.ndarray) -> tuple[int, int] | None:
    """(sample, position within the sample) of the first True in a flat per-token mask, or None."""
    idx = np.flatnonzero(bad)
    if idx.size == 0:
        return None
    flat = int(idx[0])
    sample = int(np.searchsorted(offsets, flat, side="right")) - 1
    return sample, flat - int(offsets[sample])


def validate_group(group: TrajectoryGroup) -> None:
    """Check every invariant of the schema; raise `TrajectoryValidationError` naming sample and column.

    Vectorised over the flat columns (a group of 8 x 4k tokens validates in well under a millisecond),
    then the first offending element is located for the message.
    """
    gid = group.group_id
    n = group.num_samples

    def fail(message: str, sample: int | None = None, column: str = "") -> None:
        raise TrajectoryValidationError(message, group_id=gid, sample=sample, column=column)

    for name in ("group_id", "prompt_id", "generator_id"):
        value = getattr(group, name)
        if not isinstance(value, str) or not ID_RE.match(value):
            fail(f"{value!r} is not a valid id (letters, digits, '_.:-', at most 200 chars)", column=name)
    if n == 0:
        fail("a group needs at least one sample")
    _check_offsets(group, fail)
    for name, dtype in (
        ("tokens", np.int32),
        ("loss_mask", np.uint8),
        ("logprobs", np.float32),
        ("versions", np.int32),
    ):
        arr = getattr(group, name)
        if arr.dtype != dtype or arr.ndim != 1:
            fail(f"expected a flat {np.dtype(dtype)} array, got {arr.dtype} with shape {arr.shape}", column=name)
        if arr.shape[0] != group.num_tokens:
            fail(f"{arr.shape[0]} values but offsets say {group.num_tokens}", column=name)
    for name in ("min_version", "max_version", "reward", "created_at_s", "gen_start_s", "gen_end_s"):
        if getattr(group, name).shape != (n,):
            fail(f"expected {n} values, got shape {getattr(group, name).shape}", column=name)
    for name in ("reward_source", "status", "finish_reason", "tags", "episode_ids"):
        if len(getattr(group, name)) != n:
            fail(f"expected {n} values, got {len(getattr(group, name))}", column=name)
    _check_episodes(group, fail)
    _check_routes(group, fail)
    _check_ids(group, fail)
    _check_tokens(group, fail)
    _check_per_sample(group, fail)


def _check_offsets(group: TrajectoryGroup, fail) -> None:
    off = group.offsets
    if off.dtype != np.int64 or off.shape != (group.num_samples + 1,):
        fail(f"offsets must be int64 of length {group.num_samples + 1}, got {off.dtype} {off.shape}", column="tokens")
    if off[0] != 0:
        fail(f"offsets must start at 0, got {off[0]}", column="tokens")
    bad = np.flatnonzero(np.diff(off) < 0)
    if bad.size:
        fail("negative list length", sample=int(bad[0]), column="tokens")


def _check_episodes(group: TrajectoryGroup, fail) -> None:
    branches = group.branches
    assert branches is not None
    if branches.shape != (group.num_samples,) or not np.issubdtype(branches.dtype, np.integer):
        fail(f"expected {group.num_samples} integers, got {branches.dtype} {branches.shape}", column="branch")
    for i, (episode, branch) in enumerate(zip(group.episode_ids, branches.tolist(), strict=True)):
        if not isinstance(episode, str) or (episode and not ID_RE.match(episode)):
            fail(
                f"{episode!r} is not a valid episode id (empty, or letters, digits, '_.:-')",
                sample=i,
                column="episode_id",
            )
        if not 0 <= branch <= np.iinfo(np.int32).max:
            fail(f"branch {branch} must be a non-negative int32", sample=i, column="branch")


def _check_routes(group: TrajectoryGroup, fail) -> None:
    routes, versions = group.routes, group.route_versions
    if routes is None and versions is None:
        return
    if routes is None or versions is None:
        fail("routes and route_versions come together", column="routes")
    assert routes is not None and versions is not None
    if routes.ndim != 3 or routes.dtype not in ROUTE_DTYPES or routes.shape[0] != group.num_tokens:
        fail(
            f"expected [{group.num_tokens}, layers, top_k] uint8 or uint16, got {routes.dtype} {routes.shape}",
            column="routes",
        )
    if routes.shape[1] < 1 or routes.shape[2] < 1:
        fail(f"a route needs at least one layer and one expert, got shape {routes.shape}", column="routes")
    if versions.dtype != np.int32 or versions.shape != (group.num_tokens,):
        fail(
            f"expected {group.num_tokens} int32 values, got {versions.dtype} {versions.shape}", column="route_versions"
        )
    hit = _first_bad(versions < -1, group.offsets)
    if hit:
        fail(f"version below -1 at position {hit[1]}", sample=hit[0], column="route_versions")


def _check_ids(group: TrajectoryGroup, fail) -> None:
    seen: dict[str, int] = {}
    for i, tid in enumerate(group.trajectory_ids):
        if not isinstance(tid, str) or not ID_RE.match(tid):
            fail(f"{tid!r} is not a valid id", sample=i, column="trajectory_id")
        if tid in seen:
            fail(f"duplicate of sample {seen[tid]}'s id {tid!r}", sample=i, column="trajectory_id")
        seen[tid] = i


def _check_tokens(group: TrajectoryGroup, fail) -> None:
    off = group.offsets
    checks = (
        ("tokens", group.tokens < 0, "negative token id"),
        ("loss_mask", group.loss_mask > 1, "loss mask must be 0 or 1"),
    )
    for column, bad, message in checks:
        hit = _first_bad(bad, off)
        if hit:
            fail(f"{message} at position {hit[1]}", sample=hit[0], column=column)
    loss = group.loss_mask == 1
    hit = _first_bad(loss & (group.versions < 0), off)
    if hit:
        fail(
            f"loss token at position {hit[1]} has version {group.versions[off[hit[0]] + hit[1]]} (must be >= 0)",
            sample=hit[0],
            column="versions",
        )
    hit = _first_bad(~loss & (group.versions != -1), off)
    if hit:
        fail(
            f"non-loss token at position {hit[1]} has version {group.versions[off[hit[0]] + hit[1]]} (must be -1)",
            sample=hit[0],
            column="versions",
        )
    lp = group.logprobs
    hit = _first_bad(loss & ~(np.isfinite(lp) & (lp <= LOGPROB_MAX)), off)
    if hit:
        fail(
            f"loss token at position {hit[1]} has log-prob {lp[off[hit[0]] + hit[1]]} (must be finite and <= 0)",
            sample=hit[0],
            column="logprobs",
        )
    hit = _first_bad(~np.isfinite(lp), off)
    if hit:
        fail(f"non-finite log-prob at position {hit[1]}", sample=hit[0], column="logprobs")


def _check_per_sample(group: TrajectoryGroup, fail) -> None:
    lo, hi = loss_version_range(group.versions, group.loss_mask, group.offsets)
    statuses, sources = set(STATUSES), set(REWARD_SOURCES)
    for i in range(group.num_samples):
        if group.min_version[i] != lo[i]:
            fail(
                f"{group.min_version[i]} disagrees with the loss tokens' minimum {lo[i]}",
                sample=i,
                column="min_version",
            )
        if group.max_version[i] != hi[i]:
            fail(
                f"{group.max_version[i]} disagrees with the loss tokens' maximum {hi[i]}",
                sample=i,
                column="max_version",
            )
        if group.status[i] not in statuses:
            fail(f"{group.status[i]!r} is not one of {sorted(statuses)}", sample=i, column="status")
        if group.reward_source[i] not in sources:
            fail(f"{group.reward_source[i]!r} is not one of {sorted(sources)}", sample=i, column="reward_source")
        has_reward = not math.isnan(float(group.reward[i]))
        if has_reward and group.reward_source[i] != "verifier":
            fail(
                f"reward {group.reward[i]} present but reward_source is {group.reward_source[i]!r}",
                sample=i,
                column="reward",
            )
        if group.reward_source[i] == "verifier" and not (has_reward and math.isfinite(float(group.reward[i]))):
            fail("reward_source is 'verifier' but the reward is missing or not finite", sample=i, column="reward")
        if not isinstance(group.finish_reason[i], str):
            fail(f"expected a string, got {type(group.finish_reason[i]).__name__}", sample=i, column="finish_reason")
        if not all(isinstance(t, str) for t in group.tags[i]):
            fail("tags must be strings", sample=i, column="tags")
