#!/bin/sh
# Reference solution: keep lines whose third field is exactly ERROR.
awk '$3 == "ERROR"' /workdir/app.log > /workdir/answer.txt
