"""The `leeway` command: help that lists every flag without importing torch, config errors, config show."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from actors.cli import COMMANDS as TABLE
from actors.cli import Benchmark, Command, Group, build_parser, main
from pipeline.config_reference import config_reference

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = (
    ("stack",),
    ("config", "show"),
    ("config", "reference"),
    ("run",),
    ("trainer",),
    ("generator",),
    ("replay",),
    ("purge",),
    ("eval",),
    ("export",),
    ("sft",),
    ("tasks", "check"),
    ("fleet", "up"),
    ("fleet", "scale"),
    ("fleet", "status"),
    ("fleet", "down"),
    ("bench", "weights"),
    ("bench", "transport"),
    ("bench", "e2e"),
    ("bench", "engine"),
    ("bench", "trainer"),
    ("bench", "moe"),
    ("bench", "agents"),
    ("bench", "sandbox"),
    ("bench", "learning"),
)
"""Every leaf command of the parser (a test checks this list against `build_parser`)."""

NO_TORCH_COMMANDS = tuple(c for c in COMMANDS if c[0] != "bench")
"""`leeway bench <name> --help` imports the benchmark's module for its flags; `bench weights` needs torch."""


def _leeway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _subparser(command: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(command)
    for name in command:
        (choices,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = choices.choices[name]
    return parser


def _leaf_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [prefix]
    return [leaf for name, sub in subs[0].choices.items() for leaf in _leaf_commands(sub, (*prefix, name))]


def test_the_command_list_covers_every_leaf_command() -> None:
    assert sorted(_leaf_commands(build_parser())) == sorted(COMMANDS)


Row = Command | Benchmark | Group


def _table_rows(table: tuple[Row, ...], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Row]:
    rows: dict[tuple[str, ...], Row] = {}
    for row in table:
        rows[(*prefix, row.name)] = row
        if isinstance(row, Group):
            rows.update(_table_rows(row.commands, (*prefix, row.name)))
    return rows


TABLE_ROWS = _table_rows(TABLE)
"""Every row of `actors.cli.COMMANDS`, groups (`config`, `tasks`, `bench`) and their actions included."""


def _help_text(words: tuple[str, ...], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*words, "--help"])
    assert exit_info.value.code == 0, f"leeway {' '.join(words)} --help"
    return _squeezed(capsys.readouterr().out)


def _squeezed(text: str) -> str:
    """`text` without whitespace: argparse wraps lines at spaces and after hyphens."""
    return "".join(text.split())


@pytest.mark.parametrize("path", TABLE_ROWS, ids=" ".join)
def test_every_command_in_the_table_says_what_it_is_for(path: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    """Its parent's --help lists it with its help line; its own --help exits 0 and opens with what it does."""
    row = TABLE_ROWS[path]
    assert _squeezed(row.help) in _help_text(path[:-1], capsys)
    own = _help_text(path, capsys)
    description = _subparser(path).description
    assert description, f"leeway {' '.join(path)} --help says nothing of what it does"
    assert _squeezed(description) in own


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_mentions_every_flag_the_parser_defines(command: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: leeway {' '.join(command)}")
    actions = [a for a in _subparser(command)._actions if a.help != argparse.SUPPRESS]
    assert actions
    for action in actions:
        choices = "{" + ",".join(action.choices) + "}" if action.choices else None
        names = action.option_strings or [action.metavar or choices or action.dest]
        for name in names:
            assert name in text, f"leeway {' '.join(command)} --help does not mention {name}"
        if action.help:
            assert action.help.split()[0] in text


def test_help_of_every_role_answers_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from actors.cli import main\n"
        f"for command in {NO_TORCH_COMMANDS!r}:\n"
        "    try:\n"
        "        main([*command, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, command\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_config_show_prints_the_resolved_value_of_an_override() -> None:
    result = _leeway("config", "show", "configs/demo.yaml", "--set", "trainer.lr=0.5", "--set", "engine.device=cuda")
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    written = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    assert shown["trainer"]["lr"] == 0.5
    assert shown["engine"]["device"] == "cuda"
    assert shown["trainer"]["batch_groups"] == written["trainer"]["batch_groups"]  # the file's own value
    assert shown["trainer"]["grad_clip"] == 1.0  # a default


def test_missing_config_file_is_one_line_and_exit_2() -> None:
    result = _leeway("config", "show", "configs/nope.yaml")
    assert result.returncode == 2
    assert result.stderr == "leeway: config error: configs/nope.yaml: config file not found\n"


def test_config_error_names_key_and_source_without_a_traceback() -> None:
    result = _leeway("config", "show", "configs/demo.yaml", "--set", "trainer.nope=1")
    assert result.returncode == 2
    assert "configs/demo.yaml" in result.stderr
    assert "trainer.nope: unknown key (from --set trainer.nope)" in result.stderr
    assert "Traceback" not in result.stderr


def test_unbuilt_engine_is_a_config_error_before_any_role_starts() -> None:
    result = _leeway("generator", "configs/demo.yaml", "--set", "engine.kind=sglang")
    assert result.returncode == 2
    assert "engine.kind = 'sglang': not built yet" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_reference_prints_the_generated_reference() -> None:
    result = _leeway("config", "reference")
    assert result.returncode == 0, result.stderr
    assert result.stdout == config_reference()


def test_readme_config_reference_is_current() -> None:
    readme = (ROOT / "README.md").read_text()
    assert config_reference() in readme, "README config reference is stale: run `leeway config reference`"


def test_stack_up_status_down_through_the_cli(tmp_path: Path) -> None:
    directory = str(tmp_path / "stack")
    up = _leeway("stack", "up", "--dir", directory)
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        status = _leeway("stack", "status", "--dir", directory)
        assert status.returncode == 0, status.stdout
        servers = json.loads(status.stdout)
        assert servers["nats"]["healthy"] and servers["seaweed"]["healthy"]
        assert servers["nats"]["endpoint"].startswith("nats://127.0.0.1:")
    finally:
        down = _leeway("stack", "down", "--dir", directory)
    assert down.returncode == 0, down.stderr
    after = _leeway("stack", "status", "--dir", directory)
    assert after.returncode == 1
    assert not json.loads(after.stdout)["nats"]["running"]


@pytest.mark.parametrize("bench", ["weights", "transport", "e2e"])
def test_each_bench_adds_its_own_flags(bench: str) -> None:
    result = _leeway("bench", bench, "--help")
    assert result.returncode == 0, result.stderr
    assert "--json" in result.stdout
    own_flag = {"weights": "--lr", "transport": "--tokens", "e2e": "--target"}[bench]
    assert own_flag in result.stdout


def test_purge_help_says_what_it_deletes_and_asks_for_yes() -> None:
    result = _leeway("purge", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for expected in ("LEEWAY_<run>_TRAJ", "leeway_<run>_versions", "every object under <run>/", "--yes", "not touched"):
        assert expected in text, f"{expected!r} missing from leeway purge --help"


def test_fresh_help_names_the_marker_and_the_protected_directories() -> None:
    result = _leeway("run", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert ".leeway-run" in text and "never the working directory, home or /" in text
