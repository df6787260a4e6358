"""`leeway purge CONFIG [--yes]`: delete one run's data from shared servers, so its name can be used again.

Everything a run leaves on the servers is named after `run.name` alone (`pipeline/wire/names.py`,
`pipeline/wire/announce.py`, `pipeline/wire/lease.py`), so the run's share of a shared stack is found without any index:

    NATS   streams  LEEWAY_<run>_TRAJ, LEEWAY_<run>_PROMPTS, LEEWAY_<run>_DLQ   (consumers go with them)
           KV       leeway_<run>_versions                                        (the version doorbell)
                    leeway_<run>_lease                                           (the trainer lease)
    store  every object under `<run>/`: weights, checkpoints, claim-checked groups

Invariants:
- Nothing of another run is touched: stream and bucket names are exact, and the object prefix ends in
  '/', so purging `demo` leaves `demo2/` alone.
- Without `--yes` nothing is deleted: the plan is printed and the exit code is 1.
- The local `run.dir` stays (`leeway run --fresh` deletes that). Stop the run's roles first: a live
  trainer or generator would recreate the streams it uses.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field

import nats.js.errors

from actors.cli_args import WithConfig, add_config_arguments
from actors.servers import ServerError, Servers, connect_nats, open_run_store, resolve_servers
from pipeline.config import LeewayConfig
from pipeline.wire.announce import version_bucket
from pipeline.wire.lease import lease_bucket
from pipeline.wire.names import RunNames
from storage.objectstore import ObjectStore


@dataclass(frozen=True)
class PurgePlan:
    """What of one run exists on the servers right now (what `purge` deletes)."""

    run: str
    streams: dict[str, int] = field(default_factory=dict)
    """Existing stream name -> messages it holds."""
    kv_buckets: tuple[str, ...] = ()
    """The run's KV buckets that exist (version announcements, the trainer lease)."""
    object_keys: tuple[str, ...] = ()
    """Store keys under `<run>/` (relative to the store root)."""

    @property
    def empty(self) -> bool:
        return not self.streams and not self.kv_buckets and not self.object_keys

    def describe(self, servers: Servers) -> list[str]:
        lines = [f"stream {name} ({count} messages) on {servers.nats_url}" for name, count in self.streams.items()]
        lines += [f"KV bucket {bucket} on {servers.nats_url}" for bucket in self.kv_buckets]
        if self.object_keys:
            lines.append(f"{len(self.object_keys)} objects under {self.run}/ in {servers.store_url}")
        return lines


def run_prefix(names: RunNames) -> str:
    """The store prefix of the run's objects; the trailing '/' keeps `demo2/` out of `demo`'s purge."""
    return f"{names.run}/"


async def plan_purge(js: nats.js.JetStreamContext, store: ObjectStore, names: RunNames) -> PurgePlan:
    """Look up the run's streams, KV bucket and objects; a missing one is simply not in the plan."""
    streams: dict[str, int] = {}
    for stream in (names.trajectory_stream, names.prompt_stream, names.dead_letter_stream):
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            continue
        streams[stream] = int(info.state.messages)
    buckets: list[str] = []
    for bucket in (version_bucket(names), lease_bucket(names)):
        try:
            await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            continue
        buckets.append(bucket)
    keys = await asyncio.to_thread(store.list, run_prefix(names))
    return PurgePlan(run=names.run, streams=streams, kv_buckets=tuple(buckets), object_keys=tuple(keys))


async def execute_purge(js: nats.js.JetStreamContext, store: ObjectStore, plan: PurgePlan) -> None:
    """Delete exactly what `plan` lists; something already gone is not an error (a rerun finishes the job)."""
    for stream in plan.streams:
        try:
            await js.delete_stream(stream)
        except nats.js.errors.NotFoundError:
            pass
    for bucket in plan.kv_buckets:
        try:
            await js.delete_key_value(bucket)
        except nats.js.errors.NotFoundError:
            pass
    await asyncio.to_thread(store.delete_many, plan.object_keys)


async def purge(cfg: LeewayConfig, *, yes: bool) -> int:
    """Print the plan; delete it with `yes`. Exit code: 0 done or nothing to do, 1 when `yes` is missing."""
    names = RunNames.for_run(cfg.run.name)
    servers = resolve_servers(cfg)
    store = open_run_store(cfg, servers)
    nc = await connect_nats(cfg, servers, name="leeway-purge")
    try:
        js = nc.jetstream()
        plan = await plan_purge(js, store, names)
        if plan.empty:
            print(f"leeway purge: run {names.run!r} has nothing on these servers")
            return 0
        verb = "deleting" if yes else "would delete"
        print(f"leeway purge: {verb} run {names.run!r}:")
        for line in plan.describe(servers):
            print(f"  {line}")
        if not yes:
            print("leeway purge: nothing deleted; pass --yes to delete the above", file=sys.stderr)
            return 1
        await execute_purge(js, store, plan)
        print(f"leeway purge: run {names.run!r} purged; its name can be used again")
        return 0
    finally:
        await nc.close()
        store.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway purge`'s description, flags and handler."""
    parser.description = (
        "Deletes what run.name left on the servers, so the name can be used again: the "
        "JetStream streams LEEWAY_<run>_TRAJ, _PROMPTS and _DLQ (with their consumers), the KV buckets "
        "leeway_<run>_versions and leeway_<run>_lease, and every object under <run>/ in the store (weights, "
        "checkpoints, claim-checked groups). Other runs on the same servers are not touched; run.dir stays. "
        "Stop the run's trainer and generators first. Without --yes it only prints what it would "
        "delete and exits 1."
    )
    add_config_arguments(parser)
    parser.add_argument("--yes", action="store_true", help="really delete (without it: print the plan, exit 1)")
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: LeewayConfig, args: argparse.Namespace) -> int:
    try:
        return asyncio.run(purge(cfg, yes=args.yes))
    except ServerError as exc:
        print(f"leeway purge: {exc}", file=sys.stderr)
        return 2
