"""The child process of `pipeline/chat/template_budget.py`: renders a chat template on probe conversations with
transformers' own renderer, counting the template's steps, under a memory limit; its parent kills it at the time
budget. Run as a script (never imported by the pipeline): one JSON request per line on stdin, one JSON answer per
line on stdout; it exits at end of input or after `IDLE_EXIT_S` without a request.

A step is one line of the compiled template executed (Jinja compiles a template to Python code named
``<template>``; a loop's body is lines run once per pass), so nested loops exhaust the step budget long before
the clock, the same on any machine. Work outside the template's lines (a filter over a long list, arithmetic on
a huge number) is bounded by the parent's clock and this process's address-space limit.
"""

from __future__ import annotations

import json
import os
import select
import sys
from typing import Any

IDLE_EXIT_S = 300.0
"""A probe process idle this long exits; the parent starts another when it next needs one."""
MAX_ERROR_CHARS = 300


class StepsExceeded(BaseException):
    """Raised from the trace function: a BaseException, so no ``except Exception`` in Jinja or a template stops it."""


def _tracer(limit: int) -> tuple[Any, list[int]]:
    count = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
            if count[0] > limit:
                raise StepsExceeded
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    return calls, count


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _limit_memory(extra_bytes: int) -> None:
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = _address_space() + extra_bytes
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    except (ImportError, OSError, ValueError):  # no /proc or no rlimits here: the clock still bounds the render
        pass


def _unlimit_memory() -> None:
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass


def probe(request: dict[str, Any], render: Any) -> dict[str, Any]:
    """Render every probe; the answer says whether a budget was exceeded and which render errors the template
    raised (those are not the budget's business: the caller renders again and reports them)."""
    tracer, count = _tracer(int(request["steps"]))
    errors: list[str] = []
    _limit_memory(int(request["memory_bytes"]))
    sys.settrace(tracer)
    try:
        for conversation, tools, generation in request["probes"]:
            try:
                render(
                    conversations=[conversation],
                    tools=tools,
                    chat_template=request["template"],
                    add_generation_prompt=generation,
                    **request["variables"],
                )
            except MemoryError:
                return {"exceeded": "memory", "steps": count[0]}
            except Exception as exc:  # the template's own error (raise_exception, an undefined name)
                errors.append(f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
    except StepsExceeded:
        return {"exceeded": "steps", "steps": count[0]}
    finally:
        sys.settrace(None)
        _unlimit_memory()
    return {"exceeded": None, "steps": count[0], "errors": errors}


def main() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    while select.select([sys.stdin], [], [], IDLE_EXIT_S)[0]:
        line = sys.stdin.readline()
        if not line:
            return
        answer = probe(json.loads(line), render_jinja_template)
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this directory's modules (template.py) must not shadow anything
    main()
