#!/bin/sh
# Verifier: /workdir/answer.txt must equal tests/expected.txt (category,total
# lines sorted by category), ignoring trailing whitespace and trailing blank lines.
# Never fails hard: a missing answer scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
here=$(dirname "$0")
expected=$(sed 's/[[:space:]]*$//' "$here/expected.txt")
answer=""
if [ -f /workdir/answer.txt ]; then
    answer=$(sed 's/[[:space:]]*$//' /workdir/answer.txt)
fi
if [ -n "$answer" ] && [ "$answer" = "$expected" ]; then
    echo 1 > /logs/verifier/reward.txt
fi
echo "--- expected"; echo "$expected"; echo "--- got"; echo "$answer"
echo "reward=$(cat /logs/verifier/reward.txt)"
exit 0
