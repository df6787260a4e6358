#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def transpose(matrix: list[list[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*matrix)]
EOF
