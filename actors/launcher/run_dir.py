"""The run directory of `leeway run`: created with a marker, and deleted by `--fresh` only when that is safe.

A run directory collects one run's metrics, report, config copy, logs and private stack. Two runs
must never mix in one, and `--fresh` must never delete what `leeway run` did not create:

- `prepare_run_dir` refuses a directory holding an earlier run's `metrics.jsonl` (`RunDirInUse`)
  unless `fresh` is set, and writes `RUN_MARKER` into a directory it creates (or finds empty);
- `delete_run_dir` (`--fresh`) deletes only a real directory holding `RUN_MARKER`, never the working
  directory, home or `/` or a parent of them (`protected_reason`), and stops the private stack recorded
  in it first (`infra.stack.stop_stack`), e.g. one left running by a killed run (`RunDirRefused`
  otherwise).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from infra.stack import stop_stack
from pipeline.config import LeewayConfig

RUN_MARKER = ".leeway-run"
"""Written into every run directory `leeway run` creates; `--fresh` deletes only a directory holding it."""
STACK_STOP_TIMEOUT_S = 3.0
"""SIGTERM grace of a private stack: SeaweedFS can ignore SIGTERM for ~20 s; a SIGKILL loses nothing written."""


class RunDirInUse(RuntimeError):
    """run.dir holds an earlier run; `--fresh` deletes it."""


class RunDirRefused(RunDirInUse):
    """`--fresh` will not delete run.dir: it is not a run directory Leeway created, or it is a protected one."""


def prepare_run_dir(cfg: LeewayConfig, fresh: bool) -> Path:
    """The run directory, emptied first with `fresh`; an earlier run is never silently mixed in.

    A directory created here (or found empty) gets `RUN_MARKER`. Raises `RunDirInUse` when it holds an
    earlier run and `fresh` is false, `RunDirRefused` when `fresh` may not delete it.
    """
    run_dir = cfg.run.run_dir
    if fresh and (run_dir.exists() or run_dir.is_symlink()):
        delete_run_dir(run_dir)
    elif (run_dir / "metrics.jsonl").exists():
        raise RunDirInUse(
            f"{run_dir} holds an earlier run (metrics.jsonl); pass --fresh to delete it, or choose "
            f"another directory with --set run.dir=... (and a new run.name if the servers are shared)"
        )
    new = not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir()))
    run_dir.mkdir(parents=True, exist_ok=True)
    if new:
        (run_dir / RUN_MARKER).write_text("created by `leeway run`; `leeway run --fresh` may delete this directory\n")
    return run_dir


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


def delete_run_dir(run_dir: Path) -> None:
    """`--fresh`: stop the private stack recorded in `run_dir`, then delete the directory.

    Only a real directory holding `RUN_MARKER` is deleted, and never a protected one (`protected_reason`);
    an empty directory without the marker is kept (there is nothing to delete). Raises `RunDirRefused`.
    """
    reason = protected_reason(run_dir)
    if reason is not None:
        raise RunDirRefused(
            f"--fresh refuses to delete {run_dir}: it is {reason}; set run.dir to a directory of its own"
        )
    if run_dir.is_symlink() or not run_dir.is_dir():
        raise RunDirRefused(f"--fresh refuses to delete {run_dir}: not a directory (a link or a file)")
    if not (run_dir / RUN_MARKER).is_file():
        if not any(run_dir.iterdir()):
            return
        raise RunDirRefused(
            f"--fresh deletes only a run directory `leeway run` created (it holds {RUN_MARKER}); {run_dir} "
            f"has none: delete it yourself, or choose another directory with --set run.dir=..."
        )
    stop_stack(run_dir / "stack", timeout_s=STACK_STOP_TIMEOUT_S)  # e.g. left running by a killed run
    shutil.rmtree(run_dir)
