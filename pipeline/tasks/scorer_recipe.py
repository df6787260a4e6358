"""How a scorer worker rebuilds a task's scorer: `ScorerRecipe`, a ``"module:attr"`` factory and JSON kwargs.

A worker holds no object of the generator: it gets a recipe and builds the scorer itself. A task says how:

- its own ``scorer_recipe`` attribute (a built-in task that knows a lighter scorer than itself: ``math`` needs only
  math-verify, no prompts file; ``skyrl_gym`` only the environment's name and config), else
- the recipe `attach_recipe` gave it (the run's ``task.name`` and ``task.args`` through the registry:
  `registry_recipe`; the generator, the trainer's self-check and ``leeway eval`` attach it), else
- for a task class that takes no arguments, defined at a module's top level: that class, with no kwargs.

A task with none of these (built directly, with arguments) cannot be scored in a worker: `recipe_of` says so by
name. The factory's module must import inside a worker that sees only the interpreter, its site-packages and the
package directories of the project and of the factory (`package_dirs`): a scorer must not need the run's files.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGISTRY_FACTORY = "pipeline.tasks.registry:get_task"


@dataclass(frozen=True)
class ScorerRecipe:
    """``factory`` (``"module:attr"``) called with ``kwargs`` (JSON values) builds the scorer: an object with the
    task's ``verify`` (and, for an environment task, ``open_environment``/``step_environment``)."""

    factory: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, sep, attr = self.factory.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"scorer recipe: factory must be 'module:attr', got {self.factory!r}")
        try:
            json.dumps(dict(self.kwargs), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"scorer recipe {self.factory}: kwargs must be JSON values ({exc})") from exc

    @property
    def key(self) -> str:
        """The recipe as one canonical string: a worker builds each distinct one once."""
        return json.dumps({"factory": self.factory, "kwargs": dict(self.kwargs)}, sort_keys=True)

    def to_json(self) -> dict[str, Any]:
        return {"factory": self.factory, "kwargs": dict(self.kwargs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScorerRecipe:
        if not isinstance(data, Mapping) or not isinstance(data.get("factory"), str):
            raise ValueError(f"scorer recipe: not a recipe: {data!r}")
        return cls(data["factory"], dict(data.get("kwargs") or {}))

    def build(self) -> Any:
        """Import the factory and call it (inside a worker)."""
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)(**self.kwargs)


def registry_recipe(name: str, args: Mapping[str, Any]) -> ScorerRecipe:
    """The run's task as the registry builds it: ``get_task(name, **args)``."""
    return ScorerRecipe(REGISTRY_FACTORY, {"name": name, **args})


def attach_recipe(task: Any, recipe: ScorerRecipe) -> None:
    """Give a task built from `recipe` its recipe, unless the task carries its own (lighter) one."""
    if task.scorer_recipe is None:
        task.scorer_recipe = recipe


def recipe_of(task: Any) -> ScorerRecipe:
    """The recipe a worker rebuilds `task`'s scorer from; see the module docstring. ValueError naming the task when
    it has none."""
    if task.scorer_recipe is not None:
        return task.scorer_recipe
    cls = type(task)
    if "<locals>" not in cls.__qualname__ and _takes_no_arguments(cls):
        return ScorerRecipe(f"{cls.__module__}:{cls.__qualname__}")
    raise ValueError(
        f"task {task.name!r} ({cls.__module__}.{cls.__qualname__}) has no scorer recipe: "
        "a worker cannot rebuild its verifier. Build it with pipeline.tasks.get_task and attach "
        "registry_recipe(name, args) (pipeline.tasks.scorer_recipe), or give the task a scorer_recipe"
    )


def package_dirs(recipe: ScorerRecipe) -> list[Path]:
    """The package directories a worker needs to build `recipe`: the project's (every package beside ``pipeline``:
    ``actors``, ``tests``, ...; each bound alone, never the checkout that holds them) and the factory's top package
    (a factory named through the registry: the task's module, when it is a ``module:function`` name)."""
    import pipeline

    root = Path(pipeline.__file__).parent.parent
    dirs = sorted(p.parent for p in root.glob("*/__init__.py"))
    modules = [recipe.factory.partition(":")[0]]
    if recipe.factory == REGISTRY_FACTORY:
        modules.append(str(recipe.kwargs.get("name", "")).partition(":")[0])
    for module in modules:
        top = module.split(".")[0]
        if not top or top == "pipeline":
            continue
        found = sys.modules.get(top) or _import(top)
        location = getattr(found, "__file__", None)
        if location is not None and Path(location).name == "__init__.py":
            dirs.append(Path(location).parent)
    return dirs


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _takes_no_arguments(cls: type) -> bool:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
