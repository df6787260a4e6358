"""The `leeway` command: one entry point, one subcommand per role or tool, each defined beside its `main`.

`COMMANDS` is the table: a command's name and one-line help, and what defines its parser (its description, flags
and handler): a function here, or the module whose `add_arguments(parser)` does it. A module is imported only
when its command is named, so `leeway --help` imports none and `leeway <cmd> --help` only that command's module,
and none imports torch at module level (`leeway bench <name> --help` imports that benchmark's module, which may;
`leeway sft`'s parser is `actors/sft/command.py`, apart from its torch-importing runtime).
The stack, config, trainer and generator commands are defined here (their handlers are); the flags every command
shares are `actors/cli_args.py`.

A role started by `leeway run` carries its launcher's pid in `LEEWAY_PARENT_PID`; `main` then watches
that pid before dispatching (`infra.orphans.watch_parent`), so the role stops when the launcher dies,
even by SIGKILL.

Exit codes: 2 for a config error (the message names file, key and value; no traceback), as argparse
does for bad arguments; 130 when interrupted; otherwise what the command returns (`stack status`: 1
when a server is unhealthy; `trainer` and `run`: 2 when the trainer stops the run on purpose, a task failing its
self-check or no trainable group for `trainer.queue_wait_timeout_s`, its reason the last line and no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.cli_args import WithConfig, add_config_arguments, load_cli_config

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig

Define = Callable[[argparse.ArgumentParser], None]
"""Adds a command's flags and handler (`parser.set_defaults(handler=...)`) to its parser, and its description
where that says more than its help line."""


@dataclass(frozen=True)
class Command:
    """A row of a command table: what the list in `--help` shows, and what defines the command's parser."""

    name: str
    help: str
    define: str | Define
    """A function, or the module whose `add_arguments` it is (imported only when the command is named)."""

    def define_on(self, parser: argparse.ArgumentParser) -> None:
        define = importlib.import_module(self.define).add_arguments if isinstance(self.define, str) else self.define
        define(parser)


@dataclass(frozen=True)
class Benchmark:
    """`leeway bench NAME`: the module `actors.tools.bench.NAME` adds its own flags (`add_arguments`) and measures
    (`run(args)`, a dict printed as JSON)."""

    name: str
    help: str

    @property
    def module(self) -> str:
        return f"actors.tools.bench.{self.name}"

    def define_on(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="one JSON line (default: indented JSON)")
        parser.set_defaults(handler=self.run)
        importlib.import_module(self.module).add_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        result = importlib.import_module(self.module).run(args)
        print(json.dumps(result, indent=None if args.json else 2, default=float))
        return 0


@dataclass(frozen=True)
class Group:
    """A command whose actions are a table of their own (`leeway config show`, `leeway bench NAME`)."""

    name: str
    help: str
    metavar: str
    commands: tuple[Command | Benchmark, ...]


# ---------------------------------------------------------------------------------------------- stack


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The embedded servers, bound to 127.0.0.1 on free ports. Data lives in "
        "--dir and survives down/up. Endpoints go to <dir>/stack.json, which the other commands read."
    )
    parser.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up: start and wait until both answer; "
        "down: stop exactly the processes up started; status: health and endpoints (exit 1 if unhealthy)",
    )
    parser.add_argument(
        "--dir", default=None, help="stack directory (default: the config's nats.stack_dir, .leeway/stack)"
    )
    parser.add_argument(
        "--fsync",
        default="2m",
        help="JetStream sync_interval: a duration such as 2m (default, "
        "fast) or 'always' (fsync every write: the production setting)",
    )
    parser.add_argument("--bucket", default="leeway", help="S3 bucket to create (default: leeway)")
    add_config_arguments(parser, required=False)
    parser.set_defaults(handler=cmd_stack)


def _stack_dir(args: argparse.Namespace) -> str:
    if args.dir:
        return args.dir
    if args.config or args.overrides:
        return load_cli_config(args).nats.stack_dir
    from infra.stack import DEFAULT_STACK_DIR

    return str(DEFAULT_STACK_DIR)


def cmd_stack(args: argparse.Namespace) -> int:
    from infra import stack

    directory = Path(_stack_dir(args))
    if args.action == "up":
        state = stack.start_stack(directory, fsync=args.fsync, bucket=args.bucket)
        print(f"stack up in {directory}")
        print(f"  nats: {state.nats_endpoint} (token in {directory}/credentials.json)")
        print(f"  s3:   {state.s3_endpoint} (bucket {state.bucket})")
        print(f"stop it with: leeway stack down --dir {directory}")
        return 0
    if args.action == "down":
        stack.stop_stack(directory)
        print(f"stack in {directory} stopped")
        return 0
    status = stack.stack_status(directory)
    print(json.dumps(status, indent=2, default=str))
    return 0 if all(status.get(name, {}).get("healthy") for name in (stack.NATS, stack.SEAWEED)) else 1


