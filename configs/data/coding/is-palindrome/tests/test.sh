#!/usr/bin/env bash
# Verifier: runs tests/test_solution.py against /app/solution.py; reward 1 when every check passes, else 0.
# The checker echoes a per-run token (read from stdin before /app/solution.py is imported) as its last line
# only after its last check, so a solution that exits early with status 0 still scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
token="passed-$RANDOM$RANDOM$RANDOM"
out=$(printf '%s\n' "$token" | timeout 10 python3 /tests/test_solution.py 2>&1)
status=$?
printf '%s\n' "$out"
if [ "$status" -eq 0 ] && [ "$(printf '%s\n' "$out" | tail -n 1)" = "$token" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
