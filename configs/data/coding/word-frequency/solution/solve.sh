#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
from collections import Counter


def word_frequency(text: str) -> list[tuple[str, int]]:
    words = []
    current = []
    for ch in text + " ":
        if ch.isalpha():
            current.append(ch)
        elif current:
            words.append("".join(current).lower())
            current = []
    counts = Counter(words)
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))
EOF