# --------------------------------------------------------------------------------------------- config


def add_show_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.set_defaults(handler=cmd_config_show)


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    print(cfg.to_yaml(), end="")
    return 0


def add_reference_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(handler=cmd_config_reference)


def cmd_config_reference(args: argparse.Namespace) -> int:
    from pipeline.config_reference import config_reference

    print(config_reference(), end="")
    return 0


# ---------------------------------------------------------------------------------------------- roles


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    from actors.tools.replay import add_selection_arguments

    parser.description = (
        "Consumes trajectory groups, applies the staleness cap and importance "
        "correction, steps, publishes version V+1, then acks the groups it used. Replay: "
        "train on a recorded range instead of live data; recorded behaviour log-probs and "
        "versions drive the correction, staleness is counted against the newest version "
        "seen so far in the replayed range (switch the cap off with --set staleness.cap_in_replay=false)."
    )
    add_config_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--replay", action="store_true", help="train on a recorded range (needs a selection)")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many FSDP2 data-parallel ranks on this machine (default: trainer.nproc); a process "
        "started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (torchrun, a fleet) joins that group instead",
    )
    add_selection_arguments(parser, required=False)
    parser.set_defaults(handler=cmd_trainer)


def cmd_trainer(args: argparse.Namespace) -> int:
    if args.replay and args.resume:
        raise SystemExit("leeway trainer: --resume and --replay exclude each other")
    if args.replay and args.from_seq is None and args.since is None and args.min_version is None:
        raise SystemExit("leeway trainer: --replay needs --from-seq N, --since TIME or --min-version V")
    cfg = load_cli_config(args)
    nproc = args.nproc if args.nproc is not None else cfg.trainer.nproc
    if nproc < 1:
        raise SystemExit(f"leeway trainer: --nproc {nproc} must be >= 1")
    if nproc > 1 and "WORLD_SIZE" not in os.environ:  # ranks see WORLD_SIZE and run the trainer itself
        from actors.trainer.distributed import launch_ranks

        return launch_ranks([sys.executable, "-m", "actors.cli", *args.argv], nproc, grace_s=cfg.stop_grace_s)
    from actors.tools.replay import selection_from_args
    from actors.trainer.runtime import main as trainer_main

    replay = selection_from_args(args) if args.replay else None
    return trainer_main(cfg, resume=args.resume, replay=replay)


def add_generator_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Takes prompts from the prompt queue, runs rollouts, publishes groups; "
        "pulls new weight versions on its own schedule. Can start before the trainer. Serves an "
        "OpenAI-compatible endpoint (generator.serve.*: 127.0.0.1 and a free port by default; the address is "
        "logged) for agent harnesses: /v1/chat/completions, /v1/completions, /v1/models, /health, "
        "/inference/v1/generate, each also under /sessions/<id>."
    )
    add_config_arguments(parser)
    parser.set_defaults(handler=WithConfig(_generator_main))


def _generator_main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    from actors.generator.runtime import main as generator_main

    return generator_main(cfg)


# ---------------------------------------------------------------------------------------------- table

BENCHES = (
    Benchmark("weights", "weight deltas: size vs entropy bound and baselines, codec speed, publish-to-applied"),
    Benchmark("transport", "Arrow vs orjson codec and JetStream throughput on loopback"),
    Benchmark("e2e", "the demo task synchronous vs asynchronous: time to target reward"),
    Benchmark("engine", "the Leeway engine vs HF generate (dynamic cache; static cache on CUDA): tokens/s, TTFT"),
    Benchmark(
        "trainer", "the training backend vs a plain HF loop on the same batch: tokens/s, MFU (CPU: tiny defaults)"
    ),
    Benchmark(
        "moe", "routing replay on vs off on one recorded MoE batch: train/sampler mismatch, agreement, route bytes"
    ),
    Benchmark("agents", "multi-turn episodes through the endpoint vs driven directly on the engine: turns/s, latency"),
    Benchmark("sandbox", "bubblewrap sandboxes vs local and plain subprocesses: start, exec round trip, pool waves"),
    Benchmark(
        "learning", "the reasoning recipe from scratch, SFT then async and sync RL: held-out pass@1, time to accuracy"
    ),
)

