"""The bash harness with a short exec budget, for the fault matrix's "exec timeout" row (tests/test_fault_parity.py).

`eval -a tests.fault_harness:ShortExecBash` (and a cluster worker, which imports it the same way) gives a
tool command without its own ``timeout`` this budget, as the shim's ``exec_timeout`` option does for
``HarborBashEnv`` (TRL's fixed 180 s is too long for a test).
"""

from __future__ import annotations

from harbor_async.harnesses.bash import BashHarness

#: Seconds a tool command may run before it is stopped and the model is told so.
EXEC_TIMEOUT = 2.0


class ShortExecBash(BashHarness):
    """``bash`` whose commands get :data:`EXEC_TIMEOUT` seconds."""

    NAME = "bash"

    def _timeout(self, timeout: float | None) -> float | None:
        return EXEC_TIMEOUT if timeout is None else float(timeout)
