#!/usr/bin/env bash
# Oracle: writes a correct /app/solution.py.
mkdir -p /app
cat > /app/solution.py <<'EOF'
def parse_kv(s: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in s.split(";"):
        if not entry.strip():
            continue
        if "=" not in entry:
            raise ValueError(f"entry without '=': {entry!r}")
        key, value = entry.split("=", 1)
        out[key.strip()] = value.strip()
    return out
EOF
