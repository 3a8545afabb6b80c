#!/bin/sh
# Reference solution: count *.log files under /workdir/logs.
find /workdir/logs -type f -name '*.log' | wc -l | tr -d ' ' > /workdir/answer.txt
