"""Finding a task by name: `BUILTIN_TASKS`, `get_task` (a built-in name or ``"package.module:function"``) and
`task_for` (the run's task, configured with its `TaskSettings`).

Built-ins are named here as ``module:callable`` strings and imported only when asked for, so importing
`pipeline.tasks` stays cheap (no datasets, no environment clients) and no built-in module is imported by the
package it builds on: no circular imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeline.tasks.base import Task
from pipeline.tasks.scorer_recipe import attach_recipe, registry_recipe
from pipeline.tasks.settings import TaskSettings

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig

BUILTIN_TASKS: dict[str, str] = {
    "reverse_digits": "pipeline.tasks.reverse:ReverseDigitsTask",
    "exact_match": "pipeline.tasks.exact_match:ExactMatchTask",
    "reverse_tool": "pipeline.tasks.tool_reverse:ReverseToolTask",
    "reasoning_gym": "pipeline.tasks.reasoning_gym:ReasoningGymTask",
    "math": "pipeline.tasks.math_problems:MathTask",
    "skyrl_gym": "pipeline.tasks.skyrl_gym:SkyRLGymTask",
    "openenv": "pipeline.tasks.openenv:OpenEnvTask",
    "harbor": "pipeline.tasks.harbor:HarborTask",
}
"""Built-in task name -> ``module:callable`` returning a `Task`."""


def task_for(cfg: LeewayConfig) -> Task:
    """The run's task (`task.name` with `task.args`), configured with the run's `TaskSettings` (`Task.configure`:
    Harbor's sandboxes and rollout rules)."""
    task = get_task(cfg.task.name, **cfg.task.args)
    task.configure(TaskSettings.from_config(cfg))
    return task


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a task from a built-in name or ``"module:function"`` (called with ``kwargs``); unless it carries its own,
    the task gets the recipe a scorer worker rebuilds it from (this same call: `registry_recipe`)."""
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
    try:
        attach_recipe(task, registry_recipe(name, kwargs))
    except ValueError:  # arguments that are not JSON: a worker cannot rebuild it (recipe_of says so by name)
        pass
    return task
