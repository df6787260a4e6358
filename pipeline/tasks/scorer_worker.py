"""The scorer worker: the program that reads the policy's answers, run in a sandbox by `VerifierPool`
(`pipeline/sandbox/python_worker.py`), never in the generator.

It speaks JSON lines on stdin/stdout, one request and one reply at a time, on its main thread (so math-verify's
signal timeouts work here). Requests (each with an ``id`` the reply repeats):

- ``load`` {recipe}: build the scorer (`ScorerRecipe.build`) now, so a later verify's deadline is only its own;
- ``verify`` {recipe, prompt (the prompt's JSON), text, ids, probe?}: ``Task.verify`` → {reward, status, info};
  with ``probe`` set, ``probed`` says whether a ``compile``/``exec`` of source holding it happened meanwhile;
- ``env_open`` {recipe, prompt, env}, ``env_step`` {env, text}, ``env_close`` {env}: an environment living here
  (the scorer's ``open_environment(prompt)`` and ``step_environment(env, text) -> dict``).

An exception becomes ``{"error": "..."}`` (the pool makes it an ``infra_error``). The first thing it does is install
`audit_hook`: defense in depth behind the sandbox, it refuses starting programs and opening network connections,
and counts compiles of source holding the probe marker (the self-check's code-execution probe). Its stdout is kept
for replies alone: what a scorer prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

REFUSED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "subprocess.Popen",
        "pty.spawn",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.getaddrinfo",
    }
)
"""Audit events a scorer never needs: running a program, reaching the network."""


class _Probe:
    marker: str | None = None
    hits: int = 0


def audit_hook(event: str, args: tuple[Any, ...]) -> None:
    if event in REFUSED_EVENTS:
        raise PermissionError(f"scorer worker: {event} is refused")
    if event in ("compile", "exec") and _Probe.marker is not None and args:
        source = args[0]
        if isinstance(source, bytes):
            source = source.decode(errors="replace")
        if isinstance(source, str) and _Probe.marker in source:
            _Probe.hits += 1
        elif hasattr(source, "co_consts") and any(_Probe.marker in str(c) for c in source.co_consts):
            _Probe.hits += 1


class Worker:
    """The scorers and environments this process holds, and the requests that reach them."""

    def __init__(self) -> None:
        self.scorers: dict[str, Any] = {}
        self.envs: dict[str, tuple[Any, Any]] = {}

    def scorer(self, recipe: dict[str, Any]) -> Any:
        from pipeline.tasks.scorer_recipe import ScorerRecipe

        parsed = ScorerRecipe.from_json(recipe)
        if parsed.key not in self.scorers:
            self.scorers[parsed.key] = parsed.build()
        return self.scorers[parsed.key]

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        from pipeline.wire.prompts import Prompt

        op = request.get("op")
        if op == "load":
            self.scorer(request["recipe"])
            return {}
        if op == "verify":
            scorer = self.scorer(request["recipe"])
            prompt = Prompt.from_json(request["prompt"].encode())
            _Probe.marker, _Probe.hits = request.get("probe"), 0
            try:
                result = scorer.verify(prompt, request["text"], list(request.get("ids") or []))
            finally:
                probed, _Probe.marker = _Probe.hits > 0, None
            return {"reward": result.reward, "status": result.status, "info": result.info, "probed": probed}
        if op == "env_open":
            scorer = self.scorer(request["recipe"])
            prompt = Prompt.from_json(request["prompt"].encode())
            self.envs[request["env"]] = (scorer, scorer.open_environment(prompt))
            return {}
        if op == "env_step":
            scorer, env = self.envs[request["env"]]
            return {"step": scorer.step_environment(env, request["text"])}
        if op == "env_close":
            self.envs.pop(request["env"], None)
            return {}
        raise ValueError(f"unknown request {op!r}")


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # a scorer's prints go to stderr; the channel carries replies only
    sys.stdout = sys.stderr
    import pipeline.tasks.base
    import pipeline.wire.prompts  # noqa: F401

    sys.addaudithook(audit_hook)
    worker = Worker()
    channel.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        request: Any = {}
        try:
            request = json.loads(line)
            reply = worker.handle(request)
        except Exception as exc:  # the pool turns it into an infra_error naming it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = request.get("id") if isinstance(request, dict) else None
        channel.write(json.dumps(reply, default=str) + "\n")


if __name__ == "__main__":
    main()
