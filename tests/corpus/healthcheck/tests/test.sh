#!/bin/bash
[ "$(cat /app/answer.txt)" = hi ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
