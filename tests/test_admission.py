"""Prompt admission: queued + in_flight + trained <= (V + K + 1) * batch_groups."""

from __future__ import annotations

from collections import deque

import pytest

from pipeline.admission import PromptAdmission


def test_a_fresh_run_admits_k_plus_one_batches() -> None:
    # V = 0, K = 1, batch 4 -> (0 + 1 + 1) * 4 = 8
    assert PromptAdmission(batch_groups=4, max_staleness=1).admit() == 8


def test_admission_stops_at_the_cap_and_reopens_one_batch_per_version() -> None:
    adm = PromptAdmission(batch_groups=4, max_staleness=1)
    adm.on_admitted(8)
    assert adm.admit() == 0
    adm.on_group_trained(4)  # outstanding 4 + trained 4 = 8: still full
    assert adm.admit() == 0
    adm.on_version(1)  # capacity (1 + 1 + 1) * 4 = 12
    assert adm.admit() == 4


def test_synchronous_cap_admits_one_batch_at_a_time() -> None:
    adm = PromptAdmission(batch_groups=3, max_staleness=0)
    assert adm.admit() == 3
    adm.on_admitted(3)
    adm.on_group_trained(3)
    assert adm.admit() == 0
    adm.on_version(1)
    assert adm.admit() == 3


def test_a_group_consumed_without_training_returns_its_slot() -> None:
    # filtered (valid samples agree) or dropped by the cap: 8 admitted, 2 discarded -> 2 free slots
    adm = PromptAdmission(batch_groups=4, max_staleness=1)
    adm.on_admitted(8)
    adm.on_group_discarded(2)
    assert adm.admit() == 2


def test_a_snapshot_on_resume_sets_the_counts() -> None:
    # V = 10, K = 2, batch 4 -> capacity 52; 3 queued + 5 in flight + 40 trained = 48 -> 4 more
    adm = PromptAdmission(batch_groups=4, max_staleness=2)
    adm.observe(version=10, queued=3, in_flight=5, trained=40)
    assert adm.admit() == 4


def test_an_overfull_snapshot_admits_nothing_rather_than_a_negative_count() -> None:
    adm = PromptAdmission(batch_groups=4, max_staleness=0)
    adm.observe(version=0, queued=10, in_flight=0, trained=0)
    assert adm.admit() == 0


def test_admit_reserves_nothing_until_reported() -> None:
    adm = PromptAdmission(batch_groups=2, max_staleness=0)
    assert adm.admit() == adm.admit() == 2


def test_paced_groups_are_never_trained_more_than_k_versions_after_admission() -> None:
    # Admit everything allowed each step; the trainer consumes in order, batch_groups per step.
    batch, max_staleness = 4, 2
    adm = PromptAdmission(batch_groups=batch, max_staleness=max_staleness)
    queue: deque[int] = deque()  # admission version of each outstanding group
    worst = 0
    for version in range(30):
        adm.on_version(version)
        allowed = adm.admit()
        queue.extend([version] * allowed)
        adm.on_admitted(allowed)
        assert adm.outstanding + adm.trained <= (version + max_staleness + 1) * batch
        for _ in range(batch):
            worst = max(worst, version - queue.popleft())
        adm.on_group_trained(batch)
    assert worst == max_staleness


def test_invalid_updates_are_rejected() -> None:
    with pytest.raises(ValueError, match="batch_groups=0"):
        PromptAdmission(batch_groups=0, max_staleness=1)
    with pytest.raises(ValueError, match="staleness.max_staleness=-1"):
        PromptAdmission(batch_groups=1, max_staleness=-1)
    adm = PromptAdmission(batch_groups=2, max_staleness=1)
    adm.on_version(3)
    with pytest.raises(ValueError, match="older than the current version 3"):
        adm.on_version(2)
    with pytest.raises(ValueError, match="only 0 are outstanding"):
        adm.on_group_trained(1)
