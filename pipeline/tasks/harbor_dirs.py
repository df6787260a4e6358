"""Harbor task directories, loaded and checked before any episode runs (`pipeline/tasks/harbor.py` plays them),
and the deadlines an episode's hooks run under, derived from each task's timeouts and the run's settings.

A task directory is read by the host (``instruction.md`` becomes a prompt) and bound into the verifier's sandbox
(``tests/``), so it is refused at load when it holds a symlink (anywhere, pointing anywhere: a link that stays
inside today is one ``ln -sf`` from a host file in a prompt or in the tests' view) or anything but plain files and
directories (a FIFO would hang the host's read). Every number in ``task.toml`` that becomes a deadline or a limit
must be finite and above zero: ``tomllib`` parses ``nan`` and ``inf``, and a NaN deadline never fires.

Every operation of an episode has a deadline of its own: a command ``sandbox.command_timeout_s`` (within the
agent's ``[agent] timeout_sec``), the tests ``[verifier] timeout_sec``, a sandbox's start
``sandbox.start_timeout_s`` after its wait for a slot (the pool's admission limit). `hook_deadlines` sums what each
hook of the rollout covers, so the rollout's deadline on a hook (`Environment.hook_timeout_s`) is a backstop over
them and never a fixed minute that masks a long test run as an ``infra_error``.
"""

from __future__ import annotations

import math
import operator
import os
import stat
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.sandbox.supervised import KILL_S, REPLY_MARGIN_S, TEARDOWN_S, TREE_S

if TYPE_CHECKING:
    from pipeline.tasks.environment import Hook
    from pipeline.tasks.settings import TaskSettings

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

DEFAULT_TIMEOUT_S = 600.0
"""Harbor's default for ``[agent] timeout_sec`` and ``[verifier] timeout_sec``."""
READ_S = 10.0
"""Reading the reward file through the supervisor (a small file; its reply margin is on top)."""


@dataclass(frozen=True)
class HarborTaskDir:
    name: str
    path: Path
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    cpus: float | None
    memory_mb: int | None
    tags: tuple[str, ...]


def refuse_links(path: Path) -> None:
    """`ValueError` naming the first symlink or special file under `path` (`path` itself included)."""
    if path.is_symlink():
        raise ValueError(f"harbor task {path}: is a symlink (task directories must hold plain files only)")
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in sorted(dirs + files):
            entry = Path(top) / name
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise ValueError(
                    f"harbor task {entry}: is a symlink (to {os.readlink(entry)}); task directories must hold plain "
                    "files only: a link puts host files into prompts and the verifier's /tests"
                )
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ValueError(f"harbor task {entry}: not a regular file or directory")


def positive(value: Any, where: str, *, integer: bool = False) -> float:
    """`value` as a finite number above zero (an integer with `integer`), or a `ValueError` naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be finite and > 0, got {value!r}")
    if integer and value != int(value):
        raise ValueError(f"{where} must be a whole number, got {value!r}")
    return float(value)


def load_task_dir(path: Path) -> HarborTaskDir:
    """One task directory, checked (an error names the file and the field)."""
    refuse_links(path)
    for needed in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (path / needed).is_file():
            raise ValueError(f"harbor task {path}: {needed} is missing")
    toml = path / "task.toml"
    try:
        meta = tomllib.loads(toml.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"harbor task {toml}: {exc}") from exc
    sections = {}
    for key in ("agent", "verifier", "environment", "metadata"):
        sections[key] = meta.get(key) or {}
        if not isinstance(sections[key], dict):
            raise ValueError(f"harbor task {toml}: [{key}] must be a table")
    agent, verifier, environment = sections["agent"], sections["verifier"], sections["environment"]
    tags = sections["metadata"].get("tags") or []
    if not isinstance(tags, list):
        raise ValueError(f"harbor task {toml}: [metadata] tags must be a list")
    cpus, memory_mb = environment.get("cpus"), environment.get("memory_mb")
    try:
        return HarborTaskDir(
            name=path.name,
            path=path,
            instruction=(path / "instruction.md").read_text().strip(),
            agent_timeout_s=positive(agent.get("timeout_sec", DEFAULT_TIMEOUT_S), "[agent] timeout_sec"),
            verifier_timeout_s=positive(verifier.get("timeout_sec", DEFAULT_TIMEOUT_S), "[verifier] timeout_sec"),
            cpus=None if cpus is None else positive(cpus, "[environment] cpus"),
            memory_mb=None if memory_mb is None else int(positive(memory_mb, "[environment] memory_mb", integer=True)),
            tags=tuple(str(t) for t in tags),
        )
    except ValueError as exc:
        raise ValueError(f"harbor task {toml}: {exc}") from exc


def load_task_dirs(root: str | Path) -> list[HarborTaskDir]:
    """Every task directory under `root` (a subdirectory with a ``task.toml``), each checked by `load_task_dir`."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"harbor: task.args.path {root} is not a directory")
    entries = sorted(root.iterdir())
    for entry in entries:
        if entry.is_symlink() and entry.is_dir():
            raise ValueError(f"harbor task {entry}: is a symlink (task directories must hold plain files only)")
    tasks = [load_task_dir(p) for p in entries if p.is_dir() and (p / "task.toml").exists()]
    if not tasks:
        raise ValueError(f"harbor: task.args.path {root} holds no task directory (a subdirectory with task.toml)")
    return tasks


def hook_deadlines(task: HarborTaskDir, settings: TaskSettings) -> dict[Hook, float]:
    """The longest each hook of one episode of `task` may take: the sum of the deadlines of what it does.

    ``opening`` waits for a slot and starts the agent's sandbox; ``step`` runs one command and, on DONE, the
    verifier (``final`` alone); ``final`` hands /app over (kill, export, close), waits for a slot, starts the
    verifier's sandbox with /app imported, runs the tests, kills what they left and reads the reward; ``aclose``
    tears a sandbox down. Each part is a deadline the sandbox code enforces (`pipeline.sandbox.supervised`'s
    request deadlines plus its reply margin), so the sum is reached only when one of them failed. A non-finite
    setting is refused at `pipeline.tasks.harbor.HarborTask.configure`, so these are finite."""
    request = partial(operator.add, REPLY_MARGIN_S)  # a request's own deadline, and its reply's margin
    start = admission_wait_s(settings) + settings.sandbox.start_timeout_s
    command = request(min(settings.command_timeout_s, task.agent_timeout_s))
    hand_over = request(KILL_S) + request(TREE_S) + TEARDOWN_S
    tests = start + request(TREE_S) + request(task.verifier_timeout_s) + request(KILL_S) + request(READ_S)
    verifier = hand_over + tests + TEARDOWN_S
    return {"opening": start + TEARDOWN_S, "step": command + verifier, "final": verifier, "aclose": TEARDOWN_S}


def admission_wait_s(settings: TaskSettings) -> float:
    """How long a sandbox may wait for its slot in the pool before the pool gives up (``sandbox.admission_timeout_s``:
    `SandboxStartTimeout`, an infra failure)."""
    return settings.sandbox.admission_timeout_s
