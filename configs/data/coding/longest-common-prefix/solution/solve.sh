#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def longest_common_prefix(words: list[str]) -> str:
    if not words:
        return ""
    prefix = words[0]
    for word in words[1:]:
        n = 0
        while n < len(prefix) and n < len(word) and prefix[n] == word[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
EOF
