"""Per-token policy versions from an engine's weight-version spans (vLLM's ``CompletionOutput.weight_versions``,
SGLang's ``meta_info["weight_versions"]``).

Both engines label their weights with a string the caller sets at each update and report, per request, which
output positions each label produced: ``[("3", 0, 57), ("4", 57, 128)]``. Leeway sets the label to the policy
version's decimal string, so a span maps back to an integer version. The mapping is strict because a version is
what the trainer's staleness bound and importance correction trust: spans that leave a token without a label,
overlap, or carry a label that is not a version are a broken engine contract (`EngineContractError`), never
guessed at.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["EngineContractError", "version_label", "versions_from_spans"]


class EngineContractError(RuntimeError):
    """An engine answered outside the contract Leeway relies on (tokens without a version, spans that do not
    tile the output); the request fails instead of carrying a made-up version."""


def version_label(version: int) -> str:
    """The weight-version label Leeway gives an engine for a policy version."""
    return str(int(version))


def versions_from_spans(spans: Iterable[tuple[str, int, int]] | None, num_tokens: int, *, engine: str) -> np.ndarray:
    """One int32 version per output token from ``(label, start, end)`` spans that tile ``[0, num_tokens)``.

    Raises `EngineContractError` naming ``engine`` when the spans are missing (for a non-empty output), leave a gap,
    overlap, run past the output, or carry a label that is not a version."""
    versions = np.empty(num_tokens, dtype=np.int32)
    if num_tokens == 0:
        return versions
    if spans is None:
        raise EngineContractError(f"{engine}: {num_tokens} output tokens came back without weight-version spans")
    at = 0
    for label, start, end in spans:
        if start != at or end <= start or end > num_tokens:
            raise EngineContractError(
                f"{engine}: weight-version span {label!r} [{start}, {end}) does not continue at token {at} "
                f"of {num_tokens}"
            )
        try:
            version = int(label)
        except (TypeError, ValueError):
            raise EngineContractError(
                f"{engine}: weight-version label {label!r} is not a policy version (set by someone else than Leeway?)"
            ) from None
        versions[start:end] = version
        at = end
    if at != num_tokens:
        raise EngineContractError(f"{engine}: weight-version spans cover {at} of {num_tokens} output tokens")
    return versions
