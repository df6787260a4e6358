#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
PAIRS = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]


def int_to_roman(n: int) -> str:
    out = []
    for value, numeral in PAIRS:
        count, n = divmod(n, value)
        out.append(numeral * count)
    return "".join(out)
EOF
