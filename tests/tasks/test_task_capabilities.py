"""Every built-in task, built the way a run builds it, declares its capabilities on the `Task` contract: multi-turn
tasks (and only they) make `Environment`s, an agent where the task ships one, sandboxed agents for harbor, a
tokenizer and a chat template of the declared types, an awaitable `aclose`, and `configure` taking the run's
settings."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pipeline.config import load_config
from pipeline.tasks import BUILTIN_TASKS, Task, TaskSettings, get_task
from pipeline.tasks.environment import Environment
from pipeline.tasks.verifiers import VerifierPool

ROOT = Path(__file__).resolve().parents[2]


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _exact_match(tmp: Path) -> Task:
    return get_task("exact_match", path=_rows(tmp / "qa.jsonl", [{"prompt": "2+2=", "answer": "4"}]))


def _math(tmp: Path) -> Task:
    return get_task(
        "math", path=_rows(tmp / "math.jsonl", [{"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}])
    )


def _skyrl_gym(tmp: Path) -> Task:
    rows = [{"id": "q-0", "messages": [{"role": "user", "content": "What is 6*7?"}], "answer": "42"}]
    path = _rows(tmp / "gsm.jsonl", rows)
    return get_task("skyrl_gym", env="gsm8k_multi_turn", path=path, max_turns=3, answer_template="#### {answer}")


def _openenv(tmp: Path) -> Task:
    pytest.importorskip("openenv", reason="openenv is installed by `make test` (pip install --no-deps openenv==0.10.0)")
    return get_task("openenv", url="http://127.0.0.1:9")  # never reached: no episode is opened here


BUILDERS: dict[str, Callable[[Path], Task]] = {
    "reverse_digits": lambda tmp: get_task("reverse_digits"),
    "exact_match": _exact_match,
    "reverse_tool": lambda tmp: get_task("reverse_tool"),
    "reasoning_gym": lambda tmp: get_task("reasoning_gym", dataset="chain_sum", size=20, seed=2),
    "math": _math,
    "skyrl_gym": _skyrl_gym,
    "openenv": _openenv,
    "harbor": lambda tmp: get_task("harbor", path=str(ROOT / "configs" / "data" / "coding")),
}
"""How each built-in is built in its own tests (a small file where it reads one, the shipped coding set for harbor)."""

MULTI_TURN = {"skyrl_gym", "openenv", "harbor"}
WITH_AGENT = {"reverse_tool"}
SANDBOXED_AGENTS = {"harbor"}
WITH_CHAT_TEMPLATE = {"reverse_tool", "harbor"}
VERIFIES_IN_CALLER = {"openenv", "harbor"}
"""Tasks whose plain verify reads no reply (the rest run theirs in scorer workers)."""


def test_every_built_in_task_has_a_builder_here() -> None:
    assert set(BUILDERS) == set(BUILTIN_TASKS)


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_a_built_in_task_declares_its_capabilities(name: str, tmp_path: Path) -> None:
    task = BUILDERS[name](tmp_path)
    assert isinstance(task, Task)
    prompt = next(iter(task.prompts()))

    assert task.multi_turn is (name in MULTI_TURN)
    assert task.verifies_in_workers is (name not in VERIFIES_IN_CALLER)
    assert task.scorer_recipe is not None  # get_task gave it one, or it carries its own
    if task.multi_turn:
        with VerifierPool() as pool:  # its workers start on first use: none does here
            pool.attach(task)
            episode = task.environment(prompt)
            assert isinstance(episode, Environment)
            asyncio.run(episode.aclose())  # never opened: closing it is still safe
    else:
        with pytest.raises(NotImplementedError, match="single-turn"):
            task.environment(prompt)

    assert (task.agent is not None) is (name in WITH_AGENT)
    if task.agent is not None:
        assert inspect.iscoroutinefunction(task.agent)
    assert task.sandboxed_agents is (name in SANDBOXED_AGENTS)
    assert task.sandboxed_agents <= task.multi_turn  # an agent's sandbox is one of the task's episodes
    assert task.tokenizer is None or isinstance(task.tokenizer, Tokenizer)
    assert isinstance(task.chat_template, str) if name in WITH_CHAT_TEMPLATE else task.chat_template is None

    task.configure(TaskSettings())
    assert inspect.iscoroutinefunction(task.aclose)
    assert asyncio.run(task.aclose()) is None


def test_the_run_settings_come_from_the_config_and_harbor_takes_them() -> None:
    sets = ["sandbox.command_timeout_s=5", "sandbox.max_processes=64", "rollout.agent_timeout_is=infra"]
    settings = TaskSettings.from_config(load_config(None, [*sets, "rollout.strict_format=true"], environ={}))
    assert (settings.command_timeout_s, settings.agent_timeout_is, settings.strict_format) == (5.0, "infra", True)
    assert settings.sandbox.limits.max_processes == 64
    task = BUILDERS["harbor"](Path())
    task.configure(settings)
    assert task.settings is settings  # type: ignore[attr-defined]


def test_a_sandbox_failure_reaches_the_episode_as_one_typed_reason_named_once() -> None:
    from pipeline.failures import InfraFailure, InfraReason
    from pipeline.sandbox import SandboxError, SandboxLost, SandboxStartTimeout
    from pipeline.tasks.harbor import EpisodeFailure

    lost = SandboxLost("bwrap sandbox t1: it stopped answering")
    assert isinstance(lost, SandboxError) and isinstance(lost, InfraFailure)
    assert lost.reason is InfraReason.SANDBOX_LOST and SandboxStartTimeout.reason is InfraReason.SANDBOX_START_TIMEOUT
    wrapped = EpisodeFailure(lost.reason, lost.detail)
    assert isinstance(wrapped, InfraFailure) and wrapped.reason == "sandbox_lost"
    assert str(wrapped) == "sandbox_lost: bwrap sandbox t1: it stopped answering"
