#!/bin/sh
# Verifier: /workdir/answer.txt must hold the number of rows with quantity < 5.
# The expected value is fixed here (not recomputed from the environment).
# Never fails hard: a missing or malformed answer scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
expected=4
answer=""
if [ -f /workdir/answer.txt ]; then
    answer=$(tr -d '[:space:]' < /workdir/answer.txt)
fi
if [ "$answer" = "$expected" ]; then
    echo 1 > /logs/verifier/reward.txt
fi
echo "expected=$expected got=$answer reward=$(cat /logs/verifier/reward.txt)"
exit 0