COMMANDS: tuple[Command | Group, ...] = (
    Command("stack", "start, stop or inspect the embedded nats-server + SeaweedFS S3", add_stack_arguments),
    Group(
        "config",
        "show a resolved config or the config reference",
        "ACTION",
        (
            Command("show", "print the config with defaults, env and --set overrides applied", add_show_arguments),
            Command("reference", "print every key with its default and meaning (markdown)", add_reference_arguments),
        ),
    ),
    Command("run", "the whole pipeline on one machine: stack, trainer and N generators", "actors.launcher.run"),
    Command("trainer", "run one trainer until trainer.max_steps (or Ctrl-C)", add_trainer_arguments),
    Command(
        "sft",
        "supervised fine-tuning into a checkpoint directory that model.name_or_path then loads for RL",
        "actors.sft.command",
    ),
    Command("generator", "run one generator until interrupted", add_generator_arguments),
    Command("replay", "export a recorded range of trajectories to Parquet", "actors.tools.replay"),
    Command(
        "purge",
        "delete one run's streams, KV buckets and objects from shared servers (needs --yes)",
        "actors.tools.purge",
    ),
    Command(
        "eval",
        "evaluate one published policy version on the task's held-out prompts; prints JSON",
        "actors.tools.evaluate",
    ),
    Command(
        "export",
        "write one published policy version as a Hugging Face checkpoint directory (transformers, vLLM, SGLang)",
        "actors.tools.export",
    ),
    Command(
        "fleet",
        "place a run's trainer and generators on a Ray cluster; scale, inspect and stop them",
        "actors.fleet.commands",
    ),
    Group(
        "tasks",
        "check a task set before training on it",
        "ACTION",
        (
            Command(
                "check",
                "run every Harbor task's oracle (must score 1), a do-nothing agent and known reward hacks (must score "
                "less) in sandboxes",
                "actors.tools.tasks_check",
            ),
        ),
    ),
    Group("bench", "benchmarks that print JSON with ratios against same-run baselines", "BENCH", BENCHES),
)
"""Every `leeway` command, in the order `leeway --help` lists them."""


def add_commands(
    subparsers: argparse._SubParsersAction, table: Sequence[Command | Benchmark | Group], argv: Sequence[str] | None
) -> None:
    """A parser per row of `table`, whose description is the row's help until its definition says more. With `argv`
    (the words from this level on), only the row it names is defined, so only its module is imported; without,
    every row is (and every module imported: torch too, for the benches)."""
    for row in table:
        parser = subparsers.add_parser(row.name, help=row.help, description=row.help)
        if argv is not None and list(argv[:1]) != [row.name]:
            continue
        rest = None if argv is None else argv[1:]
        if isinstance(row, Group):
            actions = parser.add_subparsers(dest=f"{row.name}_command", required=True, metavar=row.metavar)
            add_commands(actions, row.commands, rest)
        else:
            row.define_on(parser)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `leeway` parser for the command line `argv` (only the command it names gets its flags), or, without
    `argv`, with every command's flags."""
    parser = argparse.ArgumentParser(
        prog="leeway",
        description="Leeway: fully asynchronous RL post-training. Generators pull weight deltas from S3 on their "
        "own schedule and stream trajectories over NATS JetStream to a staleness-bounded trainer.",
    )
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), COMMANDS, argv)
    return parser


def _watch_launcher() -> None:
    """Stop this process when the `leeway run` that started it dies (`LEEWAY_PARENT_PID`, see the module doc).

    The variable is removed from the environment, so nothing this process starts inherits a pid that is
    not its parent.
    """
    from infra.orphans import ORPHAN_GRACE_S, PARENT_GRACE_ENV, PARENT_PID_ENV, watch_parent

    value = os.environ.pop(PARENT_PID_ENV, None)
    grace = os.environ.pop(PARENT_GRACE_ENV, None)
    if value is None:
        return
    try:
        parent_pid = int(value)
    except ValueError:
        raise SystemExit(f"leeway: {PARENT_PID_ENV}={value!r} is not a process id") from None
    try:
        grace_s = ORPHAN_GRACE_S if grace is None else float(grace)
    except ValueError:
        raise SystemExit(f"leeway: {PARENT_GRACE_ENV}={grace!r} is not a number of seconds") from None
    watch_parent(parent_pid, grace_s=grace_s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    args.argv = list(argv)  # `leeway trainer --nproc N` starts N copies of its own command line
    _watch_launcher()
    from pipeline.config import ConfigError

    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"leeway: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leeway: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
