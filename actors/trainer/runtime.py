"""The trainer process: a `Trainer` (`actors/trainer/loop.py`) wired to the run's servers and its rank group.

```
  leeway trainer CONFIG ─► main (logging, torch threads and seed; joins the rank group when RANK/WORLD_SIZE are set)
      ├─ rank 0 (or the only rank) ─► _lead: SIGINT/SIGTERM -> stop ─► open_trainer ─► Trainer.run
      │     open_trainer: task, tokenizer, model, backend, RunLink (NATS + store), then the run lease and a
      │     LeasedSession (weight publisher; several ranks: a RankGroup behind a LeaderBackend) or a ReplaySession
      └─ ranks 1..N-1 ─► _follow: the same model and backend, a store and publisher for their shares, no NATS;
                          they run rank 0's commands until it sends STOP (`actors/trainer/rank_group.py`)
```

This mirrors `actors/generator/runtime.py`: the loop module holds the role's logic and is tested with
the parts `open_trainer` assembles; this module is the process around it. Launching several ranks
(`--nproc`) is `actors/trainer/distributed.py`. `main` returns 0 when the loop ends normally; 2 when the run
stops on purpose (the task failed its verifier self-check, or no trainable group arrived for
`trainer.queue_wait_timeout_s`), with the reason as the log's last line and no traceback
(`infra.role_logs.log_stop`); and 1 when it raised anything else (logged with its traceback; a final checkpoint
was written where the state allowed) or when a following rank failed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal

import torch
from tokenizers import Tokenizer

from actors.model_files import publish_model_files
from actors.models import build_policy_model, load_tokenizer
from actors.servers import open_run_store, resolve_servers, watch_servers
from actors.trainer.backends import build_backend
from actors.trainer.backends.data_parallel import is_data_parallel
from actors.trainer.distributed import RankEnv, join_rank_group, leave_rank_group
from actors.trainer.loop import QueueWaitTimeout, Trainer
from actors.trainer.prompt_feed import check_prompt_rows
from actors.trainer.rank_group import LeaderBackend, RankGroup, follow
from actors.trainer.replay_session import ReplaySession
from actors.trainer.run_lease import LeasedSession, LeaseKeeper
from actors.trainer.session_protocol import RunLink, Session
from actors.trainer.sessions import build_weight_publisher
from infra.role_logs import configure_role_logging, log_stop
from pipeline.config import LeewayConfig
from pipeline.tasks import Task, load_prompts, task_for
from pipeline.tasks.self_check import SELF_CHECK_ITEMS, TaskSelfCheckError, require_verified_task
from pipeline.wire.replay import ReplaySelection

log = logging.getLogger(__name__)


async def open_trainer(
    cfg: LeewayConfig,
    *,
    resume: bool = False,
    replay: ReplaySelection | None = None,
    stop: asyncio.Event | None = None,
) -> Trainer:
    """Build the model and backend, connect, and open a live session (or a replay one); nothing is read yet.

    A live session is opened only once this trainer holds the run's lease (`actors/trainer/run_lease.py`):
    `LeaseHeld`, naming the holder, if another trainer of the run is alive."""
    stop = stop if stop is not None else asyncio.Event()
    task = task_for(cfg)
    tokenizer = load_tokenizer(cfg, task)
    if replay is None:
        await check_task(cfg, task, tokenizer)
    model = build_policy_model(cfg, tokenizer)
    backend = build_backend(cfg, model)
    link = await RunLink.open(cfg)
    group: RankGroup | None = None
    lease: LeaseKeeper | None = None
    try:
        session: Session
        if replay is not None:
            if is_data_parallel():
                group = RankGroup(cfg, backend, link.store, None)
                backend = LeaderBackend(group)
            session = await ReplaySession.open(cfg, link, replay)
        else:
            lease = await LeaseKeeper.take(cfg, link.js, link.names, on_lost=stop.set)
            link = lease.fenced(link)  # past its fence the trainer writes no object (`run_lease.FencedStore`)
            await asyncio.to_thread(publish_model_files, link.store, cfg)  # before version 0: what generators build
            publisher = build_weight_publisher(cfg, link.store, model)
            try:
                if is_data_parallel():  # rank 0 of several: the others follow its commands
                    group = RankGroup(cfg, backend, link.store, publisher)
                    backend = LeaderBackend(group)
                live = await LeasedSession.open(cfg, link, backend, publisher, task, resume=resume, ranks=group)
                assert isinstance(live, LeasedSession)
                live.lease = lease
                session = live
            except BaseException:
                publisher.close()
                raise
    except BaseException:
        if lease is not None:
            await lease.close()
        await link.nc.close()
        if group is not None:
            group.stop()
        raise
    return Trainer(cfg, backend, session, stop=stop)


async def check_task(cfg: LeewayConfig, task: Task, tokenizer: Tokenizer) -> None:
    """The verifier self-check on the first prompts the run admits (`pipeline/tasks/self_check.py`); a task that
    fails is refused (`TaskSelfCheckError`) before anything is trained on it."""
    if cfg.task.prompts_file is not None:
        rows = load_prompts(cfg.task.prompts_file)
        check_prompt_rows(rows, cfg.task.prompts_file, max_msg_bytes=cfg.stream.max_msg_bytes)  # the file first
        prompts = rows[:SELF_CHECK_ITEMS]
    else:
        prompts = list(itertools.islice(task.prompts(), SELF_CHECK_ITEMS))
    from pipeline.tasks.verifiers import verifier_pool_for

    with verifier_pool_for(cfg, task) as pool:
        await require_verified_task(
            task,
            cfg.task.name,
            prompts,
            pool,
            skip=cfg.task.skip_self_check,
            has_agent=cfg.task.agent is not None or task.agent is not None or not task.self_check,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
        )


def _follow(cfg: LeewayConfig) -> int:
    """Ranks 1..N-1: the same model and backend as rank 0, a store and publisher for their shares, no NATS."""
    task = task_for(cfg)
    model = build_policy_model(cfg, load_tokenizer(cfg, task))
    backend = build_backend(cfg, model)
    store = open_run_store(cfg, resolve_servers(cfg))
    publisher = build_weight_publisher(cfg, store, model)
    try:
        return follow(RankGroup(cfg, backend, store, publisher))
    finally:
        publisher.close()


def main(cfg: LeewayConfig, *, resume: bool = False, replay: ReplaySelection | None = None) -> int:
    """`leeway trainer CONFIG [--resume] [--replay SELECTION]` (the CLI parses the flags), as one process or
    as one rank of several (RANK/WORLD_SIZE/... in the environment, `actors/trainer/distributed.py`)."""
    rank_env = RankEnv.from_environ()
    where = f" rank{rank_env.rank}" if rank_env.distributed else ""
    configure_role_logging(
        cfg.logging.level,
        f"%(asctime)s %(name)s{where} %(levelname)s %(message)s",
        max_bytes=cfg.logging.role_log_max_bytes,
        backups=cfg.logging.role_log_backups,
    )
    torch.set_num_threads(cfg.trainer.torch_threads)
    torch.manual_seed(cfg.run.seed)  # every rank builds the same initial weights
    watch_servers(cfg)  # orphaned with its servers gone: no final checkpoint to retry (infra/orphans.py)
    if rank_env.distributed:
        timeout_s = cfg.trainer.dist_timeout_s + cfg.trainer.queue_wait_timeout_s  # rank 0 may wait for groups
        join_rank_group(rank_env, cfg.trainer.device, timeout_s)
    try:
        if not rank_env.is_leader:
            try:
                return _follow(cfg)
            except Exception:  # the process boundary: the launcher names this rank and stops the others
                log.exception("trainer rank %d exiting with an error", rank_env.rank)
                return 1
        return _lead(cfg, resume=resume, replay=replay)
    finally:
        leave_rank_group()


def _lead(cfg: LeewayConfig, *, resume: bool, replay: ReplaySelection | None) -> int:
    """The trainer loop (of rank 0 when there are several ranks)."""

    async def _run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        trainer = await open_trainer(cfg, resume=resume, replay=replay, stop=stop)
        return await trainer.run()

    try:
        return asyncio.run(_run())
    except (TaskSelfCheckError, QueueWaitTimeout) as exc:  # expected stops: the reason, not a traceback
        return log_stop(log, "trainer", exc)
    except Exception:  # the process boundary: the traceback goes to the log, the exit status says it failed
        log.exception("trainer exiting with an error (a final checkpoint was written where the state allowed)")
        return 1
