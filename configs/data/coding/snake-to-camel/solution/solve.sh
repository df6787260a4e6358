#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def snake_to_camel(s: str) -> str:
    words = [word for word in s.split("_") if word]
    if not words:
        return ""
    return words[0] + "".join(word[0].upper() + word[1:] for word in words[1:])
EOF
