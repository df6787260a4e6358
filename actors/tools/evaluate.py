"""`leeway eval CONFIG [--version V]`: one published policy version, evaluated once on the task's held-out prompts.

    store: <run>/weights/v...  ──pull exactly V──►  engine (built as a generator builds it)
    task.eval_prompts() (first eval.prompts)  ──eval.samples_per_prompt each, fixed seeds──►  verifier  ──►  JSON

The weights are the store's own version V (`WeightSubscriber.pull`, bit-exact, hashes checked), so the result
belongs to that version and to nothing else; nothing is trained on and nothing is published. Seeds are fixed
per (prompt, sample), so evaluating the same version twice samples the same replies (a multi-turn task, whose
episodes run through the rollout with an environment each, is not seed-fixed that way). Evaluation is lenient
(`rollout.strict_*` off) unless ``eval.strict``. The prompts are the
task's eval split (`Task.eval_prompts`: reasoning-gym's held-out seed, the math task's ``eval_path``), which
`prompts()` never yields.

Keys: ``version``, ``prompts``, ``samples_per_prompt``, ``temperature``, ``mean_reward`` (over scored samples),
``pass@1`` (the mean, over prompts, of the fraction of samples that scored the task's maximum), ``pass@k``
with k = samples_per_prompt (prompts with at least one such sample), ``by_tag`` (mean reward per prompt
tag), ``statuses`` (samples per status), ``unrunnable`` (prompts no engine call could take, by reason) and
``seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from actors.cli_args import WithConfig, add_config_arguments
from actors.trainer.metrics_log import EVAL_LOG, ScalarSinks, eval_scalars
from pipeline.config import LeewayConfig

log = logging.getLogger(__name__)

EVAL_FILE = "eval.json"
"""What `leeway sft` writes into its checkpoint directory: `evaluate_checkpoint`'s result on the task's eval split."""
FOLLOW_POLL_S = 1.0
EVAL_SEED = 7_000_000_007
"""Base of the evaluation seeds: sample k of eval prompt i samples with seed ``EVAL_SEED + i * 1024 + k``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway eval`'s description, flags and handler."""
    parser.description = (
        "Pulls exactly version V (default: LATEST) of the run's weights from the store, builds an engine "
        "as a generator does, samples eval.samples_per_prompt replies (fixed seeds) for each of the task's eval "
        "prompts (its eval split, never trained on), scores them with the task's verifier and prints mean reward, "
        "pass@1, pass@k and per-tag means as one JSON object. Needs the run's store (a running stack or store.*); "
        "nothing is trained on or published."
    )
    add_config_arguments(parser)
    parser.add_argument("--version", type=int, default=None, help="the published version to evaluate (default: LATEST)")
    parser.add_argument(
        "--samples", type=int, default=None, help="samples per prompt (default: eval.samples_per_prompt)"
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help="the first N eval prompts (default: eval.prompts, or all)"
    )
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="evaluate a local checkpoint directory instead (a `leeway sft` result); needs no servers",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="evaluate version 0 and every eval.every_steps-th version as it is published, appending to "
        "<run.dir>/eval.jsonl, until version trainer.max_steps (what leeway run starts when eval.every_steps is set)",
    )
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    import torch

    from actors.generator.runtime import build_engine
    from actors.model_files import fetch_model_files, local_config, needs_model_files
    from actors.models import load_chat_template_for, load_tokenizer
    from actors.servers import ServerError, open_run_store, resolve_servers
    from pipeline.tasks import task_for
    from storage.manifest import ManifestError
    from storage.subscriber import WeightSubscriber
    from storage.weights_base import NoVersionError

    overrides: dict[str, Any] = {}
    if args.samples is not None:
        overrides["samples_per_prompt"] = args.samples
    if args.prompts is not None:
        overrides["prompts"] = args.prompts
    if overrides:
        try:
            settings = type(cfg.eval).model_validate({**cfg.eval.model_dump(), **overrides})
        except ValueError as exc:
            print(f"leeway eval: {exc}", flush=True)
            return 2
        cfg = cfg.model_copy(update={"eval": settings})
    torch.set_num_threads(cfg.engine.torch_threads)
    cfg = lenient(cfg)
    task = task_for(cfg)
    prompts = task.eval_prompts()
    if prompts is None:
        print(f"leeway eval: task {cfg.task.name!r} has no eval split (Task.eval_prompts)", flush=True)
        return 2
    if not prompts:
        print(f"leeway eval: the eval split of task {cfg.task.name!r} is empty (see its eval_* arguments)", flush=True)
        return 2
    if args.checkpoint is not None:
        try:
            result = evaluate_checkpoint(cfg, Path(args.checkpoint), task=task, prompts=prompts)
        except ValueError as exc:
            print(f"leeway eval: {exc}", flush=True)
            return 2
        print(json.dumps(result), flush=True)
        return 0
    try:
        store = open_run_store(cfg, resolve_servers(cfg, nats=False))
    except ServerError as exc:
        print(f"leeway eval: {exc}", flush=True)
        return 2
    config_dir: Path | None = None
    try:
        if needs_model_files(cfg):  # the checkpoint is not on this machine: the run's files are (as for a generator)
            config_dir = fetch_model_files(
                store, cfg, Path(tempfile.mkdtemp(prefix="leeway-eval-model-")), wait_s=cfg.generator.model_files_wait_s
            )
            cfg = local_config(cfg, config_dir)
        tokenizer = load_tokenizer(cfg, task)
        template = load_chat_template_for(cfg, tokenizer, task)
        subscriber = WeightSubscriber(store, cfg.run.name, parallelism=cfg.weights.parallelism)
        engine = build_engine(cfg, tokenizer, "eval", config_dir)
        if args.follow:
            return follow(cfg, engine, subscriber, tokenizer, template, task, prompts)
        try:
            version = subscriber.pull(args.version)
        except (NoVersionError, ManifestError) as exc:  # nothing published yet, or V never was (or was pruned)
            print(f"leeway eval: {exc}", flush=True)
            return 2
        engine.load_state(subscriber.tensors, version)
        result = asyncio.run(evaluate(cfg, engine, tokenizer, template, task, prompts, version=version))
    finally:
        store.close()
        if config_dir is not None:
            shutil.rmtree(config_dir, ignore_errors=True)
    print(json.dumps(result), flush=True)
    return 0


def evaluate_checkpoint(
    cfg: LeewayConfig, directory: Path, *, task: Any | None = None, prompts: list[Any] | None = None
) -> dict[str, Any]:
    """A local checkpoint directory (an SFT result) evaluated as `evaluate` evaluates a published version: the engine
    built from it as a generator builds the run's model, its weights as they are (``version`` 0). Needs no servers."""
    from actors.generator.runtime import build_engine
    from actors.models import load_chat_template_for, load_tokenizer
    from pipeline.tasks import task_for

    if not (directory / "config.json").is_file():
        raise ValueError(f"--checkpoint {directory}: no config.json there (not a checkpoint directory)")
    cfg = lenient(cfg)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(directory)})})
    task = task_for(cfg) if task is None else task
    prompts = task.eval_prompts() if prompts is None else prompts
    if not prompts:
        raise ValueError(f"task {cfg.task.name!r} has no eval prompts (Task.eval_prompts)")
    tokenizer = load_tokenizer(cfg, task)
    template = load_chat_template_for(cfg, tokenizer, task)
    engine = build_engine(cfg, tokenizer, "eval")
    result = asyncio.run(evaluate(cfg, engine, tokenizer, template, task, prompts, version=0))
    exported = exported_from(directory)
    return {"checkpoint": str(directory), **({"exported": exported} if exported else {}), **result}


def exported_from(directory: Path) -> dict[str, Any] | None:
    """Which run, version and step a `leeway export` directory holds (its ``leeway.json``); None for another one."""
    try:
        info = json.loads((directory / "leeway.json").read_text())
    except (OSError, ValueError):
        return None
    return {k: info.get(k) for k in ("run", "version", "step")} if isinstance(info, dict) else None


def follow(
    cfg: LeewayConfig, engine: Any, subscriber: Any, tokenizer: Any, template: Any, task: Any, prompts: list[Any]
) -> int:
    """`leeway eval --follow` (what `leeway run` starts when ``eval.every_steps`` is set): evaluate version 0 and every
    ``eval.every_steps``-th version as the trainer publishes it, each pulled exactly, and append each result to
    ``<run.dir>/eval.jsonl`` (and stdout), its ``eval/*`` scalars to TensorBoard (``<run.dir>/tb/eval``) and W&B at
    step = version when the config asks for them. Versions already in that file are not evaluated again (a resumed run);
    one pruned from the store before its turn is recorded as skipped. Ends after version ``trainer.max_steps``, or
    on SIGTERM/SIGINT once the versions due up to LATEST are done."""
    from storage.manifest import ManifestError
    from storage.weights_base import WeightPullError

    if cfg.eval.every_steps < 1:
        print("leeway eval --follow: set eval.every_steps (>= 1)", flush=True)
        return 2
    path = cfg.run.run_dir / EVAL_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    done = {r.get("version") for r in _records(path)}
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sinks = ScalarSinks(cfg, cfg.run.run_dir / "tb" / "eval", job_type="eval")
    try:
        every = cfg.eval.every_steps
        next_due = 0
        waiting_said = False
        while True:
            stopping = stop.is_set()
            latest = subscriber.latest_version()
            if latest is None:
                if stopping:
                    return 0
                if not waiting_said:
                    log.info("leeway eval: waiting for version 0 of run %r", cfg.run.name)
                    waiting_said = True
                stop.wait(FOLLOW_POLL_S)
                continue
            for version in range(next_due, latest + 1, every):
                if version in done:
                    continue
                try:
                    subscriber.pull(version)
                except (ManifestError, WeightPullError) as exc:  # pruned by retention before its turn
                    record: dict[str, Any] = {"version": version, "skipped": str(exc)}
                else:
                    engine.load_state(subscriber.tensors, version)
                    record = asyncio.run(evaluate(cfg, engine, tokenizer, template, task, prompts, version=version))
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                sinks.log(eval_scalars(record), version)
                print(json.dumps(record), flush=True)
            next_due = (latest // every + 1) * every
            if stopping or latest >= cfg.trainer.max_steps:
                return 0
            stop.wait(FOLLOW_POLL_S)
    finally:
        # what is left is teardown: a stop request now (the launcher stops its evaluator as the run ends) has nothing
        # to stop, and arriving once the interpreter has put the default handlers back it would turn a finished
        # evaluator's exit status into -15
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        sinks.close()


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: the version is evaluated again
            continue
    return out


async def evaluate(
    cfg: LeewayConfig, engine: Any, tokenizer: Any, template: Any, task: Any, prompts: list[Any], *, version: int
) -> dict[str, Any]:
    """Roll out the first `eval.prompts` of `prompts` on `engine` (holding `version`) and score them; see the
    module docstring for the keys."""
    from actors.generator.runtime import sampling_params
    from pipeline.rl.engine_records import GenerateRequest
    from pipeline.rl.episodes import environment_factory
    from pipeline.rl.prompt_ids import UnrunnablePrompt, checked_prompt_ids
    from pipeline.rl.scoring import run_group, score_group
    from pipeline.tasks.verifiers import verifier_pool_for

    settings = cfg.eval
    k = settings.samples_per_prompt
    chosen = prompts[: settings.prompts] if settings.prompts is not None else prompts
    sampling = sampling_params(cfg, tokenizer)
    if settings.temperature is not None:
        sampling = replace(sampling, temperature=settings.temperature)
    started = time.perf_counter()
    unrunnable: Counter[str] = Counter()
    jobs = []
    for i, prompt in enumerate(chosen):
        try:
            ids = checked_prompt_ids(
                prompt,
                tokenizer,
                vocab_size=engine.vocab_size,
                max_context_tokens=engine.max_context_tokens,
                template=template,
            )
        except UnrunnablePrompt as exc:
            unrunnable[exc.reason.value] += 1
            continue
        requests = [GenerateRequest(ids, seed=EVAL_SEED + i * 1024 + j, request_id=f"eval-{i}-{j}") for j in range(k)]
        jobs.append((prompt, ids, [] if environment_factory(task) else engine.submit(requests, sampling)))
    statuses: Counter[str] = Counter()
    rewards: list[float] = []
    by_tag: dict[str, list[float]] = defaultdict(list)
    pass1: list[float] = []
    passk: list[float] = []
    environment = environment_factory(task)
    with verifier_pool_for(cfg, task) as pool:
        for n, (prompt, ids, futures) in enumerate(jobs):
            if environment is not None:  # a multi-turn task: k episodes, the engine called once per turn
                samples = await run_group(
                    engine.generate,
                    task,
                    prompt,
                    k,
                    sampling,
                    environment,
                    tokenizer=tokenizer,
                    verifiers=pool,
                    group_id=f"eval-{n}",
                    template=template,
                    infra_retries=cfg.rollout.infra_retries,
                    strict_truncation=cfg.rollout.strict_truncation,
                )
            else:
                results = [await asyncio.wrap_future(f) for f in futures]
                samples = await score_group(
                    task, prompt, ids, results, sampling, tokenizer=tokenizer, group_id=f"eval-{n}", verifiers=pool
                )
            scored = [s.reward for s in samples if s.reward is not None and s.status not in ("infra_error", "aborted")]
            statuses.update(s.status for s in samples)
            rewards.extend(scored)
            for tag in prompt.tags:
                by_tag[tag].extend(scored)
            if scored:
                right = [r >= task.max_reward for r in scored]
                pass1.append(sum(right) / len(right))
                passk.append(float(any(right)))
    await task.aclose()  # what the episodes held in this event loop (a harbor task's sandbox pool)
    return {
        "version": version,
        "prompts": len(jobs),
        "samples_per_prompt": k,
        "temperature": sampling.temperature,
        "mean_reward": _mean(rewards),
        "pass@1": _mean(pass1),
        f"pass@{k}": _mean(passk),
        "by_tag": {tag: _mean(values) for tag, values in sorted(by_tag.items())},
        "statuses": dict(sorted(statuses.items())),
        "unrunnable": dict(sorted(unrunnable.items())),
        "seconds": time.perf_counter() - started,
    }


def lenient(cfg: LeewayConfig) -> LeewayConfig:
    """`cfg` with the strict-episode rules off unless ``eval.strict``: evaluation measures what the policy can
    do, not how often training's stricter rules would end its episodes."""
    if cfg.eval.strict:
        return cfg
    rollout = cfg.rollout.model_copy(update={"strict_format": False, "strict_truncation": False})
    return cfg.model_copy(update={"rollout": rollout})


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
