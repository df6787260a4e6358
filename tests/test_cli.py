"""The `leeway` command: help on every subcommand, clear config errors, instant --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _leeway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "actors.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(
    "argv",
    [[], ["stack"], ["config", "show"], ["run"], ["trainer"], ["generator"], ["replay"], ["bench"]],
    ids=lambda a: " ".join(a) or "leeway",
)
def test_help_explains_each_command(argv: list[str]) -> None:
    result = _leeway(*argv, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: leeway" in result.stdout
    assert len(result.stdout.splitlines()) > 4


def test_help_does_not_import_torch() -> None:
    code = "import sys\nfrom actors.cli import main\ntry:\n    main(['trainer', '--help'])\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


def test_config_show_prints_resolved_config() -> None:
    result = _leeway("config", "show", "configs/demo.yaml", "--set", "trainer.lr=0.5")
    assert result.returncode == 0, result.stderr
    assert "lr: 0.5" in result.stdout


def test_config_error_is_one_clear_line_and_exit_2() -> None:
    result = _leeway("config", "show", "configs/demo.yaml", "--set", "trainer.nope=1")
    assert result.returncode == 2
    assert "trainer.nope: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_readme_config_reference_is_current() -> None:
    from pipeline.config import config_reference

    readme = (ROOT / "README.md").read_text()
    assert config_reference() in readme, "README config reference is stale: run `leeway config reference`"


def test_stack_up_status_down_through_the_cli(tmp_path: Path) -> None:
    import json

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
