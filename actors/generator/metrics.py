"""Generator metrics: a small accumulator fed by the generator loop, reported every few seconds.

Every `REPORT_INTERVAL_S` a generator publishes one JSON object (orjson) on the NATS core subject
``leeway.<run>.metrics.generator`` (`pipeline.wire.announce.generator_metrics_subject`; fire-and-forget: a report nobody listens
to is simply dropped; the next one carries the cumulative numbers again). The trainer and `leeway run`
subscribe to it to show generator health. One record (schema `METRICS_SCHEMA_VERSION`)::

    {"schema": 1, "kind": "generator", "generator_id": "host-123", "time_s": 1764400000.0,
     "version": 7, "newest_known_version": 8,
     "tokens_per_s": 850.2, "tokens_per_s_total": 801.3, "tokens_generated": 120345,
     "rollouts_in_flight": 4, "idle_fraction": 0.03, "idle_fraction_total": 0.11,
     "groups_published": 412, "groups_aborted": 1, "samples_published": 3296,
     "weight_pulls": 7, "weight_pull_bytes": 1203344, "weight_pull_s_last": 0.21,
     "weight_pull_failures": 0, "weights_refused": 0, "weight_pull_timeouts": 0, "weights_stuck": 0,
     "announce_to_applied_s_mean": 0.35, "announce_to_applied_s_max": 0.61,
     "versions_behind_at_pull_mean": 1.0, "versions_behind_at_pull_max": 2,
     "staleness_mean": 0.4, "staleness_max": 2, "window_s": 2.0, "uptime_s": 150.4}

Definitions: ``tokens_per_s`` and ``idle_fraction`` are over the last window (since the previous
report), the ``*_total`` variants since start. Idle = wall time during which no `Engine.generate` call
was running (waiting for prompts, for weights, for publish acks, or verifying). Staleness of published
tokens = newest version the generator knew of when it published the group minus each loss token's
version (a lower bound of the staleness the trainer will count). ``announce_to_applied_s`` runs from
the announcement's ``published_at_s`` (KV), or the moment a LATEST poll found the version, to the
moment the engine applied it (wall clock: across machines it includes their clock skew); ``versions_behind_at_pull`` is newest-known minus engine version when a pull starts.
``weight_pull_failures`` counts failed pulls; ``weights_refused`` the versions an engine refused because what
reached its workers failed the version's hashes (reloaded from a full snapshot; `actors/generator/weight_sync.py`); ``weight_pull_timeouts`` the times the generator handed its
prompts back because the engine could not reach their version within ``generator.weight_pull_timeout_s``;
``weights_stuck`` is 1 while it takes no prompts for that reason (the log says why). ``failure_reasons``
counts published samples by typed failure (the failure taxonomy: ``sandbox_start_failed``, ``sandbox_lost``,
``verifier_timeout``, ``reward_missing``, ... for infrastructure; ``agent_timeout``, ``format_error`` for the
policy) and ``retried_episodes`` the episodes run again after an infra_error; the trainer sums both over its
generators into each step's ``failures/<reason>`` and ``failures/retried_episodes``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.failures import POLICY_FAILURES
from pipeline.rl.engine_records import Generate, GenerateRequest, GenerateResult, SamplingParams
from pipeline.wire.announce import GENERATOR_REPORT_INTERVAL_S

Submit = Callable[[Sequence[GenerateRequest], SamplingParams], list[Future[GenerateResult]]]
"""`Engine.submit`: queue requests, one future per request, resolved as each finishes."""

METRICS_SCHEMA_VERSION = 1
"""Bumped when a field of the report changes meaning or disappears."""
REPORT_INTERVAL_S = GENERATOR_REPORT_INTERVAL_S
"""How often a generator publishes a metrics report (shared with the trainer, which expires old reports)."""


@dataclass
class _Running:
    """Count, mean and max of a stream of values, in constant memory (a generator runs for days)."""

    count: int = 0
    total: float = 0.0
    max: float | None = None

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class _Window:
    """Counters at the start of the current report window, so the report can give per-window rates."""

    time_s: float
    busy_s: float
    tokens: int


@dataclass
class GeneratorMetrics:
    """Accumulates what the generator loop observes; `report()` turns it into the published record.

    Called from the generator's event loop, except `generate_started`/`generate_finished`, which `metered`
    calls from engine worker threads (hence the lock around the busy-time state).
    """

    generator_id: str
    clock: Callable[[], float] = time.monotonic
    started_s: float = field(init=False)
    tokens_generated: int = 0
    groups_published: int = 0
    groups_aborted: int = 0
    samples_published: int = 0
    rollouts_in_flight: int = 0
    weight_pulls: int = 0
    weight_pull_bytes: int = 0
    weight_pull_s_last: float = 0.0
    weight_pull_failures: int = 0
    weights_refused: int = 0
    weight_pull_timeouts: int = 0
    weights_stuck: int = 0
    """1 while the generator takes no prompts because it cannot reach the version they need (see the loop)."""
    announce_to_applied: _Running = field(default_factory=lambda: _Running())
    versions_behind_at_pull: _Running = field(default_factory=lambda: _Running())
    failure_reasons: dict[str, int] = field(default_factory=dict)
    """Published samples by typed failure (``infra_reason``: ``sandbox_lost``, ``verifier_timeout``, ...;
    ``agent_timeout`` and ``format_error`` for the policy's own), cumulative."""
    retried_episodes: int = 0
    """Episodes run again after an infra_error (``rollout.infra_retries``), cumulative."""
    staleness_sum: int = 0
    staleness_tokens: int = 0
    staleness_max: int = 0
    _busy_s: float = 0.0
    _busy_since: float | None = None
    _running_generates: int = 0
    _window: _Window = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.started_s = self.clock()
        self._window = _Window(self.started_s, 0.0, 0)

    # ---- observations ----------------------------------------------------------------------------

    def generate_started(self) -> None:
        """An engine.generate call began: the engine is busy until the matching `generate_finished`."""
        with self._lock:
            if self._running_generates == 0:
                self._busy_since = self.clock()
            self._running_generates += 1

    def generate_finished(self, num_tokens: int) -> None:
        with self._lock:
            self._running_generates -= 1
            assert self._running_generates >= 0, "generate_finished without generate_started"
            if self._running_generates == 0 and self._busy_since is not None:
                self._busy_s += self.clock() - self._busy_since
                self._busy_since = None
            self.tokens_generated += num_tokens

    def pull_finished(
        self, *, num_bytes: int, pull_s: float, versions_behind: int, announce_to_applied_s: float | None
    ) -> None:
        self.weight_pulls += 1
        self.weight_pull_bytes += num_bytes
        self.weight_pull_s_last = pull_s
        self.versions_behind_at_pull.add(versions_behind)
        if announce_to_applied_s is not None:
            self.announce_to_applied.add(announce_to_applied_s)

    def group_published(self, versions: np.ndarray, loss_mask: np.ndarray, num_samples: int, newest_known: int) -> None:
        """Record the staleness of the group's loss tokens against the newest version known at publish."""
        self.groups_published += 1
        self.samples_published += num_samples
        trained = versions[loss_mask.astype(bool)]
        if trained.size:
            staleness = np.maximum(newest_known - trained.astype(np.int64), 0)
            self.staleness_sum += int(staleness.sum())
            self.staleness_tokens += int(staleness.size)
            self.staleness_max = max(self.staleness_max, int(staleness.max()))

    def group_aborted(self) -> None:
        self.groups_aborted += 1

    def samples_failed(self, infos: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Count the typed failures of a published group's samples: ``(status, info)`` of each."""
        for status, info in infos:
            reason = info.get("infra_reason") if status == "infra_error" else info.get("error")
            if status == "format_error" and reason not in POLICY_FAILURES:
                reason = "format_error"
            if isinstance(reason, str) and (status == "infra_error" or reason in POLICY_FAILURES):
                self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1
            self.retried_episodes += max(int(info.get("attempts", 1)) - 1, 0)

    # ---- reports ---------------------------------------------------------------------------------

    def _busy_total(self, now: float) -> float:
        return self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def report(self, *, version: int, newest_known: int, wall_time_s: float | None = None) -> dict[str, Any]:
        """The record described in the module docstring; starts a new window."""
        with self._lock:
            now = self.clock()
            busy = self._busy_total(now)
            tokens = self.tokens_generated
        window_s = max(now - self._window.time_s, 1e-9)
        uptime_s = max(now - self.started_s, 1e-9)
        record = {
            "schema": METRICS_SCHEMA_VERSION,
            "kind": "generator",
            "generator_id": self.generator_id,
            "time_s": time.time() if wall_time_s is None else wall_time_s,
            "version": version,
            "newest_known_version": newest_known,
            "tokens_per_s": (tokens - self._window.tokens) / window_s,
            "tokens_per_s_total": tokens / uptime_s,
            "tokens_generated": tokens,
            "rollouts_in_flight": self.rollouts_in_flight,
            "idle_fraction": _clip01(1.0 - (busy - self._window.busy_s) / window_s),
            "idle_fraction_total": _clip01(1.0 - busy / uptime_s),
            "groups_published": self.groups_published,
            "groups_aborted": self.groups_aborted,
            "samples_published": self.samples_published,
            "weight_pulls": self.weight_pulls,
            "weight_pull_bytes": self.weight_pull_bytes,
            "weight_pull_s_last": self.weight_pull_s_last,
            "weight_pull_failures": self.weight_pull_failures,
            "weights_refused": self.weights_refused,
            "weight_pull_timeouts": self.weight_pull_timeouts,
            "weights_stuck": self.weights_stuck,
            "failure_reasons": dict(sorted(self.failure_reasons.items())),
            "retried_episodes": self.retried_episodes,
            "announce_to_applied_s_mean": self.announce_to_applied.mean,
            "announce_to_applied_s_max": self.announce_to_applied.max,
            "versions_behind_at_pull_mean": self.versions_behind_at_pull.mean,
            "versions_behind_at_pull_max": self.versions_behind_at_pull.max,
            "staleness_mean": self.staleness_sum / self.staleness_tokens if self.staleness_tokens else None,
            "staleness_max": self.staleness_max if self.staleness_tokens else None,
            "window_s": window_s,
            "uptime_s": uptime_s,
        }
        self._window = _Window(now, busy, tokens)
        return record


def metered(generate: Generate, metrics: GeneratorMetrics) -> Generate:
    """`generate` counted in `metrics` (engine busy time and tokens, hence ``idle_fraction`` and ``tokens_per_s``);
    safe to call from worker threads, several at once (multi-turn episodes)."""

    def call(requests: Sequence[GenerateRequest], params: SamplingParams) -> list[GenerateResult]:
        metrics.generate_started()
        num_tokens = 0
        try:
            results = generate(requests, params)
            num_tokens = sum(len(r.token_ids) for r in results)
            return results
        finally:
            metrics.generate_finished(num_tokens)

    return call


def metered_submit(submit: Submit, metrics: GeneratorMetrics) -> Submit:
    """`Engine.submit` counted like `metered`: the engine is busy from the call until the last of its requests
    finished (its futures resolve on the engine's thread), and their tokens are counted then."""

    def call(requests: Sequence[GenerateRequest], params: SamplingParams) -> list[Future[GenerateResult]]:
        metrics.generate_started()
        try:
            futures = submit(requests, params)
        except BaseException:
            metrics.generate_finished(0)
            raise
        if not futures:
            metrics.generate_finished(0)
            return futures
        lock = threading.Lock()
        remaining, tokens = [len(futures)], [0]

        def done(future: Future[GenerateResult]) -> None:
            with lock:
                remaining[0] -= 1
                if not future.cancelled() and future.exception() is None:
                    tokens[0] += len(future.result().token_ids)
                last = remaining[0] == 0
            if last:
                metrics.generate_finished(tokens[0])

        for future in futures:
            future.add_done_callback(done)
        return futures

    return call


def format_report(record: dict[str, Any]) -> str:
    """One log line of a report."""
    staleness = record["staleness_mean"]
    return (
        f"generator {record['generator_id']}: v{record['version']} (newest {record['newest_known_version']}), "
        f"{record['tokens_per_s']:.0f} tok/s, idle {record['idle_fraction']:.0%} "
        f"(total {record['idle_fraction_total']:.0%}), {record['rollouts_in_flight']} in flight, "
        f"{record['groups_published']} groups published, {record['weight_pulls']} pulls, "
        f"staleness mean {'-' if staleness is None else f'{staleness:.2f}'}" + _failures(record)
    )


def _failures(record: dict[str, Any]) -> str:
    reasons, rerun = record.get("failure_reasons") or {}, record.get("retried_episodes") or 0
    if not reasons and not rerun:
        return ""
    listed = ", ".join(f"{reason} {count}" for reason, count in reasons.items()) or "none"
    return f"; failures: {listed}; {rerun} episodes re-run"


def _clip01(value: float) -> float:
    return min(1.0, max(0.0, value))
