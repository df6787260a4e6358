"""Version V's tensors rebuilt from the store alone, for `leeway export` (`actors/tools/export.py`).

The plan is the subscriber's own (`WeightSubscriber.plan` from nothing held: the newest full snapshot at or before
V, then each delta after it), applied one version at a time so that long exports report each step; every part is
checked against its manifest hash before use and every tensor's sha256 after each version, by the same code a
generator runs. Failures become `ExportError` naming what is missing: the version asked for (with the versions
the store holds), a manifest of the chain (pruned or damaged), or a part or tensor that does not check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from storage.manifest import Manifest, ManifestError

if TYPE_CHECKING:  # torch and the weight store are imported when an export runs, not for `leeway export --help`
    import torch

    from pipeline.config import LeewayConfig
    from storage.objectstore import ObjectStore
    from storage.subscriber import WeightSubscriber

MiB = 1024 * 1024


class ExportError(ValueError):
    """The export cannot be made; the message names the version, file, tensor or directory at fault."""


def pull_version(
    store: ObjectStore, cfg: LeewayConfig, version: int | None, say: Callable[[str], None]
) -> tuple[dict[str, torch.Tensor], Manifest, tuple[int, ...]]:
    """(tensors of `version`, its manifest, the versions applied: full snapshot first); `ExportError` otherwise."""
    from storage.subscriber import WeightSubscriber
    from storage.weights_base import WeightPullError

    run = cfg.run.name
    with WeightSubscriber(store, run, parallelism=cfg.weights.parallelism) as subscriber:
        version = _resolve(store, subscriber, run, version)
        try:
            plan = subscriber.plan(None, version)
        except ManifestError as exc:
            raise ExportError(
                f"version {version} of run {run!r} cannot be rebuilt: its chain back to a full snapshot needs {exc}"
            ) from None
        manifests = [subscriber.manifest(v) for v in plan.versions]
        say(
            f"version {version}: full snapshot {plan.versions[0]} and {len(plan.versions) - 1} delta(s) after it, "
            f"{plan.num_bytes / MiB:.1f} MiB from the store"
        )
        for n, m in enumerate(manifests, 1):
            try:
                subscriber.pull(m.version)
            except (WeightPullError, ManifestError) as exc:
                raise ExportError(f"version {version} of run {run!r} cannot be rebuilt: {exc}") from None
            say(f"applied version {m.version} ({m.kind}, {m.num_bytes / MiB:.1f} MiB; {n}/{len(manifests)})")
        return dict(subscriber.tensors), manifests[-1], plan.versions


def _resolve(store: ObjectStore, subscriber: WeightSubscriber, run: str, version: int | None) -> int:
    """`version`, or LATEST; refused naming the versions the store holds when it has no such version."""
    from storage.weights_base import list_versions

    if version is None:
        version = subscriber.latest_version()
        if version is None:
            raise ExportError(f"run {run!r} has no published weights in its store (no {run}/weights/LATEST)")
    try:
        subscriber.manifest(version)
        return version
    except ManifestError as exc:
        held = list_versions(store, run)
        span = f"versions {held[0]}..{held[-1]} ({len(held)} of them)" if held else "no version"
        raise ExportError(f"version {version} of run {run!r} is not in the store, which holds {span}: {exc}") from None
