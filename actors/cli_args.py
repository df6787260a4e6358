"""What the parsers of the `leeway` commands share: the config file argument, `--set`, a positive count, and the
handler that loads the config before a command's `main` runs.

Each command module defines its own parser (`add_arguments(parser)`, beside its `main`) with these;
`actors/cli.py` holds the table of commands and the dispatch. Only argparse is imported here (`pipeline.config`
when a handler runs), so a command's `--help` answers without torch, and every floor that defines a command may
import this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import LeewayConfig

CONFIG_HELP = "YAML config file (see configs/ and the README's config reference)"
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


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """The config file (`args.config`; None without one when not `required`) and `--set` (`args.overrides`)."""
    if required:
        parser.add_argument("config", help=CONFIG_HELP)
    else:
        parser.add_argument("config", nargs="?", default=None, help=CONFIG_HELP + " (default: built-in defaults)")
    add_set_argument(parser)


def load_cli_config(args: argparse.Namespace) -> LeewayConfig:
    """The config named by `add_config_arguments`' flags; a `ConfigError` is printed by `leeway` without a traceback."""
    from pipeline.config import load_config

    return load_config(args.config, args.overrides)


@dataclass(frozen=True)
class WithConfig:
    """The handler of a command whose `main(cfg, args)` starts from the config: the config is loaded first, so a bad
    config fails at once, before `main` imports torch."""

    main: Callable[[LeewayConfig, argparse.Namespace], int]

    def __call__(self, args: argparse.Namespace) -> int:
        return self.main(load_cli_config(args), args)
