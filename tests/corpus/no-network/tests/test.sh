#!/bin/bash
[ "$(cat /tmp/routes)" = 0 ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
