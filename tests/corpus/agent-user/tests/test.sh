#!/bin/bash
[ "$(cat /tmp/who)" = nobody ] && [ "$(id -un)" = root ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
