"""Which ``harbor_async`` modules importing each named module loads (run as a program, one fresh fork per module).

``python tests/loaded_modules.py MODULE...`` prints a JSON object: module -> the sorted
``harbor_async`` modules in ``sys.modules`` after importing it into an interpreter that
had imported none of them.
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def loaded_by(module: str) -> list[str]:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        importlib.import_module(module)
        with os.fdopen(write, "w") as out:
            json.dump(sorted(name for name in sys.modules if name.startswith("harbor_async")), out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        found = json.loads(got.read() or "null")
    _, status = os.waitpid(child, 0)
    if status != 0 or found is None:
        raise SystemExit(f"importing {module} failed")
    return found


if __name__ == "__main__":
    print(json.dumps({module: loaded_by(module) for module in sys.argv[1:]}))
