#!/bin/sh
# Reference solution: one pass over the non-blank lines.
awk 'NF { v = $1 + 0; if (n == 0 || v < lo) lo = v; if (n == 0 || v > hi) hi = v; n++ }
     END { printf "min=%d max=%d count=%d\n", lo, hi, n }' /workdir/numbers.txt > /workdir/answer.txt
