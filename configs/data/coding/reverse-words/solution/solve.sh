#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def reverse_words(s: str) -> str:
    return " ".join(reversed(s.split()))
EOF
