"""`leeway replay CONFIG (--from-seq N | --since TIME | --min-version V) [--until-seq N | --until TIME] [--to-parquet DIR]`.

Reads a selection of the run's recorded trajectory stream (see `pipeline.wire.replay.ReplaySelection`)
through an ephemeral consumer, which never disturbs the trainer's durable consumer. With
`--to-parquet` the groups are written to `DIR/seq-<first>-<last>.parquet` files (rows of a group
contiguous, readable with `pipeline.wire.codec.read_parquet`); without it, only a JSON summary is printed.
Feeding a trainer from the same selection goes through `ReplayReader` directly (the trainer's job).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
from pathlib import Path
from typing import Any

from actors.cli_args import WithConfig, add_config_arguments

DEFAULT_GROUPS_PER_FILE = 1024


def _parse_time(text: str) -> dt.datetime:
    """ISO 8601 (`2026-05-01T12:00:00Z`, `2026-05-01 12:00`), or Unix seconds; naive times are UTC."""
    try:
        value = dt.datetime.fromtimestamp(float(text), dt.timezone.utc)
    except ValueError:
        try:
            value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time or Unix seconds") from exc
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def add_selection_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The selection flags, shared by `leeway replay` and `leeway trainer --replay`."""
    start = parser.add_mutually_exclusive_group(required=required)
    start.add_argument("--from-seq", type=int, metavar="N", help="first stream sequence (inclusive)")
    start.add_argument("--since", type=_parse_time, metavar="TIME", help="groups stored at or after TIME (ISO 8601)")
    start.add_argument(
        "--min-version", type=int, metavar="V", help="groups whose every trained token has policy version >= V"
    )
    end = parser.add_mutually_exclusive_group()
    end.add_argument("--until-seq", type=int, metavar="N", help="last stream sequence (inclusive)")
    end.add_argument("--until", type=_parse_time, metavar="TIME", help="groups stored at or before TIME")


def selection_from_args(args: argparse.Namespace) -> Any:
    """The parsed selection flags as a `pipeline.wire.replay.ReplaySelection`."""
    from pipeline.wire.replay import ReplaySelection

    return ReplaySelection(
        from_seq=args.from_seq,
        since=args.since,
        min_version=args.min_version,
        until_seq=args.until_seq,
        until=args.until,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`leeway replay`'s description, flags and handler."""
    parser.description = (
        "Select groups of the run's trajectory stream by sequence, time or policy "
        "version and export them. To train on them instead, use `leeway trainer --replay`."
    )
    add_config_arguments(parser)
    add_selection_arguments(parser, required=True)
    parser.add_argument("--to-parquet", metavar="DIR", help="write the selection as Parquet files into DIR")
    parser.add_argument("--groups-per-file", type=int, default=DEFAULT_GROUPS_PER_FILE, help="groups per Parquet file")
    parser.set_defaults(handler=WithConfig(main))


def main(cfg: Any, args: argparse.Namespace) -> int:
    """Run the replay; prints one JSON summary line. Returns 0, or 1 if some messages could not be read."""
    summary = asyncio.run(replay(cfg, args))
    print(json.dumps(summary))
    return 1 if summary["skipped"] else 0


async def replay(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from actors.servers import connect_nats, open_run_store, resolve_servers
    from pipeline.wire.codec import write_parquet
    from pipeline.wire.names import RunNames
    from pipeline.wire.replay import ReplayReader

    selection = selection_from_args(args)
    names = RunNames.for_run(cfg.run.name)
    servers = resolve_servers(cfg)
    store = open_run_store(cfg, servers)
    out_dir = Path(args.to_parquet) if args.to_parquet else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    nc = await connect_nats(cfg, servers, name="leeway-replay")
    files: list[str] = []
    seqs: list[int] = []
    try:
        reader = await ReplayReader.open(nc.jetstream(timeout=30), names, cfg.stream, store, selection)
        pending = []
        async for delivery in reader:
            seqs.append(delivery.seq)
            pending.append(delivery)
            if out_dir is not None and len(pending) >= args.groups_per_file:
                files.append(_write(out_dir, pending, write_parquet))
                pending = []
        if out_dir is not None and pending:
            files.append(_write(out_dir, pending, write_parquet))
    finally:
        await nc.close()
    return {
        "run": names.run,
        "groups": len(seqs),
        "first_seq": seqs[0] if seqs else None,
        "last_seq": seqs[-1] if seqs else None,
        "filtered": reader.stats.filtered,
        "skipped": dict(reader.stats.skipped),
        "files": files,
    }


def _write(out_dir: Path, deliveries: list, write_parquet) -> str:
    path = out_dir / f"seq-{deliveries[0].seq:012d}-{deliveries[-1].seq:012d}.parquet"
    write_parquet([d.group for d in deliveries], path)
    return str(path)
