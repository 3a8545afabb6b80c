"""A driver that imported Ray before harbor-async connects it, as a user's program or a trainer may.

Its SIGTERM handler is in place first and the connection is made from another thread, as `run --ray` and
`eval --ray` do (tests/test_cluster_budget.py sends the signal): the process must end by that handler alone.
"""

import signal
import sys
import threading
import time

import ray  # noqa: F401 - imported before harbor_async on purpose

from harbor_async.cluster.connect import ensure_connected

signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
connecting = threading.Thread(target=ensure_connected, args=(sys.argv[1],))
connecting.start()
connecting.join()
print("connected", flush=True)
time.sleep(120)
