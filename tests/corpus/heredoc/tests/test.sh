#!/bin/bash
# the task's shared test: /app/out.txt must hold $EXPECTED, and the heredoc file must exist
if [ "$(cat /app/out.txt)" = "$EXPECTED" ] && [ "$(cat /app/notes.txt)" = "built by a heredoc" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
