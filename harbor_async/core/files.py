"""File helpers shared by the local backend and the reaper (standard library only)."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any


def remove_tree(path: Path) -> None:
    """rmtree that also removes what a sandbox made unwritable (chmod 000 folders)."""

    def retry_writable(function: Any, failed: str, _exc: BaseException) -> None:
        parent = os.path.dirname(failed)
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, stat.S_IRWXU)
        function(failed)

    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onexc=retry_writable)
