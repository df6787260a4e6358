"""The task contract: `Task`, what its verifier returns (`VerifierResult`, `VerifierStatus`) and which rewards a
verifier or an environment may hand over (`reward_problem`).

A `Task` yields `Prompt`s (the one prompt record, `pipeline/wire/prompts.py`) and scores a completion with
`Task.verify`, which returns a `VerifierResult` with status ``ok`` (reward set) or ``format_error`` (reward 0: the
policy's fault, trained on); ``infra_error`` (reward None) is for failures that are not the policy's. Everything a
task may add beyond that is declared here, with a default that means "not this kind of task", so a caller reads an
attribute and never probes for one: `multi_turn` with `environment`, `agent`, `sandboxed_agents`, `tokenizer`,
`chat_template`, `configure` (what it takes from the run, `TaskSettings`) and `aclose`. Here apart from the
registry and the file readers so that every built-in task imports only what it builds on.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pipeline.wire.prompts import Prompt

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pipeline.tasks.agents import AgentFunction
    from pipeline.tasks.environment import Environment
    from pipeline.tasks.scorer_recipe import ScorerRecipe
    from pipeline.tasks.settings import TaskSettings

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
    `pipeline.tasks.verifiers.VerifierPool` thread (plain) or on the event loop (async) under the pool's timeout."""

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

    scorer_recipe: ScorerRecipe | None = None
    """How a scorer worker rebuilds this task's verifier (`pipeline/tasks/scorer_recipe.py`): a built-in that knows a
    lighter scorer than itself sets its own, `get_task` gives every other task it builds the registry's (its name and
    arguments). None (a task built directly): scorable in a worker only when its class takes no arguments."""
    verifies_in_workers: bool = True
    """False only for a task whose plain `verify` never reads the reply (its verdict comes from an environment server
    or a sandbox's tests): that one runs in the caller under the pool's timeout. Every other plain `verify` reads
    hostile text and runs in a scorer worker (`pipeline/tasks/verifiers.py`)."""

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

    def configure(self, settings: TaskSettings) -> None:
        """Take what the task needs from the run's settings (`pipeline.tasks.registry.task_for` calls this once,
        before any prompt is drawn); by default nothing."""
        return None

    def environment(self, prompt: Prompt) -> Environment:
        """A fresh environment for one sample of `prompt`; only called on a `multi_turn` task."""
        raise NotImplementedError(f"task {self.name!r} is single-turn: it has no environment")

    def use_scorers(self, pool: Any) -> None:
        """Take the `pipeline.tasks.verifiers.VerifierPool` whose workers hold this task's environments (`VerifierPool.attach` calls it; a task
        whose environments read the reply, skyrl-gym's, keeps it); by default nothing."""
        return None

    async def aclose(self) -> None:
        """Release what the task holds for the process's lifetime (a sandbox pool); called once when it stops."""
        return None
