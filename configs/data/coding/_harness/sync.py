"""Copies the generic verifier (test.sh, checker.py, child.py) from this directory into every task's tests/:
``python3 configs/data/coding/_harness/sync.py`` after editing one of them here (a Harbor task directory is
self-contained, only its tests/ reaches /tests, so each task holds its own copy; tests/tools/test_coding_tasks.py
fails while any copy differs)."""

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = ("test.sh", "checker.py", "child.py")


def main() -> int:
    tasks = sorted(p for p in HERE.parent.iterdir() if (p / "task.toml").is_file())
    for task in tasks:
        for name in FILES:
            shutil.copy2(HERE / name, task / "tests" / name)
    print(f"copied {', '.join(FILES)} into {len(tasks)} tasks under {HERE.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
