#!/bin/sh
# Reference solution: numeric max over the price column of a ';'-separated file.
awk -F';' 'NR > 1 && (best == "" || $3 + 0 > max) { max = $3 + 0; best = $2 } END { print best }' \
    /workdir/products.csv > /workdir/answer.txt
