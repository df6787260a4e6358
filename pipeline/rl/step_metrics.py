"""The trainer's per-step metrics record: what was received, what trained, what was dropped and why.

Pure functions from the step's prepared groups and loss statistics to one JSON-safe dict, written
as one line of `<run.dir>/metrics.jsonl`. Rewards are reported before the filter (`docs/design.md`):
`reward/unfiltered_mean` is over every valid sample received this step, trainable or not, so the
curve does not rise just because easy groups were filtered out.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.rl.advantages import valid_mask
from pipeline.rl.batching import PreparedGroup
from pipeline.rl.staleness import staleness_stats

INFRA_STATUSES = ("infra_error", "aborted")


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def reward_metrics(groups: Sequence[PreparedGroup]) -> dict[str, Any]:
    """Unfiltered mean (valid samples, before cap and filter), kept mean, per-tag means, infra failure rate."""
    unfiltered: list[float] = []
    kept: list[float] = []
    by_tag: dict[str, list[float]] = defaultdict(list)
    num_samples = num_infra = 0
    for prepared in groups:
        group = prepared.group
        rewards = [None if math.isnan(r) else float(r) for r in group.reward]
        valid = valid_mask(rewards, group.status, group.reward_source)
        for i, reward in enumerate(rewards):
            num_samples += 1
            num_infra += group.status[i] in INFRA_STATUSES
            if not valid[i] or reward is None:
                continue
            unfiltered.append(reward)
            for tag in group.tags[i]:
                by_tag[tag].append(reward)
            if prepared.trainable and prepared.valid[i]:
                kept.append(reward)
    out: dict[str, Any] = {
        "reward/unfiltered_mean": _mean(unfiltered),
        "reward/kept_mean": _mean(kept),
        "infra/failure_rate": num_infra / num_samples if num_samples else 0.0,
    }
    out.update({f"reward/tag/{tag}": _mean(values) for tag, values in sorted(by_tag.items())})
    return out


def refusal_metrics(refused: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """Groups refused at the trainer's door this step (live: dead-lettered; replay: skipped), by reason.

    `refused` maps group id -> (reason, detail), e.g. ``{"g7": ("token_out_of_vocab", "sample 1 ...")}``.
    """
    by_reason = Counter(reason for reason, _ in refused.values())
    return {
        "groups/refused": len(refused),
        **{f"groups/refused/{reason}": n for reason, n in sorted(by_reason.items())},
        "refused_group_ids": {group_id: reason for group_id, (reason, _) in refused.items()},
    }


def sample_counts(groups: Sequence[PreparedGroup]) -> dict[str, int]:
    trained = masked = by_cap = by_filter = 0
    for prepared in groups:
        n = prepared.group.num_samples
        capped = int((~prepared.kept_by_cap).sum())
        if prepared.trainable:
            trained += int(prepared.valid.sum())
            masked += n - int(prepared.valid.sum()) - capped
            by_cap += capped
        elif prepared.drop_reason == "staleness_cap":
            by_cap += n
        else:
            by_filter += n
    return {
        "samples/trained": trained,
        "samples/masked": masked,
        "samples/dropped_by_cap": by_cap,
        "samples/dropped_by_filter": by_filter,
    }


def staleness_metrics(groups: Sequence[PreparedGroup], version: int) -> dict[str, Any]:
    """Staleness of the loss tokens received this step (before the cap), and versions spanned per sample."""
    versions, masks = [], []
    for prepared in groups:
        group = prepared.group
        for i in range(group.num_samples):
            s = group.token_slice(i)
            versions.append(group.versions[s])
            masks.append(group.loss_mask[s])
    if not versions:
        return {}
    stats = staleness_stats(versions, masks, version)
    spanned = stats.versions_spanned[stats.versions_spanned > 0]
    return {
        "staleness/min": stats.min,
        "staleness/mean": stats.mean,
        "staleness/max": stats.max,
        "staleness/hist": {str(k): int(v) for k, v in sorted(stats.histogram.items())},
        "versions_spanned/mean": float(spanned.mean()) if spanned.size else None,
        "versions_spanned/max": int(spanned.max()) if spanned.size else None,
    }


def timing_split(groups: Sequence[PreparedGroup], received_at_s: dict[str, float], now_s: float) -> dict[str, Any]:
    """Where a sample's age went: generating (gen_start..gen_end) and queued (gen_end..trained)."""
    gen, queued = [], []
    for prepared in groups:
        group = prepared.group
        for start, end in zip(group.gen_start_s, group.gen_end_s, strict=True):
            if math.isfinite(start) and math.isfinite(end):
                gen.append(end - start)
                queued.append(max(0.0, received_at_s.get(group.group_id, now_s) - end))
    return {"time/sample_generating_s": _mean(gen), "time/sample_queued_s": _mean(queued)}


def merge_loss_stats(micro_stats: Iterable[dict[str, float]]) -> dict[str, Any]:
    """Token-weighted means of the per-micro-batch correction stats (max/min kept as such): ``is/<key>``, or the key
    as it is when it names its own group (``mismatch/k3_kl``)."""
    totals: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    extremes: dict[str, float] = {}
    for stats in micro_stats:
        n = float(stats.get("num_loss_tokens", 0.0))
        fresh = float(stats.get("num_fresh_tokens", 0.0))
        for key, value in stats.items():
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            if key.endswith("_max"):
                extremes[key] = max(extremes.get(key, -math.inf), value)
            elif key.endswith("_min"):
                extremes[key] = min(extremes.get(key, math.inf), value)
            elif key.startswith("num_"):
                totals[key] += value
                weights[key] = 1.0
            else:
                weight = fresh if key == "logp_gap_fresh" else n
                totals[key] += value * weight
                weights[key] += weight
    out: dict[str, Any] = {_metric_name(k): v for k, v in extremes.items()}
    for key, total in totals.items():
        if key.startswith("num_"):
            out[f"tokens/{key[4:]}"] = int(total)
        elif weights[key] > 0:
            out[_metric_name(key)] = total / weights[key]
    return out


def _metric_name(key: str) -> str:
    return key if "/" in key else f"is/{key}"
