"""Tasks whose verifiers misbehave, for generator tests; a config names them as
`task.name=tests.support.tasks:<function>` (in-process, or in a `leeway generator` process of its own)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from pipeline.tasks import Prompt, Task
from pipeline.tasks.reverse import ReverseDigitsTask

SLOW_VERIFIER_S = 120.0
"""How long `slow_reverse_digits` verifies: longer than any test waits, so its generator is always mid-rollout."""


class _SlowVerifier(ReverseDigitsTask):
    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> Any:
        time.sleep(SLOW_VERIFIER_S)
        return super().verify(prompt, completion_text, completion_ids)


def slow_reverse_digits(**kwargs: Any) -> Task:
    """A task whose verifier never returns in time: its generator is always mid-rollout (tests/SIGKILL)."""
    return _SlowVerifier(**kwargs)


class _HangingVerifier(ReverseDigitsTask):
    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> Any:
        threading.Event().wait()  # forever: only the scorer worker's deadline ends it
        return super().verify(prompt, completion_text, completion_ids)


def hanging_reverse_digits(**kwargs: Any) -> Task:
    """A task whose verifier never returns (it runs in a scorer worker, which is killed at its deadline)."""
    return _HangingVerifier(**kwargs)
