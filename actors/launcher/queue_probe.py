"""The queue depths `leeway run` shows: read from NATS once a second by a client of its own, in a thread.

The launcher's loop is synchronous: its main thread spawns the roles, polls them and metrics.jsonl,
and stops them (`actors/launcher/run.py`). The NATS client is asyncio, so the probe runs its own event
loop in a daemon thread and hands the newest values over under a lock. It is a nicety: when NATS is
away, or a stream or consumer does not exist yet, the values read as None and the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from actors.servers import connect_nats
from pipeline.config import LeewayConfig
from pipeline.wire.names import RunNames

QUEUE_POLL_S = 1.0
"""How often the queue depths are read from NATS."""


class QueueProbe:
    """Reads the queue depths from NATS once a second in a daemon thread (its own event loop).

    - `prompts_waiting`: admitted prompts no generator has taken yet (generators' consumer num_pending);
    - `prompts_in_generation`: taken, not yet done (num_ack_pending);
    - `groups_waiting`: published groups the trainer has not fetched (trainer consumer num_pending);
    - `groups_in_step`: fetched into the trainer's current step, not yet acked.
    A stream or consumer that does not exist yet reads as None. Never raises into the caller.
    """

    def __init__(self, cfg: LeewayConfig) -> None:
        self.cfg = cfg
        self.names = RunNames.for_run(cfg.run.name)
        self._values: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="leeway-queue-probe", daemon=True)

    def start(self) -> QueueProbe:
        self._thread.start()
        return self

    def values(self) -> dict[str, int | None]:
        with self._lock:
            return dict(self._values)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3.0)

    def _main(self) -> None:
        with contextlib.suppress(Exception):  # a probe is a nicety: the run goes on without it
            asyncio.run(self._loop())

    async def _loop(self) -> None:
        nc = await connect_nats(self.cfg, name="leeway-run-probe")
        try:
            js = nc.jetstream()
            while not self._stop.is_set():
                values = {
                    **await self._consumer(js, self.names.prompt_stream, self.names.generator_consumer, "prompts"),
                    **await self._consumer(js, self.names.trajectory_stream, self.names.trainer_consumer, "groups"),
                }
                with self._lock:
                    self._values = values
                await asyncio.to_thread(self._stop.wait, QUEUE_POLL_S)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)

    @staticmethod
    async def _consumer(js: Any, stream: str, consumer: str, what: str) -> dict[str, int | None]:
        waiting, held = f"{what}_waiting", f"{what}_in_generation" if what == "prompts" else f"{what}_in_step"
        try:
            info = await asyncio.wait_for(js.consumer_info(stream, consumer), 2.0)
        except Exception:  # not created yet, or the server is away for a moment
            return {waiting: None, held: None}
        return {waiting: int(info.num_pending), held: int(info.num_ack_pending)}
