#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def two_sum(nums: list[int], target: int) -> tuple[int, int] | None:
    first = {}
    for j, x in enumerate(nums):
        i = first.get(target - x)
        if i is not None:
            return (i, j)
        first.setdefault(x, j)
    return None
EOF
