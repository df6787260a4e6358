#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
from itertools import groupby


def rle_encode(s: str) -> str:
    return "".join(f"{len(list(run))}{ch}" for ch, run in groupby(s))
EOF
