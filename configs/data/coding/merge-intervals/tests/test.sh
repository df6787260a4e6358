#!/usr/bin/env bash
# Verifier: tests/checker.py runs tests/cases.py against /app/solution.py, which runs in a bubblewrap sandbox of its
# own (no /tests, no /logs, no view of this process); reward 1 only when the checker, the one process that holds
# the expected values, exits 0 after every check passed and after the solution's sandbox is gone. No token and no
# output is trusted: only the checker's exit status. Without bubblewrap here the solution is not run (reward 0).
# The same file in every task (configs/data/coding/_harness/ holds the original; sync.py copies it).
export PATH=/usr/local/bin:/usr/bin:/bin
# whatever an agent left in /logs (a reward file, made read-only with its directories) goes first
chmod u+rwx /logs 2>/dev/null
chmod -R u+rwX /logs/verifier 2>/dev/null
rm -rf /logs/verifier
mkdir -p /logs/verifier && echo 0 > /logs/verifier/reward.txt || exit 1
cd /
if timeout -k 1 25 python3 -I /tests/checker.py /tests/cases.py 10; then
  echo 1 > /logs/verifier/reward.txt
fi
