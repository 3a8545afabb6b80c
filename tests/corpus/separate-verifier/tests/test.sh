#!/bin/bash
# a fresh sandbox: the agent's files are not there, its artifacts are
if [ "$(cat /logs/artifacts/answer.txt)" = 42 ] && [ -f /app/report.json ] && [ ! -e /app/agent-was-here ] \
   && [ -f /app/outdir/keep.txt ] && [ ! -e /app/outdir/junk.tmp ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
