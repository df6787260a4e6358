#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def compress_whitespace(s: str) -> str:
    return " ".join(s.split())
EOF
