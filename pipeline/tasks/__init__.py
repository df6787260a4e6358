"""Tasks: where prompts come from and how completions are scored. A map of the package:

    base.py         `Task` (the contract, with every optional capability declared), `VerifierResult`, `reward_problem`
    settings.py     `TaskSettings`: what a task may take from the run (`Task.configure`)
    registry.py     `BUILTIN_TASKS`, `get_task`, `task_for`: a task by name, built-ins imported lazily
    verifiers.py    `VerifierPool`: verifiers on bounded threads under a timeout, failures as ``infra_error``
    files.py        `load_prompts`, `read_rows`, `with_system_prompt`, `shuffled_epochs`
    environment.py  `Environment`, `EnvStep`: a multi-turn task's episodes
    agents.py       the agent-function contract (`AgentOutcome`, `AgentContext`)
    self_check.py   the verifier self-check a run passes before it trains
    exact_match.py, reverse.py, tool_reverse.py, math_problems.py, reasoning_gym.py, skyrl_gym.py, openenv.py,
    harbor.py       the built-in tasks (`BUILTIN_TASKS`), each imported only when named

This module re-exports the public names, so ``from pipeline.tasks import Task, VerifierPool, task_for`` works; it
imports no built-in task.
"""

from pipeline.tasks.base import Task, VerifierResult, VerifierStatus, reward_problem
from pipeline.tasks.files import load_prompts, read_rows, shuffled_epochs, with_system_prompt
from pipeline.tasks.registry import BUILTIN_TASKS, get_task, task_for
from pipeline.tasks.settings import TaskSettings
from pipeline.tasks.verifiers import VERIFIER_TIMEOUT_S, VERIFIER_WORKERS, VerifierPool
from pipeline.wire.prompts import Prompt

__all__ = [
    "BUILTIN_TASKS",
    "VERIFIER_WORKERS",
    "VERIFIER_TIMEOUT_S",
    "Prompt",
    "Task",
    "TaskSettings",
    "VerifierPool",
    "VerifierResult",
    "VerifierStatus",
    "get_task",
    "load_prompts",
    "read_rows",
    "reward_problem",
    "shuffled_epochs",
    "task_for",
    "with_system_prompt",
]
