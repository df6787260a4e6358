"""Tasks: where prompts come from and how completions are scored.

A `Task` yields `Prompt`s (the one prompt record, `pipeline/wire/prompts.py`) and scores a completion with
`Task.verify`, which returns a `VerifierResult` with status ``ok`` (reward set) or ``format_error``
(reward 0: the policy's fault, trained on). The caller never invokes ``verify`` directly but through a
`VerifierPool`, which runs it on the pool's own bounded threads (never the event loop's default executor,
which generation and weight pulls use) under a timeout, and turns an exception or a timeout into
``infra_error`` with reward None: an infrastructure failure is never scored as a policy failure, so it
stays out of the loss and out of the group baseline. A reward that is not a finite number (NaN, inf, or
past float32, the wire's reward type; `reward_problem`) is a broken verifier too: that sample alone becomes
``infra_error``, where it would otherwise fail the whole group's validation. A verifier that hangs holds
one pool thread and nothing else.

`get_task` resolves a built-in name (`BUILTIN_TASKS`) or ``"package.module:function"``; built-ins are
imported lazily so that importing this package stays cheap and free of circular imports.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import json
import logging
import math
import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.wire.prompts import Prompt, PromptError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pipeline.config import LeewayConfig
    from pipeline.tasks.agents import AgentFunction
    from pipeline.tasks.environment import Environment

logger = logging.getLogger(__name__)

VerifierStatus = Literal["ok", "format_error", "infra_error"]

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: a trajectory's rewards travel as float32, so a larger reward arrives as inf."""


def reward_problem(reward: object) -> str | None:
    """Why `reward` cannot be a sample's reward (not a real number, NaN, inf, past float32), or None if it can.

    Checked where a verifier or an environment hands a reward over, so a broken one fails its sample
    (``infra_error``) and not the validation of the whole group it travels in."""
    try:
        value = float(reward)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"reward {reward!r} is not a number"
    if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        return f"reward {value!r} is not finite (as float32)"
    return None


BUILTIN_TASKS: dict[str, str] = {
    "reverse_digits": "pipeline.tasks.reverse:ReverseDigitsTask",
    "exact_match": "pipeline.tasks:ExactMatchTask",
    "reverse_tool": "pipeline.tasks.tool_reverse:ReverseToolTask",
    "reasoning_gym": "pipeline.tasks.reasoning_gym:ReasoningGymTask",
    "math": "pipeline.tasks.math_problems:MathTask",
    "skyrl_gym": "pipeline.tasks.skyrl_gym:SkyRLGymTask",
    "openenv": "pipeline.tasks.openenv:OpenEnvTask",
    "harbor": "pipeline.tasks.harbor:HarborTask",
}
"""Built-in task name -> ``module:callable`` returning a `Task`."""


@dataclass(frozen=True)
class VerifierResult:
    """``reward`` is None exactly when ``status == "infra_error"``; ``format_error`` carries reward 0."""

    reward: float | None
    status: VerifierStatus = "ok"
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.reward is None) != (self.status == "infra_error"):
            raise ValueError(f"VerifierResult: reward={self.reward!r} does not fit status={self.status!r}")


