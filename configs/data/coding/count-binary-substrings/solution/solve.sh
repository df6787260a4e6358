#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
from itertools import groupby


def count_binary_substrings(s: str) -> int:
    runs = [len(list(group)) for _, group in groupby(s)]
    return sum(min(a, b) for a, b in zip(runs, runs[1:]))
EOF
