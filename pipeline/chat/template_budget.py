"""A chat template is rendered once under a budget before it is used: a template comes with the model's files
(from the store, from a hub), and Jinja's sandbox bounds a ``range``, not a nesting of them, so a template of
nested loops would hang the process that loads it (the generator, at start-up) and every request after.

`check_template_budget` renders the template on probe conversations (`PROBES`: the bridge's base conversation, and a
conversation with a system prompt, a tool list, a tool call and its result) in a child process
(`template_probe.py`): a step budget on the template's own lines (deterministic: nested loops fail it fast on
any machine), an address-space limit, and a clock the parent enforces by killing the child, so nothing a template
does can stall this process. Past a budget the template is refused (`TemplateBudgetError`, naming where the
template came from and the budget). A template that passed is remembered for the life of the process.

The probe process starts once per process (about a second: it imports transformers' renderer; not counted in the
budget) and is reused; it exits on its own when idle. Only load-time renders are budgeted: the requests that
follow render in this process, with the template that passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TEMPLATE_TIME_S = 10.0
"""The longest the probe renders may take together (the clock starts when the probe process is ready)."""
TEMPLATE_STEPS = 1_000_000
"""Template lines the probe renders may execute together; a real model's template needs a few thousand."""
TEMPLATE_MEMORY_BYTES = 2 << 30
"""Address space the probe renders may add."""
PROBE_START_S = 120.0
"""How long the probe process may take to start (import its renderer) before loading fails."""

_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
_AGENT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "18 C, clear", "tool_call_id": "call_0"},
    {"role": "assistant", "content": "It is 18 C and clear in Paris."},
    {"role": "user", "content": "Thanks!"},
]
PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]] = [
    (_BASE, None, False),
    (_BASE, None, True),
    (_AGENT, _TOOLS, True),
    (_AGENT, None, False),
]
"""(messages, tools, add_generation_prompt) rendered by the probe: what `ChatTemplate` renders when built, and a
conversation that takes every branch an agent's turns take."""

_SCRIPT = Path(__file__).with_name("template_probe.py")


@dataclass(frozen=True)
class TemplateBudget:
    time_s: float = TEMPLATE_TIME_S
    steps: int = TEMPLATE_STEPS
    memory_bytes: int = TEMPLATE_MEMORY_BYTES


class TemplateBudgetError(ValueError):
    """A chat template exceeded its budget rendering the probe conversations: refused."""


class TemplateProbeError(RuntimeError):
    """The probe process could not run (it did not start, or died): the template could not be checked."""


def check_template_budget(
    template: str,
    *,
    source: str,
    variables: Mapping[str, Any],
    budget: TemplateBudget | None = None,
) -> None:
    """Refuse `template` (`TemplateBudgetError`) if rendering `PROBES` with `variables` (the special tokens and the
    template's arguments, as `ChatTemplate` passes them) exceeds `budget`; `source` names where it came from."""
    budget = budget or TemplateBudget()
    request = {"template": template, "variables": dict(variables), "probes": PROBES, **asdict(budget)}
    key = hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()
    if key in _PASSED:
        return
    answer = _PROBER.run(request, budget.time_s)
    if answer is None:
        raise TemplateBudgetError(
            f"{source}: the chat template did not render its probe conversations within {budget.time_s:g} s "
            "(refused: a template that takes this long would stall every request)"
        )
    exceeded = answer.get("exceeded")
    if exceeded == "steps":
        raise TemplateBudgetError(
            f"{source}: the chat template ran past {budget.steps:,} template steps rendering its probe "
            "conversations (nested loops?); refused"
        )
    if exceeded == "memory":
        raise TemplateBudgetError(
            f"{source}: the chat template needed more than {budget.memory_bytes:,} bytes rendering its probe "
            "conversations; refused"
        )
    _PASSED.add(key)


_PASSED: set[str] = set()


class _Prober:
    """The probe process, started on first use and reused; killed at a deadline, started again when next needed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""

    def run(self, request: dict[str, Any], time_s: float) -> dict[str, Any] | None:
        """The child's answer, or None when it did not come within `time_s` (the child is then killed)."""
        line = (json.dumps(request, default=str) + "\n").encode()
        with self._lock:
            for attempt in range(2):  # an idle child may exit just as a request is sent: one more, fresh
                proc = self._started()
                try:
                    assert proc.stdin is not None
                    proc.stdin.write(line)
                    proc.stdin.flush()
                    answer = self._read_line(proc, time.monotonic() + time_s)
                except (BrokenPipeError, EOFError):
                    self._stop()
                    if attempt == 1:
                        raise TemplateProbeError("the chat template's probe process died while rendering") from None
                    continue
                if answer is None:
                    self._stop()
                    return None
                return json.loads(answer)
        raise AssertionError("unreachable")

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        stderr = tempfile.TemporaryFile()
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.Popen(
            [sys.executable, str(_SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env
        )
        self._proc, self._buffer = proc, b""
        try:
            ready = self._read_line(proc, time.monotonic() + PROBE_START_S)
        except EOFError:
            ready = None
        if ready is None or not json.loads(ready).get("ready"):
            self._stop()
            stderr.seek(0)
            tail = stderr.read()[-2000:].decode(errors="replace")
            raise TemplateProbeError(f"the chat template's probe process did not start: {tail}")
        stderr.close()
        return proc

    def _read_line(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc, self._buffer = None, b""


_PROBER = _Prober()
