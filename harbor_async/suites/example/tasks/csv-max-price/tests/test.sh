#!/bin/sh
# Verifier: /workdir/answer.txt must hold exactly one line, the product name
# (leading/trailing whitespace ignored).
# Never fails hard: a missing answer scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
expected="Espresso Machine"
answer=""
lines=0
if [ -f /workdir/answer.txt ]; then
    answer=$(sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' /workdir/answer.txt | grep -v '^$')
    lines=$(printf '%s\n' "$answer" | grep -c .)
fi
if [ "$lines" = 1 ] && [ "$answer" = "$expected" ]; then
    echo 1 > /logs/verifier/reward.txt
fi
echo "expected=$expected got=$answer reward=$(cat /logs/verifier/reward.txt)"
exit 0
