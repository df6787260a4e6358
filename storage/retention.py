"""Which weight versions may be deleted: a pure decision, and the deletion that carries it out.

Kept, in order of the rules:
1. the newest `keep_versions` published versions (at or below `LATEST`);
2. every version a reader may still be pulling: `LATEST` itself, and any version superseded (a
   newer version was published after it) less than `grace_s` ago, by the publisher's clock;
3. versions above `LATEST` (a publish that wrote its manifest but has not moved `LATEST` yet);
4. the whole delta chain of every kept version, back to its full snapshot (a delta is useless
   without its base, and a new reader starts from the full snapshot).
Everything else with a manifest is deleted: manifest first, so the version disappears for readers
at once, then its parts. Version directories without a (valid) manifest older than the oldest kept
version are leftovers of killed publishes and are deleted too; newer ones may be publishes in
progress and are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from storage.manifest import (
    Manifest,
    ManifestError,
    manifest_key,
    parse_version_dir,
    version_prefix,
    weights_prefix,
)
from storage.objectstore import ObjectNotFound, ObjectStore

__all__ = ["prune_versions", "versions_to_delete"]

log = logging.getLogger(__name__)


def versions_to_delete(
    manifests: Mapping[int, Manifest],
    orphans: set[int],
    *,
    latest: int,
    keep_versions: int,
    grace_s: float,
    now: float,
) -> list[int]:
    """Versions (with or without a manifest) that no reader can need; see the module docstring."""
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    published = sorted(v for v in manifests if v <= latest)
    keep = set(published[-keep_versions:]) | {v for v in manifests if v >= latest}
    for older, newer in zip(published, published[1:], strict=False):
        if manifests[newer].published_at > now - grace_s:
            keep.add(older)
    pending = list(keep)
    while pending:
        manifest = manifests.get(pending.pop())
        base = manifest.base_version if manifest is not None else None
        if base is not None and base not in keep:
            keep.add(base)
            pending.append(base)
    oldest_kept = min(keep, default=latest)
    doomed = {v for v in manifests if v not in keep} | {v for v in orphans if v < oldest_kept}
    return sorted(doomed)


def scan_versions(store: ObjectStore, run: str, known: Mapping[int, Manifest]) -> tuple[dict[int, Manifest], set[int]]:
    """Manifests of every version directory (reusing `known`), and the directories without a valid one."""
    dirs: set[int] = set()
    prefix = weights_prefix(run)
    for key in store.list(prefix):
        version = parse_version_dir(key[len(prefix) :].split("/", 1)[0])
        if version is not None:
            dirs.add(version)
    manifests: dict[int, Manifest] = {}
    orphans: set[int] = set()
    for version in sorted(dirs):
        if version in known:
            manifests[version] = known[version]
            continue
        key = manifest_key(run, version)
        try:
            manifests[version] = Manifest.from_json(store.get(key), key=key)
        except (ObjectNotFound, ManifestError):
            orphans.add(version)
    return manifests, orphans


def prune_versions(
    store: ObjectStore,
    run: str,
    *,
    latest: int,
    keep_versions: int,
    grace_s: float,
    now: float,
    known: Mapping[int, Manifest] | None = None,
) -> list[int]:
    """Delete what `versions_to_delete` allows; returns the deleted versions."""
    manifests, orphans = scan_versions(store, run, known or {})
    doomed = versions_to_delete(
        manifests, orphans, latest=latest, keep_versions=keep_versions, grace_s=grace_s, now=now
    )
    for version in doomed:
        store.delete(manifest_key(run, version))  # first: the version stops existing for readers
        store.delete_many(store.list(version_prefix(run, version)))
    if doomed:
        log.info("weights retention for run %s deleted versions %s", run, doomed)
    return doomed
