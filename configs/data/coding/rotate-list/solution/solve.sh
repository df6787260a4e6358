#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def rotate(items: list, k: int) -> list:
    if not items:
        return []
    k %= len(items)
    return items[len(items) - k :] + items[: len(items) - k]
EOF
