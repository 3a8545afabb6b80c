#!/bin/sh
# Reference solution: build the requested tree.
set -e
p=/workdir/project
mkdir -p "$p/src" "$p/tests" "$p/docs" "$p/config"
printf '#!/bin/sh\necho "hello from project"\n' > "$p/src/main.sh"
chmod +x "$p/src/main.sh"
printf '# Project\n\nA scaffolded example project.\n' > "$p/docs/README.md"
printf 'MODE=dev\n' > "$p/config/settings.env"
