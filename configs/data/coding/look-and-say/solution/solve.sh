#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
from itertools import groupby


def look_and_say(n: int) -> str:
    term = "1"
    for _ in range(n - 1):
        term = "".join(f"{len(list(run))}{digit}" for digit, run in groupby(term))
    return term
EOF