class Task(ABC):
    """A prompt source and a verifier. ``verify`` may be a plain or an ``async`` method; it runs on a
    `VerifierPool` thread (plain) or on the event loop (async) under the pool's timeout."""

    name: str = "task"
    max_reward: float = 1.0
    """What a right answer scores: the verifier self-check (`pipeline/tasks/self_check.py`) requires each reference
    answer to score it, and an empty or a garbage answer to score below it."""
    self_check: bool = True
    """False for a task without reference answers whose rewards come from elsewhere (an environment server): the
    verifier self-check does not apply to it."""
    reward_range: tuple[float, float] | None = None
    """Where the verifier's rewards must lie, or None for any finite reward; a reward outside is refused for its
    sample (``infra_error``, reason ``reward_out_of_range``), never trained on."""

    multi_turn: bool = False
    """True for a task whose samples are episodes against an `Environment` (`environment`); False: one reply per
    sample, scored by `verify`."""
    agent: AgentFunction | None = None
    """The task's own agent function (`pipeline/tasks/agents.py`), run against the generator's endpoint when
    `task.agent` does not name one; None: no agent."""
    sandboxed_agents: bool = False
    """True when an agent function's run happens inside one of this task's episodes (`environment`, a sandbox in
    ``ctx.sandbox``) and the episode's own verdict, not the agent's, is its reward."""
    tokenizer: Tokenizer | None = None
    """The tokenizer the task's prompts and rewards assume (a task with its own alphabet), used when `model.tokenizer`
    names none; None: the model's."""
    chat_template: str | None = None
    """A Jinja chat template the task's chat prompts assume, used when the model has none; None: the model's."""

    @abstractmethod
    def prompts(self) -> Iterator[Prompt]:
        """The prompts, in a deterministic order (built-in tasks: infinite, from their seed)."""

    def completion_for(self, answer: str) -> str:
        """A reply that gives `answer` the way the policy is asked to write it (a task that reads answers from tags
        wraps it in them); the self-check writes its reference, empty and garbage answers with it."""
        return answer

    def reference_completion(self, prompt: Prompt) -> str | None:
        """A completion that must score `max_reward`, or None when the prompt has none; by default the prompt's
        ``answer`` through `completion_for`."""
        return None if prompt.answer is None else self.completion_for(prompt.answer)

    def eval_prompts(self) -> list[Prompt] | None:
        """Held-out prompts that `prompts` never yields (a task's eval split), or None when the task has none."""
        return None

    @abstractmethod
    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        """Score one completion (the reply text with its final stop token removed, and the reply's ids)."""

    def environment(self, prompt: Prompt) -> Environment:
        """A fresh environment for one sample of `prompt`; only called on a `multi_turn` task."""
        raise NotImplementedError(f"task {self.name!r} is single-turn: it has no environment")

    async def aclose(self) -> None:
        """Release what the task holds for the process's lifetime (a sandbox pool); called once when it stops."""
        return None


def task_for(cfg: LeewayConfig) -> Task:
    """The run's task (`task.name` with `task.args`); a task with ``bind_run(cfg)`` (Harbor's: its sandboxes and
    rollout settings) is handed the whole config."""
    task = get_task(cfg.task.name, **cfg.task.args)
    bind = getattr(task, "bind_run", None)
    if callable(bind):
        bind(cfg)
    return task


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a task from a built-in name or ``"module:function"`` (called with ``kwargs``)."""
    target = BUILTIN_TASKS.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"task {name!r} is neither a built-in ({sorted(BUILTIN_TASKS)}) nor 'module:function'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task {name!r}: cannot import {target!r}: {exc}") from exc
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise ValueError(f"task {name!r}: {target} returned {type(task).__name__}, not a pipeline.tasks.Task")
    return task


VERIFIER_TIMEOUT_S = 30.0
"""Default limit on one `Task.verify` call (time queued for a pool thread included); past it: ``infra_error``."""
VERIFIER_THREADS = 4
"""Threads of a `VerifierPool`. A verifier hung past its timeout keeps its thread; once all are held, every
later verification waits in the pool's queue and times out (``infra_error``) until one returns."""


