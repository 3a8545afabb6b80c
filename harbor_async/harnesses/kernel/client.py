"""harbor-async Python kernel client: run one cell (base64 on stdin), print the outcome."""
import base64
import fcntl
import json
import os
import signal
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOCKET = os.path.join(HERE, "kernel.sock")
SERVER = os.path.join(HERE, "server.py")
PIDFILE = os.path.join(HERE, "kernel.pid")
GRACE = 5.0  # seconds an interrupted cell gets to stop
MAX_OUTPUT = int(os.environ.get("HARBOR_KERNEL_MAX_OUTPUT", "7000"))


def start_kernel():
    """Start the server detached (double fork, own session): it outlives this command.

    Under a lock: two first cells at once start one kernel, not two.
    """
    with open(os.path.join(HERE, "start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return connect()  # another client started it meanwhile
        except OSError:
            return spawn_kernel()


def spawn_kernel():
    for stale in (SOCKET, PIDFILE):
        if os.path.exists(stale):
            os.unlink(stale)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() > 0:
                os._exit(0)
            null = os.open(os.devnull, os.O_RDWR)
            log = os.open(os.path.join(HERE, "kernel.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.execv(sys.executable, [sys.executable, "-u", SERVER, SOCKET])
        finally:
            os._exit(127)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            return connect()
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("the Python kernel did not start; see " + os.path.join(HERE, "kernel.log"))


def connect():
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError:
        conn.close()
        raise
    return conn


def receive_line(conn, deadline):
    """One line from the kernel, or None past the deadline (b"" if it hung up)."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None, data
        conn.settimeout(left)
        try:
            chunk = conn.recv(1 << 20)
        except socket.timeout:
            return None, data
        if not chunk:
            return b"", data
        data += chunk
    return data, b""


def kernel_pid():
    try:
        with open(PIDFILE) as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return None


def shorten(text):
    if len(text) <= MAX_OUTPUT:
        return text
    head, tail = MAX_OUTPUT // 3, MAX_OUTPUT - MAX_OUTPUT // 3
    return text[:head] + "\n... [%d characters omitted] ...\n" % (len(text) - head - tail) + text[-tail:]


def run(code, timeout):
    """Run one cell; return the text for the model."""
    restarted = None
    try:
        conn = connect()
    except OSError:
        if os.path.exists(PIDFILE):
            restarted = ("Note: the Python kernel had stopped and was restarted; "
                         "variables from earlier cells are gone.")
        conn = start_kernel()
    deadline = time.monotonic() + timeout
    hello, _ = receive_line(conn, deadline)  # waits while another cell runs
    if not hello:
        return "Error: the Python kernel is busy (another cell is running) and did not answer within %g s." % timeout
    pid = json.loads(hello)["pid"]
    conn.sendall(json.dumps({"code": code}).encode() + b"\n")
    line, _ = receive_line(conn, deadline)
    timed_out = line is None
    if timed_out:  # past the limit: interrupt the cell, keep the kernel
        for _attempt in range(2):
            os.kill(pid, signal.SIGINT)
            line, _ = receive_line(conn, time.monotonic() + GRACE)
            if line is not None:
                break
        else:  # it does not listen: end it; the next cell starts a new one
            os.kill(pid, signal.SIGKILL)
            return ("Error: the cell ran past its %g s limit and did not stop when interrupted; the Python "
                    "kernel was killed and all variables are lost." % timeout)
    if not line:
        return ("Error: the Python kernel died while running the cell (it is restarted on the next call; "
                "variables are lost).")
    reply = json.loads(line)
    parts = [restarted] if restarted else []
    if reply["output"]:
        parts.append(reply["output"].rstrip("\n"))
    if reply["result"] is not None:
        parts.append(reply["result"])
    if reply["error"]:
        parts.append(reply["error"].rstrip("\n"))
    if reply["interrupted"]:
        parts.append("Error: the cell ran past its %g s limit and was interrupted (KeyboardInterrupt); "
                     "variables defined before it are kept." % timeout if timed_out else "KeyboardInterrupt")
    return "\n".join(parts) if parts else "(no output)"


def main():
    if sys.argv[1:] == ["--start"]:
        try:
            connect().close()
            print("kernel running")
        except OSError:
            start_kernel().close()
            print("kernel started")
        return
    timeout = float(sys.argv[1])
    code = base64.b64decode("".join(sys.stdin.read().split())).decode("utf-8")
    try:
        print(shorten(run(code, timeout)))
    except Exception as exc:
        print("Error: the Python kernel could not run the cell: %s: %s" % (type(exc).__name__, exc))
        sys.exit(1)


main()
