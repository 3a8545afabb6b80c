#!/bin/sh
# Reference solution: relies on the Dockerfile's ENV lines being honoured.
set -e
: "${INVENTORY_FILE:?INVENTORY_FILE is not set}"
: "${LOW_STOCK_THRESHOLD:?LOW_STOCK_THRESHOLD is not set}"
awk -F, -v t="$LOW_STOCK_THRESHOLD" 'NR > 1 && $3 + 0 < t + 0 { n++ } END { print n + 0 }' \
    "$INVENTORY_FILE" > /workdir/answer.txt
