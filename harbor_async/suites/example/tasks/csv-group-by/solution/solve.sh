#!/bin/sh
# Reference solution: group by category, sum quantity * unit_price.
awk -F, 'NR > 1 { rev[$3] += $4 * $5 } END { for (c in rev) printf "%s,%.2f\n", c, rev[c] }' \
    /workdir/data/orders.csv | sort > /workdir/answer.txt
