"""Engine weight-version spans -> per-token versions: exact tiling or a clear contract error."""

from __future__ import annotations

import pytest

from actors.generator.engines.version_spans import EngineContractError, version_label, versions_from_spans


def test_spans_tile_the_output_into_versions() -> None:
    spans = [(version_label(3), 0, 2), (version_label(4), 2, 5)]
    assert versions_from_spans(spans, 5, engine="vllm").tolist() == [3, 3, 4, 4, 4]
    assert versions_from_spans(None, 0, engine="vllm").tolist() == []


@pytest.mark.parametrize(
    ("spans", "match"),
    [
        (None, "without weight-version spans"),
        ([("3", 0, 2)], "cover 2 of 5"),
        ([("3", 0, 2), ("4", 3, 5)], "does not continue at token 2"),
        ([("3", 0, 3), ("4", 2, 5)], "does not continue at token 3"),
        ([("3", 0, 6)], r"\[0, 6\)"),
        ([("default", 0, 5)], "'default' is not a policy version"),
    ],
)
def test_broken_spans_are_refused(spans: list[tuple[str, int, int]] | None, match: str) -> None:
    with pytest.raises(EngineContractError, match=match):
        versions_from_spans(spans, 5, engine="sglang")
