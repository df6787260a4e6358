#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def title_case(s: str, minor: list[str]) -> str:
    small = {word.lower() for word in minor}
    out = []
    for i, word in enumerate(s.split()):
        if i > 0 and word.lower() in small:
            out.append(word.lower())
        else:
            out.append(word.capitalize())
    return " ".join(out)
EOF
