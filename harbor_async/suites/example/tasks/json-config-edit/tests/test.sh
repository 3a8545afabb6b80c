#!/bin/sh
# Verifier: /workdir/config.json, with all whitespace removed, must equal
# tests/expected.json with all whitespace removed (same keys, order, values).
# Never fails hard: a missing file scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
here=$(dirname "$0")
expected=$(tr -d '[:space:]' < "$here/expected.json")
answer=""
if [ -f /workdir/config.json ]; then
    answer=$(tr -d '[:space:]' < /workdir/config.json)
fi
if [ "$answer" = "$expected" ]; then
    echo 1 > /logs/verifier/reward.txt
fi
echo "expected=$expected"
echo "got=$answer"
echo "reward=$(cat /logs/verifier/reward.txt)"
exit 0
