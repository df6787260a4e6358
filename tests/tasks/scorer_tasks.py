"""Tasks for the scorer-worker tests, rebuilt inside workers by class (no-argument constructors)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

from pipeline.tasks import Prompt, Task, VerifierResult


class MisbehavingTask(Task):
    """Scores "ok" 1.0; "hang" spins forever holding the GIL; "raise" raises; "where" reports where it runs;
    "eval:EXPR" evaluates EXPR, as the reasoning-gym scorers that ``eval`` answers do, and reports its value."""

    name = "misbehaving"
    reward_range = (0.0, 1.0)

    def prompts(self):
        yield Prompt("p", text="x")

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        if completion_text == "hang":
            while True:
                pass
        if completion_text == "raise":
            raise RuntimeError("scorer broke")
        if completion_text.startswith("eval:"):
            return VerifierResult(0.0, info={"value": repr(eval(completion_text[5:]))})
        if completion_text == "where":
            return VerifierResult(0.0, info=_where(prompt.metadata.get("host_path", "/")))
        return VerifierResult(1.0 if completion_text == "ok" else 0.0)


def _where(host_path: str) -> dict[str, object]:
    try:
        socket.create_connection(("127.0.0.1", 4222), timeout=1).close()
        network = "connected"
    except OSError as exc:
        network = f"{type(exc).__name__}: {exc}"
    return {
        "uid": os.getuid(),
        "hash": hash("leeway"),
        "env": sorted(os.environ),
        "sees_host_path": Path(host_path).exists(),
        "network": network,
    }
