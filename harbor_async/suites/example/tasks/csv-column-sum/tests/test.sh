#!/bin/sh
# Verifier: /workdir/answer.txt must hold the total of the amount column
# (a plain decimal number, within half a cent of the gold answer).
# Never fails hard: a missing or malformed answer scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
expected=915.16
answer=""
if [ -f /workdir/answer.txt ]; then
    answer=$(tr -d '[:space:]' < /workdir/answer.txt)
fi
if awk -v a="$answer" -v e="$expected" 'BEGIN {
        if (a !~ /^-?[0-9]+(\.[0-9]+)?$/) exit 1
        d = a - e; if (d < 0) d = -d
        exit !(d < 0.005)
    }'; then
    echo 1 > /logs/verifier/reward.txt
fi
echo "expected=$expected got=$answer reward=$(cat /logs/verifier/reward.txt)"
exit 0
