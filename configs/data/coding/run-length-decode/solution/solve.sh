#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
import re


def rle_decode(s: str) -> str:
    return "".join(ch * int(count) for count, ch in re.findall(r"([0-9]+)([^0-9])", s))
EOF
