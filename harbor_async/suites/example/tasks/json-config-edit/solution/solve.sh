#!/bin/sh
# Reference solution: edit only the top-level keys (two-space indent) with sed.
set -e
sed -i \
    -e 's/^  "port": 8080,/  "port": 9090,/' \
    -e 's/^  "debug": true,/  "debug": false,/' \
    /workdir/config.json
