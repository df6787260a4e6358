#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
from math import gcd


def gcd_lcm(nums: list[int]) -> tuple[int, int]:
    g, m = 0, 1
    for x in nums:
        x = abs(x)
        g = gcd(g, x)
        m = m * x // gcd(m, x)
    return (g, m)
EOF
