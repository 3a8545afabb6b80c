#!/bin/sh
# Verifier: check the scaffolded tree under /workdir/project.
# Never fails hard: anything missing scores 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
p=/workdir/project
ok=1
fail() { echo "FAIL: $1"; ok=0; }

[ -d "$p" ] || fail "missing $p"
[ -f "$p/src/main.sh" ] || fail "missing src/main.sh"
[ -x "$p/src/main.sh" ] || fail "src/main.sh is not executable"
if [ -x "$p/src/main.sh" ]; then
    out=$(cd /tmp && timeout 5 "$p/src/main.sh" 2>/dev/null)
    [ "$out" = "hello from project" ] || fail "src/main.sh printed '$out'"
fi
[ -d "$p/tests" ] || fail "missing tests/"
if [ -d "$p/tests" ] && [ -n "$(find "$p/tests" -type f | head -n 1)" ]; then
    fail "tests/ is not empty"
fi
first=""
[ -f "$p/docs/README.md" ] && first=$(head -n 1 "$p/docs/README.md")
[ "$first" = "# Project" ] || fail "docs/README.md first line is '$first'"
if ! { [ -f "$p/config/settings.env" ] && grep -qx 'MODE=dev' "$p/config/settings.env"; }; then
    fail "config/settings.env lacks MODE=dev"
fi

[ "$ok" = 1 ] && echo 1 > /logs/verifier/reward.txt
echo "reward=$(cat /logs/verifier/reward.txt)"
exit 0
