#!/bin/bash
mkdir -p /logs/artifacts /app/outdir
echo '{"ok": true}' > /app/report.json
echo kept > /app/outdir/keep.txt; echo dropped > /app/outdir/junk.tmp
echo 42 > /logs/artifacts/answer.txt
touch /app/agent-was-here
