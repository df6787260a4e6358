"""The `leeway` command: one entry point, one subcommand per role or tool.

Only argparse, the standard library and `actors/tools/bench/args.py` (argparse helpers, the `--set`
flag) are imported at module level, so `leeway --help` and every `leeway <cmd> --help` answer at once
without torch; each handler imports its role after parsing. (`leeway bench <name> --help` imports that
benchmark's module, which defines its own flags.)

A role started by `leeway run` carries its launcher's pid in `LEEWAY_PARENT_PID`; `main` then watches
that pid before dispatching (`infra.process.watch_parent`), so the role stops when the launcher dies,
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.tools.bench.args import add_set_argument

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig

Handler = Callable[[argparse.Namespace], int]

CONFIG_HELP = "YAML config file (see configs/ and the README's config reference)"


def _add_config_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The config file and `--set`, as every command that reads a config takes them."""
    if required:
        parser.add_argument("config", help=CONFIG_HELP)
    else:
        parser.add_argument("config", nargs="?", default=None, help=CONFIG_HELP + " (default: built-in defaults)")
    add_set_argument(parser)


def load_cli_config(args: argparse.Namespace) -> LeewayConfig:
    """Load the config named on the command line; errors are printed by `main` without a traceback."""
    from pipeline.config import load_config

    return load_config(getattr(args, "config", None), getattr(args, "overrides", []))


# ---------------------------------------------------------------------------------------------- stack


def _stack_dir(args: argparse.Namespace) -> str:
    if args.dir:
        return args.dir
    if getattr(args, "config", None) or getattr(args, "overrides", None):
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


def cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    print(cfg.to_yaml(), end="")
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from pipeline.config_reference import config_reference

    print(config_reference(), end="")
    return 0


# ------------------------------------------------------------------------------------------ roles


@dataclass(frozen=True)
class ConfigCommand:
    """A handler that loads the config, then imports `module` and returns what its `main` returns.

    The config is loaded before the import, so a bad config fails at once, without loading torch.
    """

    module: str
    with_args: bool = True
    """`main(cfg, args)`; False: `main(cfg)`, for a command without flags of its own."""

    def __call__(self, args: argparse.Namespace) -> int:
        cfg = load_cli_config(args)
        main = importlib.import_module(self.module).main
        return main(cfg, args) if self.with_args else main(cfg)


CONFIG_COMMANDS: dict[str, ConfigCommand] = {
    "run": ConfigCommand("actors.launcher.run"),
    "generator": ConfigCommand("actors.generator.runtime", with_args=False),
    "replay": ConfigCommand("actors.tools.replay"),
    "purge": ConfigCommand("actors.tools.purge"),
    "eval": ConfigCommand("actors.tools.evaluate"),
    "sft": ConfigCommand("actors.sft.runtime"),
    "fleet": ConfigCommand("actors.fleet.commands"),
    "tasks": ConfigCommand("actors.tools.tasks_check"),
}
"""The commands whose handler is only that; `leeway trainer` checks its flags first and may launch ranks."""


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


def cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"actors.tools.bench.{args.bench}")
    result = module.run(args)
    print(json.dumps(result, indent=None if args.json else 2, default=float))
    return 0


