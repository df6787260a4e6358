"""Argument helpers the `leeway` command and its benchmarks share (each benchmark module defines its own flags).

Only argparse is imported here: `actors/cli.py` loads this module before parsing, and `leeway --help`
must answer without torch. The `--set` flag lives here rather than in the cli so that a benchmark
never imports the command that imports it.
"""

from __future__ import annotations

import argparse

SET_HELP = "override one config key, e.g. --set trainer.lr=1e-4 (repeatable; beats LEEWAY_A__B env vars and the file)"


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, else argparse's usage error naming the flag."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_set_argument(parser: argparse.ArgumentParser, *, help: str = SET_HELP) -> None:
    """`--set KEY=VALUE`, repeatable, into `args.overrides`: what `pipeline.config.load_config` applies last.

    `help` says what the overrides apply to where that is more than one config (a benchmark's two runs).
    """
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
