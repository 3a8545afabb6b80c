#!/bin/bash
[ "$(cat /srv/work/answer.txt)" = "$WANT" ] && [ "$(cat /srv/work/where.txt)" = /srv/work ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
