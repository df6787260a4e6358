"""Ray is the `fleet` extra: without it `leeway fleet` answers one line naming the extra (no traceback), and the
rest of the CLI, `leeway fleet --help` included, never imports it."""

from __future__ import annotations

import subprocess
import sys

from tests.support.runs import DEMO, REPO

WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from actors.cli import main; sys.exit(main(sys.argv[1:]))"
"""`leeway ARGS` in an interpreter where `import ray` fails as it does where Ray is not installed."""


def _leeway_without_ray(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_fleet_without_ray_names_the_extra_in_one_line() -> None:
    result = _leeway_without_ray("fleet", "status", str(DEMO))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "leeway fleet: needs Ray, which is not installed here: pip install 'leeway[fleet]'"
    ]


def test_the_fleet_help_needs_no_ray() -> None:
    result = _leeway_without_ray("fleet", "up", "--help")
    assert result.returncode == 0 and "--generators" in result.stdout, result.stderr
