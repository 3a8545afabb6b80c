"""enter_server.py FD PARENT: a warm ``enter.py``, one per host process, that forks a child per exec.

Started by the host (``python -I -S -B enter_server.py FD PARENT``, from the
keeper thread) with its end of a SOCK_SEQPACKET socket as FD. It dies with
that thread (PR_SET_PDEATHSIG) and when the socket closes. It never joins a
namespace, never opens a sandbox path and never runs sandbox code: all of
``enter.py`` is loaded from the host before the first fork, and each forked
child does exactly what ``enter.py SPEC`` does (cgroups, uid, rlimits, setns,
no-new-privs, capabilities, closerange, execve), so nothing is loaded after
joining either.

A request is one message: the SPEC (JSON, as ``enter.py`` takes it, but with
``ns`` naming indexes into the namespace descriptors) and the descriptors
``[reply, stdin, stdout, stderr, *namespaces]``. The child is a new session
leader named ``ha-enter`` and holds, once forked, stdio and the namespace
files only. On ``reply`` (the host's per-exec channel) the server sends
``pid N`` with a pidfd of the child (opened before it can be reaped), then
``exit CODE`` (negative: killed by that signal); it reaps the child only when
the host closes ``reply``, so the pid names that child as long as the host
may signal it. ``error TEXT``: no child was made.
"""

import os
import select
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's folder off the path
import enter  # noqa: E402 - every line a child runs, loaded from the host before any fork

del sys.path[0]

PR_SET_PDEATHSIG = 1
MAX_FDS = 4 + 16
MAX_REQUEST = 1 << 20
SIGKILL = 9


def child(text: bytes, fds: list[int]) -> None:
    """In the forked child: stdio and namespace files only, then ``enter.run`` (never returns)."""
    try:
        os.setsid()  # its own session and group, as start_new_session gave the helper: the host kills the tree by it
        enter.libc.prctl(enter.PR_SET_NAME, b"ha-enter", 0, 0, 0)
        for target, fd in enumerate(fds[1:4]):
            os.dup2(fd, target)
        namespaces = fds[4:]
        low = 3
        for fd in sorted(namespaces):  # every other descriptor of the server's goes: socket, replies, pidfds
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        spec = enter.parse_spec(text.decode())
        spec["ns"] = {name: namespaces[int(index)] for name, index in spec["ns"].items()}
        enter.run(spec)
    except BaseException as exc:  # noqa: BLE001 - no traceback (see enter.py)
        enter.fail(f"{type(exc).__name__}: {exc}")
    finally:
        os._exit(125)


def send(fd: int, message: bytes, fds: tuple[int, ...] = ()) -> bool:
    with socket.socket(fileno=os.dup(fd)) as channel:
        try:
            socket.send_fds(channel, [message], list(fds))
        except OSError:  # the host closed it
            return False
    return True


def serve(listener: socket.socket) -> None:
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    running: dict[int, tuple[int, int]] = {}  # child's pidfd -> (pid, reply)
    exited: dict[int, int] = {}  # reply -> pid, reaped when the host closes reply
    while True:
        for fd, _events in poller.poll():
            if fd == listener.fileno():
                try:
                    text, fds, _flags, _address = socket.recv_fds(listener, MAX_REQUEST, MAX_FDS)
                except OSError:
                    os._exit(0)
                if not text and not fds:  # the host is gone
                    os._exit(0)
                if len(fds) < 4:
                    for extra in fds:
                        os.close(extra)
                    continue
                try:
                    pid = os.fork()
                except OSError as exc:
                    send(fds[0], f"error {exc}".encode())
                    for extra in fds:
                        os.close(extra)
                    continue
                if pid == 0:
                    child(text, fds)
                pidfd = os.pidfd_open(pid)  # ours, not reaped until the host lets go: cannot be recycled
                for extra in fds[1:]:
                    os.close(extra)
                send(fds[0], b"pid %d" % pid, (pidfd,))
                running[pidfd] = (pid, fds[0])
                poller.register(pidfd, select.POLLIN)
            elif fd in running:  # a child exited: its status now, its zombie until the host closes reply
                pid, reply = running.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status  # type: ignore[union-attr]  # None only with WNOHANG
                if send(reply, b"exit %d" % code):
                    exited[reply] = pid
                    poller.register(reply, select.POLLIN)
                else:
                    os.waitpid(pid, 0)
                    os.close(reply)
            elif fd in exited:  # the host closed reply (or wrote to it): done with that pid
                os.waitpid(exited.pop(fd), 0)
                poller.unregister(fd)
                os.close(fd)


def main() -> None:
    enter.libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # dies with the host's keeper thread
    if os.getppid() != int(sys.argv[2]):  # the host died before the line above
        os._exit(0)
    enter.libc.prctl(enter.PR_SET_NAME, b"ha-enter-srv", 0, 0, 0)
    serve(socket.socket(fileno=int(sys.argv[1])))


if __name__ == "__main__":
    main()
