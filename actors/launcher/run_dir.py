"""The run directory of `leeway run`: created with a marker, and deleted by `--fresh` only when that is safe.

A run directory collects one run's metrics, report, config copy, logs and private stack. Two runs
must never mix in one, and `--fresh` must never delete what `leeway run` did not create:

- `prepare_run_dir` refuses a directory holding an earlier run's `metrics.jsonl` (`RunDirInUse`)
  unless `fresh` is set, and writes `RUN_MARKER` into a directory it creates (or finds empty);
  `--fresh` on a run that trained steps also needs `discard_checkpoints` (its private stack holds its
  checkpoints and weights): the message points at `--resume`, which continues it instead;
  `--resume` needs an earlier run there (`NothingToResume` otherwise) and changes nothing in it;
- `delete_run_dir` (`--fresh`) deletes only a real directory holding `RUN_MARKER`, never the working
  directory, home or `/` or a parent of them (`protected_reason`), and stops the private stack recorded
  in it first (`infra.stack.stop_stack`), e.g. one left running by a killed run (`RunDirRefused`
  otherwise).

The guards are `check_deletable` and `mark_new_dir`, shared with `leeway sft --fresh` (`sft.output_dir`,
its own marker): whatever a Leeway command deletes whole, it created.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson

from infra.process import is_running
from infra.stack import load_state, stop_stack
from pipeline.config import LeewayConfig

RUN_MARKER = ".leeway-run"
"""Written into every run directory `leeway run` creates; `--fresh` deletes only a directory holding it."""
STACK_STOP_TIMEOUT_S = 3.0
"""SIGTERM grace of a private stack: SeaweedFS can ignore SIGTERM for ~20 s; a SIGKILL loses nothing written."""


class RunDirInUse(RuntimeError):
    """run.dir holds an earlier run; `--fresh` deletes it."""


class NothingToResume(RunDirInUse):
    """`--resume` found no earlier run in run.dir."""


class RunDirRefused(RunDirInUse):
    """`--fresh` will not delete run.dir: it is not a run directory Leeway created, or it is a protected one."""


def prepare_run_dir(cfg: LeewayConfig, fresh: bool, *, resume: bool = False, discard_checkpoints: bool = False) -> Path:
    """The run directory: emptied first with `fresh`, kept as it is with `resume`; an earlier run is never
    silently mixed in, nor its trained steps silently deleted.

    A directory created here (or found empty) gets `RUN_MARKER`. Raises `RunDirInUse` when it holds an
    earlier run and neither flag is set, or `fresh` would delete trained steps without `discard_checkpoints`;
    `NothingToResume` when `resume` finds no earlier run; `RunDirRefused` when `fresh` may not delete it.
    """
    if fresh and resume:
        raise RunDirInUse("--fresh and --resume exclude each other")
    run_dir = cfg.run.run_dir
    steps = trained_steps(run_dir)
    if resume:
        if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "stack").is_dir():
            raise NothingToResume(
                f"--resume: {run_dir} holds no earlier run (no metrics.jsonl, no private stack); start one with "
                f"`leeway run CONFIG`"
            )
        state = load_state(run_dir / "stack")
        running = [p for p in state.processes if is_running(p)] if state is not None else []
        if running:  # its servers die with the `leeway run` that started them: that run is alive
            raise RunDirInUse(
                f"--resume: a `leeway run` is using {run_dir} (its private stack runs: "
                f"{', '.join(f'{p.name} pid {p.pid}' for p in running)}); stop it first"
            )
        return run_dir
    if fresh and steps and not discard_checkpoints:
        raise RunDirInUse(
            f"{run_dir} holds a run with {steps} trained steps, its checkpoints and weights in its stack; "
            f"continue it with --resume, or delete it all with --fresh --discard-checkpoints"
        )
    if fresh and (run_dir.exists() or run_dir.is_symlink()):
        delete_run_dir(run_dir)
    elif (run_dir / "metrics.jsonl").exists():
        raise RunDirInUse(
            f"{run_dir} holds an earlier run (metrics.jsonl); continue it with --resume, delete it with --fresh "
            f"(--fresh --discard-checkpoints once it trained steps), or choose another directory with "
            f"--set run.dir=... (and a new run.name if the servers are shared)"
        )
    return mark_new_dir(run_dir, RUN_MARKER, "leeway run")


def mark_new_dir(directory: Path, marker: str, command: str) -> Path:
    """Create `directory` (parents too); one created here or found empty gets `marker`, the proof
    `check_deletable` asks for before `command --fresh` deletes it. A directory already holding other files
    gets none: it is not the command's to delete."""
    new = not directory.exists() or (directory.is_dir() and not any(directory.iterdir()))
    directory.mkdir(parents=True, exist_ok=True)
    if new:
        (directory / marker).write_text(f"created by `{command}`; `{command} --fresh` may delete this directory\n")
    return directory


def trained_steps(run_dir: Path) -> int:
    """The newest step in `run_dir/metrics.jsonl` (0 when there is none): what `--fresh` would delete."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    for line in reversed(path.read_bytes().splitlines()):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line torn by a kill
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return int(record["step"])
    return 0


def protected_reason(path: Path) -> str | None:
    """Why `path` must never be deleted whole (the working directory, home, `/`, or a parent of them), or None."""
    resolved = path.resolve()
    if resolved == Path(resolved.anchor):
        return "the filesystem root"
    for what, guarded in (("the working directory", Path.cwd()), ("the home directory", Path.home())):
        guarded = guarded.resolve()
        if resolved == guarded:
            return f"{what} ({guarded})"
        if resolved in guarded.parents:
            return f"a parent of {what} ({guarded})"
    return None


def check_deletable(directory: Path, *, marker: str, command: str, setting: str) -> bool:
    """The guards of `command --fresh` before it deletes `directory` whole: True when it may, False for an
    empty directory without `marker` (nothing to delete).

    Raises `RunDirRefused` naming `setting` for a protected directory (`protected_reason`: a link to one
    included), a link or a file, and a directory holding files but not `marker` (not one `command` created:
    `mark_new_dir`)."""
    reason = protected_reason(directory)
    if reason is not None:
        raise RunDirRefused(
            f"--fresh refuses to delete {directory}: it is {reason}; set {setting} to a directory of its own"
        )
    if directory.is_symlink() or not directory.is_dir():
        raise RunDirRefused(
            f"--fresh refuses to delete {directory}: not a directory (a link or a file); set {setting} to the "
            "real directory"
        )
    if not (directory / marker).is_file():
        if not any(directory.iterdir()):
            return False
        raise RunDirRefused(
            f"--fresh deletes only a directory `{command}` created (it holds {marker}); {directory} has none: "
            f"delete it yourself, or choose another directory with --set {setting}=..."
        )
    return True


def delete_run_dir(run_dir: Path) -> None:
    """`--fresh`: stop the private stack recorded in `run_dir`, then delete the directory.

    Only a real directory holding `RUN_MARKER` is deleted, and never a protected one (`check_deletable`);
    an empty directory without the marker is kept (there is nothing to delete). Raises `RunDirRefused`.
    """
    if not check_deletable(run_dir, marker=RUN_MARKER, command="leeway run", setting="run.dir"):
        return
    stop_stack(run_dir / "stack", timeout_s=STACK_STOP_TIMEOUT_S)  # e.g. left running by a killed run
    shutil.rmtree(run_dir)
