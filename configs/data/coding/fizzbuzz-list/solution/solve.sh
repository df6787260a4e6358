#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def fizzbuzz(n: int) -> list[str]:
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
EOF