class VerifierPool:
    """Where verifiers run: a dedicated, bounded `ThreadPoolExecutor` and a timeout.

    Plain ``verify`` methods run on this pool's ``num_threads`` threads, never on the event loop's default
    executor (``asyncio.to_thread``), so a verifier that hangs cannot take a thread from generation or a
    weight pull. A thread cannot be killed: a verifier past its timeout keeps running in the background and
    its result is ignored; `stuck` counts such calls, and the pool logs when they hold every thread.
    ``close()`` (or leaving ``with``) drops queued calls and does not wait for running ones.
    """

    def __init__(self, *, timeout_s: float = VERIFIER_TIMEOUT_S, num_threads: int = VERIFIER_THREADS) -> None:
        if timeout_s <= 0 or num_threads < 1:
            raise ValueError(
                f"VerifierPool: timeout_s must be > 0 and num_threads >= 1, got {timeout_s}, {num_threads}"
            )
        self.timeout_s = timeout_s
        self.num_threads = num_threads
        self.stuck = 0
        self._stuck_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="leeway-verifier")

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def verify(
        self, task: Task, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]
    ) -> VerifierResult:
        """``task.verify`` under the timeout; an exception or a timeout becomes ``infra_error`` with reward None."""
        try:
            if inspect.iscoroutinefunction(task.verify):
                result = await asyncio.wait_for(
                    task.verify(prompt, completion_text, completion_ids), timeout=self.timeout_s
                )
            else:
                result = await self._in_thread(task, prompt, completion_text, completion_ids)
        except asyncio.TimeoutError:
            logger.warning(
                "verifier of task %s timed out after %.1f s on prompt %s", task.name, self.timeout_s, prompt.prompt_id
            )
            return VerifierResult(None, "infra_error", {"error": f"verifier timed out after {self.timeout_s} s"})
        except Exception as exc:  # a boundary we own: any verifier failure is an infrastructure failure
            logger.exception("verifier of task %s raised on prompt %s", task.name, prompt.prompt_id)
            return VerifierResult(None, "infra_error", {"error": f"{type(exc).__name__}: {exc}"})
        if not isinstance(result, VerifierResult):
            return VerifierResult(None, "infra_error", {"error": f"verifier returned {type(result).__name__}"})
        problem = None if result.reward is None else reward_problem(result.reward)
        if problem is None and result.reward is not None and task.reward_range is not None:
            low, high = task.reward_range
            if not low <= result.reward <= high:
                problem = f"reward {result.reward!r} is outside the task's range [{low}, {high}]"
                logger.warning(
                    "verifier of task %s on prompt %s: %s; infra_error", task.name, prompt.prompt_id, problem
                )
                return VerifierResult(
                    None,
                    "infra_error",
                    {**result.info, "error": f"verifier: {problem}", "reason": "reward_out_of_range"},
                )
        if problem is not None:
            logger.warning("verifier of task %s on prompt %s: %s; infra_error", task.name, prompt.prompt_id, problem)
            return VerifierResult(None, "infra_error", {**result.info, "error": f"verifier: {problem}"})
        return result

    async def _in_thread(
        self, task: Task, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]
    ) -> VerifierResult:
        """A plain verify on a pool thread; past the timeout a running call is left running, counted in `stuck`."""
        call = self._executor.submit(task.verify, prompt, completion_text, completion_ids)
        waiter = asyncio.wrap_future(call)
        try:
            done, _ = await asyncio.wait({waiter}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            call.cancel()
            raise
        if waiter in done:
            return waiter.result()
        waiter.add_done_callback(_ignore_result)
        if call.cancel():  # still queued behind stuck verifiers: it never runs
            raise asyncio.TimeoutError
        with self._stuck_lock:
            self.stuck += 1
            all_stuck = self.stuck >= self.num_threads
        call.add_done_callback(self._unstuck)
        if all_stuck:
            logger.error(
                "all %d verifier threads are held by verifiers past their %.1f s timeout (task %s): every sample is "
                "an infra_error until one returns",
                self.num_threads,
                self.timeout_s,
                task.name,
            )
        raise asyncio.TimeoutError

    def _unstuck(self, _: object) -> None:
        with self._stuck_lock:
            self.stuck -= 1


def _ignore_result(future: asyncio.Future[VerifierResult]) -> None:
    """A verifier's result after its timeout is ignored; retrieving it keeps asyncio from reporting it."""
    if not future.cancelled():
        future.exception()


def load_prompts(path: str | Path, *, id_prefix: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL or Parquet file of rows ``{"prompt": str, "answer": str?, "tags": [str]?, ...}``, or
    chats: ``{"messages": [{"role", "content"}, ...], ...}`` instead of ``prompt`` (rendered with the model's chat
    template by the generator). Other columns go to ``metadata``. ``prompt_id`` is the row's ``id`` column if present, else
    ``<file stem>-<row index>``. A row without a string ``prompt`` raises ValueError naming file and row.
    """
    path = Path(path)
    rows = read_rows(path, what="prompt file")
    prefix = id_prefix or path.stem
    return [_prompt_from_row(row, path, i, prefix) for i, row in enumerate(rows)]


def read_rows(path: str | Path, *, what: str) -> list[Any]:
    """The rows of a JSONL or Parquet file (prompts, SFT examples); ValueError naming `what`, the file and the line
    for a missing file, another format or a line that is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{what} {path}: expected a .jsonl or .parquet file")
    rows = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not valid JSON: {exc}") from exc
    return rows


def _prompt_from_row(row: Any, path: Path, index: int, prefix: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError(f"{path}: row {index} is not an object")
    messages = row.get("messages")
    if messages is None and not isinstance(row.get("prompt"), str):
        raise ValueError(f"{path}: row {index} has neither a string 'prompt' nor a list 'messages'")
    if messages is not None and row.get("prompt") is not None:
        raise ValueError(f"{path}: row {index} has both 'prompt' and 'messages'; give one")
    answer = row.get("answer")
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "messages", "answer", "tags", "id")}
    try:
        return Prompt(
            prompt_id=str(row.get("id", f"{prefix}-{index}")),
            text=row.get("prompt"),
            messages=None if messages is None else [_file_message(m) for m in messages],
            answer=None if answer is None else str(answer),
            metadata=metadata,
            tags=tuple(str(t) for t in row.get("tags") or ()),
        )
    except PromptError as exc:
        raise ValueError(f"{path}: row {index}: {exc}") from exc


def shuffled_epochs(items: Sequence[Any], key: str) -> Iterator[Any]:
    """`items` forever, each epoch in an order shuffled from ``key`` and the epoch: the same in every process."""
    for epoch in itertools.count():
        order = list(items)
        random.Random(f"{key}-{epoch}").shuffle(order)
        yield from order


def with_system_prompt(prompt: Prompt, system_prompt: str | None) -> Prompt:
    """`prompt` with a system message first, when it is a chat without one and `system_prompt` is set
    (``task.system_prompt``); any other prompt as it is."""
    if system_prompt is None or prompt.messages is None or prompt.messages[0].get("role") == "system":
        return prompt
    return replace(prompt, messages=({"role": "system", "content": system_prompt}, *prompt.messages))


def _file_message(message: Any) -> Any:
    """A message as a file holds it; Parquet's struct columns give every key of every row, unset ones as None."""
    if not isinstance(message, dict):
        return message
    return {k: v for k, v in message.items() if v is not None or k == "content"}


class ExactMatchTask(Task):
    """Prompts from a JSONL/Parquet file, cycled forever in an order shuffled per epoch from ``seed``;
    reward 1 when the stripped completion equals the stripped answer, else 0."""

    name = "exact_match"

    def __init__(self, path: str, seed: int = 0) -> None:
        self._prompts = load_prompts(path)
        if not self._prompts:
            raise ValueError(f"exact_match: prompt file {path} has no rows")
        if any(p.answer is None for p in self._prompts):
            raise ValueError(f"exact_match: every row of {path} needs an 'answer'")
        self._seed = seed

    def prompts(self) -> Iterator[Prompt]:
        return shuffled_epochs(self._prompts, str(self._seed))

    def verify(self, prompt: Prompt, completion_text: str, completion_ids: Sequence[int]) -> VerifierResult:
        assert prompt.answer is not None
        return VerifierResult(float(completion_text.strip() == prompt.answer.strip()))
