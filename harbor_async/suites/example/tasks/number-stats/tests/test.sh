#!/bin/sh
# Verifier with several reward keys, written to /logs/verifier/reward.json:
#   format  - answer.txt is one line "min=<int> max=<int> count=<int>"
#   correct - the three values are right (implies format)
#   reward  - 1.0 only when format and values are both right
# Never fails hard: a missing answer scores 0 on every key.
mkdir -p /logs/verifier
write_reward() {
    printf '{"reward": %s, "format": %s, "correct": %s}\n' "$1" "$2" "$3" > /logs/verifier/reward.json
}
write_reward 0.0 0.0 0.0
expected="min=-19 max=256 count=10"
format=0.0
correct=0.0
answer=""
if [ -f /workdir/answer.txt ]; then
    answer=$(sed 's/[[:space:]]*$//' /workdir/answer.txt | grep -v '^$')
fi
lines=$(printf '%s\n' "$answer" | grep -c .)
if [ "$lines" = 1 ] && printf '%s\n' "$answer" | grep -Eqx 'min=-?[0-9]+ max=-?[0-9]+ count=[0-9]+'; then
    format=1.0
    [ "$answer" = "$expected" ] && correct=1.0
fi
reward=0.0
[ "$format" = 1.0 ] && [ "$correct" = 1.0 ] && reward=1.0
write_reward "$reward" "$format" "$correct"
echo "expected=$expected got=$answer"
cat /logs/verifier/reward.json
exit 0
