"""harbor-async Python kernel: runs cells sent over a unix socket, in one namespace."""
import ast
import json
import linecache
import os
import signal
import socket
import sys
import tempfile
import traceback

HEAD, TAIL, MAX_REPR = 16384, 49152, 20000
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
state = {"in_cell": False, "cells": 0}


def on_sigint(signum, frame):
    # Only a running cell is interrupted; between cells the kernel ignores it.
    if state["in_cell"]:
        raise KeyboardInterrupt


def user_traceback(exc):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # the kernel's own frames are noise
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_cell(code):
    """(repr of the last expression or None, error text or None, interrupted)."""
    state["cells"] += 1
    filename = "<cell %d>" % state["cells"]
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        tail = compile(last, filename, "eval") if last is not None else None
    except (SyntaxError, ValueError) as exc:
        return None, "".join(traceback.format_exception_only(type(exc), exc)), False
    try:
        state["in_cell"] = True
        try:
            exec(body, namespace)
            value = eval(tail, namespace) if tail is not None else None
        finally:
            state["in_cell"] = False
    except KeyboardInterrupt:
        return None, None, True
    except SystemExit as exc:
        return None, "SystemExit: %r (the kernel keeps running; variables are kept)\n" % (exc.code,), False
    except BaseException as exc:
        return None, user_traceback(exc), False
    if value is None:
        return None, None, False
    namespace["_"] = value
    try:
        text = repr(value)
    except BaseException as exc:
        return None, "repr() of the result failed:\n" + user_traceback(exc), False
    if len(text) > MAX_REPR:
        text = text[:MAX_REPR] + "... [repr cut at %d characters]" % MAX_REPR
    return text, None, False


def read_capture(capture):
    size = capture.seek(0, 2)
    capture.seek(0)
    if size <= HEAD + TAIL:
        data = capture.read()
    else:
        head = capture.read(HEAD)
        capture.seek(size - TAIL)
        data = head + b"\n... [%d bytes of output omitted] ...\n" % (size - HEAD - TAIL) + capture.read()
    return data.decode("utf-8", "replace")


def execute(code):
    """Run one cell with fds 1 and 2 sent to a file (subprocess output included)."""
    with tempfile.TemporaryFile() as capture:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(capture.fileno(), 1)
        os.dup2(capture.fileno(), 2)
        try:
            result, error, interrupted = run_cell(code)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        output = read_capture(capture)
    return {"output": output, "result": result, "error": error, "interrupted": interrupted}


def read_line(conn):
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def serve(conn):
    conn.sendall(json.dumps({"pid": os.getpid(), "cells": state["cells"]}).encode() + b"\n")
    request = read_line(conn)
    if not request:
        return
    reply = execute(json.loads(request)["code"])
    conn.sendall(json.dumps(reply).encode() + b"\n")


def main():
    path = sys.argv[1]
    signal.signal(signal.SIGINT, on_sigint)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    with open(os.path.join(os.path.dirname(path), "kernel.pid"), "w") as pidfile:
        pidfile.write(str(os.getpid()))
    while True:
        try:
            conn, _ = server.accept()
        except KeyboardInterrupt:
            continue
        try:
            serve(conn)
        except BaseException:  # a client gone mid-cell, a stray interrupt: keep serving
            pass
        finally:
            conn.close()


main()