def build_parser(*, bench_name: str | None = None) -> argparse.ArgumentParser:
    """`bench_name`: the benchmark being run, whose module is imported to add its own flags."""
    from actors.tools.replay import add_arguments as add_replay_arguments
    from actors.tools.replay import add_selection_arguments

    parser = argparse.ArgumentParser(
        prog="leeway",
        description="Leeway: fully asynchronous RL post-training. Generators pull weight deltas from S3 on their "
        "own schedule and stream trajectories over NATS JetStream to a staleness-bounded trainer.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    stack = sub.add_parser(
        "stack",
        help="start, stop or inspect the embedded nats-server + SeaweedFS S3",
        description="The embedded servers, bound to 127.0.0.1 on free ports. Data lives in "
        "--dir and survives down/up. Endpoints go to <dir>/stack.json, which the other commands read.",
    )
    stack.add_argument(
        "action",
        choices=["up", "down", "status"],
        help="up: start and wait until both answer; "
        "down: stop exactly the processes up started; status: health and endpoints (exit 1 if unhealthy)",
    )
    stack.add_argument(
        "--dir", default=None, help="stack directory (default: the config's nats.stack_dir, .leeway/stack)"
    )
    stack.add_argument(
        "--fsync",
        default="2m",
        help="JetStream sync_interval: a duration such as 2m (default, "
        "fast) or 'always' (fsync every write: the production setting)",
    )
    stack.add_argument("--bucket", default="leeway", help="S3 bucket to create (default: leeway)")
    _add_config_args(stack, required=False)
    stack.set_defaults(handler=cmd_stack)

    config = sub.add_parser("config", help="show a resolved config or the config reference")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="print the config with defaults, env and --set overrides applied")
    _add_config_args(show)
    show.set_defaults(handler=cmd_config_show)
    reference = config_sub.add_parser("reference", help="print every key with its default and meaning (markdown)")
    reference.set_defaults(handler=cmd_config_reference)

    run = sub.add_parser(
        "run",
        help="the whole pipeline on one machine: stack, trainer and N generators",
        description="Starts the embedded stack unless the config names servers, then the trainer "
        "and N generator processes; shows a live view; writes a report into run.dir at the end.",
    )
    _add_config_args(run)
    run.add_argument("--generators", type=int, default=None, help="generator processes (default: 1 on 2 cores)")
    run.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")
    run.add_argument(
        "--fresh",
        action="store_true",
        help="delete an earlier run's directory (run.dir) first, after stopping its private stack; only a "
        "directory `leeway run` created (it holds .leeway-run), never the working directory, home or /; "
        "a run that trained steps also needs --discard-checkpoints (its stack holds its checkpoints)",
    )
    run.add_argument(
        "--discard-checkpoints",
        action="store_true",
        help="with --fresh: delete an earlier run even though it trained steps (its checkpoints and weights go too)",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.dir: its private stack starts again on the same data, the trainer from its "
        "newest checkpoint (raise trainer.max_steps with --set to train past a finished run)",
    )
    run.set_defaults(handler=CONFIG_COMMANDS["run"])

    trainer = sub.add_parser(
        "trainer",
        help="run one trainer until trainer.max_steps (or Ctrl-C)",
        description="Consumes trajectory groups, applies the staleness cap and importance "
        "correction, steps, publishes version V+1, then acks the groups it used. Replay: "
        "train on a recorded range instead of live data; recorded behaviour log-probs and "
        "versions drive the correction, staleness is counted against the newest version "
        "seen so far in the replayed range (switch the cap off with --set staleness.cap_in_replay=false).",
    )
    _add_config_args(trainer)
    trainer.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    trainer.add_argument("--replay", action="store_true", help="train on a recorded range (needs a selection)")
    trainer.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="start this many FSDP2 data-parallel ranks on this machine (default: trainer.nproc); a process "
        "started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (torchrun, a fleet) joins that group instead",
    )
    add_selection_arguments(trainer, required=False)
    trainer.set_defaults(handler=cmd_trainer)

    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning into a checkpoint directory that model.name_or_path then loads for RL",
        description="Trains sft.base_model (default model.name_or_path) on sft.data (JSONL/Parquet rows of "
        "'messages', or 'prompt' and 'completion') or, with sft.from_task, on the task's reference answers; the loss "
        "is on the assistant's tokens only, rendered with the run's tokenizer and chat template as a generator "
        "renders them. Uses the trainer's backend (trainer.backend, packing, --nproc FSDP2 ranks), a learning rate "
        "with warm-up and decay (sft.*), gradient clipping, a progress bar with loss and tokens/s, resumable state "
        "every sft.checkpoint_every steps. Writes a Hugging Face checkpoint (safetensors, config, tokenizer, chat "
        "template) into sft.output_dir (default runs/<run.name>-sft), then evaluates it on the task's eval split "
        "(eval.json) and prints a JSON summary.",
    )
    _add_config_args(sft)
    sft.add_argument("--resume", action="store_true", help="continue from the newest saved state in sft.output_dir")
    sft.add_argument("--fresh", action="store_true", help="delete sft.output_dir first (an earlier result or state)")
    sft.add_argument("--nproc", type=int, default=None, help="FSDP2 data-parallel ranks (default: trainer.nproc)")
    sft.add_argument("--no-eval", action="store_true", help="skip the evaluation at the end")
    sft.set_defaults(handler=CONFIG_COMMANDS["sft"])

    generator = sub.add_parser(
        "generator",
        help="run one generator until interrupted",
        description="Takes prompts from the prompt queue, runs rollouts, publishes groups; "
        "pulls new weight versions on its own schedule. Can start before the trainer. Serves an "
        "OpenAI-compatible endpoint (generator.serve.*: 127.0.0.1 and a free port by default; the address is "
        "logged) for agent harnesses: /v1/chat/completions, /v1/completions, /v1/models, /health, "
        "/inference/v1/generate, each also under /sessions/<id>.",
    )
    _add_config_args(generator)
    generator.set_defaults(handler=CONFIG_COMMANDS["generator"])

    replay = sub.add_parser(
        "replay",
        help="export a recorded range of trajectories to Parquet",
        description="Select groups of the run's trajectory stream by sequence, time or policy "
        "version and export them. To train on them instead, use `leeway trainer --replay`.",
    )
    _add_config_args(replay)
    add_replay_arguments(replay)
    replay.set_defaults(handler=CONFIG_COMMANDS["replay"])

    purge = sub.add_parser(
        "purge",
        help="delete one run's streams, KV bucket and objects from shared servers (needs --yes)",
        description="Deletes what run.name left on the servers, so the name can be used again: the "
        "JetStream streams LEEWAY_<run>_TRAJ, _PROMPTS and _DLQ (with their consumers), the KV bucket "
        "leeway_<run>_versions, and every object under <run>/ in the store (weights, checkpoints, "
        "claim-checked groups). Other runs on the same servers are not touched; run.dir stays. "
        "Stop the run's trainer and generators first. Without --yes it only prints what it would "
        "delete and exits 1.",
    )
    _add_config_args(purge)
    purge.add_argument("--yes", action="store_true", help="really delete (without it: print the plan, exit 1)")
    purge.set_defaults(handler=CONFIG_COMMANDS["purge"])

    evaluate = sub.add_parser(
        "eval",
        help="evaluate one published policy version on the task's held-out prompts; prints JSON",
        description="Pulls exactly version V (default: LATEST) of the run's weights from the store, builds an engine "
        "as a generator does, samples eval.samples_per_prompt replies (fixed seeds) for each of the task's eval "
        "prompts (its eval split, never trained on), scores them with the task's verifier and prints mean reward, "
        "pass@1, pass@k and per-tag means as one JSON object. Needs the run's store (a running stack or store.*); "
        "nothing is trained on or published.",
    )
    _add_config_args(evaluate)
    evaluate.add_argument(
        "--version", type=int, default=None, help="the published version to evaluate (default: LATEST)"
    )
    evaluate.add_argument(
        "--samples", type=int, default=None, help="samples per prompt (default: eval.samples_per_prompt)"
    )
    evaluate.add_argument(
        "--prompts", type=int, default=None, help="the first N eval prompts (default: eval.prompts, or all)"
    )
    evaluate.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="evaluate a local checkpoint directory instead (a `leeway sft` result); needs no servers",
    )
    evaluate.add_argument(
        "--follow",
        action="store_true",
        help="evaluate version 0 and every eval.every_steps-th version as it is published, appending to "
        "<run.dir>/eval.jsonl, until version trainer.max_steps (what leeway run starts when eval.every_steps is set)",
    )
    evaluate.set_defaults(handler=CONFIG_COMMANDS["eval"])

    fleet = sub.add_parser(
        "fleet",
        help="place a run's trainer and generators on a Ray cluster; scale, inspect and stop them",
        description="Ray places and restarts the roles (each in its own process, as `leeway trainer` and "
        "`leeway generator`); data goes only through NATS and S3. Every node must reach nats.url and "
        "store.endpoint (a single-node cluster may use the embedded stack).",
    )
    fleet_sub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="ACTION")
    fleet_actions = {
        "up": "start the trainer ranks and generators; returns once every role started",
        "scale": "add or drain generators while the run goes on",
        "status": "each role: node, policy version, last report, restarts",
        "down": "stop every role of the run (and the local cluster and stack `up` started), nothing else",
    }
    for action, text in fleet_actions.items():
        fleet_parser = fleet_sub.add_parser(action, help=text, description=text)
        _add_config_args(fleet_parser)
        fleet_parser.add_argument(
            "--address", default=None, help="Ray cluster host:port (default: fleet.address, RAY_ADDRESS, or local)"
        )
        if action == "up":
            fleet_parser.add_argument("--generators", type=int, default=1, help="generators to start (default 1)")
            fleet_parser.add_argument("--trainer-ranks", type=int, default=1, help="trainer ranks (default 1)")
            fleet_parser.add_argument("--wait", action="store_true", help="block until the trainer ends")
        if action == "scale":
            fleet_parser.add_argument("--generators", type=int, required=True, help="generators to run from now on")
        if action == "status":
            fleet_parser.add_argument("--json", action="store_true", help="one JSON object")
        fleet_parser.set_defaults(handler=CONFIG_COMMANDS["fleet"])

    tasks = sub.add_parser("tasks", help="check a task set before training on it")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    check = tasks_sub.add_parser(
        "check",
        help="run every Harbor task's oracle (must score 1) and a do-nothing agent (must score less) in sandboxes",
        description="Every task directory under DIR (instruction.md, task.toml, tests/test.sh, solution/solve.sh) "
        "is attempted twice in its own sandbox, as an episode would be: once running solution/solve.sh, which "
        "must make the tests write reward 1, once doing nothing, which must score less. Sandbox settings come "
        "from CONFIG's sandbox section (or --set sandbox.*). One JSON line per task, then a summary; exit 1 when "
        "a task fails.",
    )
    check.add_argument("dir", help="a directory of Harbor task directories (e.g. configs/data/coding)")
    _add_config_args(check, required=False)
    check.add_argument("--concurrency", type=int, default=2, help="tasks checked at once (default 2)")
    check.set_defaults(handler=CONFIG_COMMANDS["tasks"])

    bench = sub.add_parser("bench", help="benchmarks that print JSON with ratios against same-run baselines")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, text in [
        ("weights", "weight deltas: size vs entropy bound and baselines, codec speed, publish-to-applied"),
        ("transport", "Arrow vs orjson codec and JetStream throughput on loopback"),
        ("e2e", "the demo task synchronous vs asynchronous: time to target reward"),
        ("engine", "the Leeway engine vs HF generate (dynamic cache; static cache on CUDA): tokens/s, TTFT"),
        ("trainer", "the training backend vs a plain HF loop on the same batch: tokens/s, MFU (CPU: tiny defaults)"),
        ("agents", "multi-turn episodes through the endpoint vs driven directly on the engine: turns/s, latency"),
        ("sandbox", "bubblewrap sandboxes vs local and plain subprocesses: start, exec round trip, pool waves"),
        (
            "learning",
            "the reasoning recipe from scratch, SFT then async and sync RL: held-out pass@1, time to accuracy",
        ),
    ]:
        bench_parser = bench_sub.add_parser(name, help=text, description=text)
        bench_parser.add_argument("--json", action="store_true", help="one JSON line (default: indented JSON)")
        bench_parser.set_defaults(handler=cmd_bench)
        if name == bench_name:
            importlib.import_module(f"actors.tools.bench.{name}").add_arguments(bench_parser)
    return parser


def _watch_launcher() -> None:
    """Stop this process when the `leeway run` that started it dies (`LEEWAY_PARENT_PID`, see the module doc).

    The variable is removed from the environment, so nothing this process starts inherits a pid that is
    not its parent.
    """
    from infra.process import ORPHAN_GRACE_S, PARENT_GRACE_ENV, PARENT_PID_ENV, watch_parent

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
    parser = build_parser(bench_name=argv[1] if len(argv) >= 2 and argv[0] == "bench" else None)
    args = parser.parse_args(argv)
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
