"""enter.py SPEC: run a command inside a local sandbox, confined before any sandbox file is loaded.

Started on the host (``python -I -S -B enter.py SPEC``, as root or as the
caller), it does what ``nsenter`` + ``setpriv`` + ``env`` did, in one process
whose code was all loaded from the host before it joined anything. A program
started after joining the sandbox's mount namespace is loaded by the
sandbox's dynamic loader, which reads the sandbox's own ``/etc/ld.so.preload``
and ``/etc/ld.so.cache``: code the sandbox planted would run there with every
capability of its user namespace and before no-new-privs. Here nothing of the
sandbox runs until the final ``execve``, after no-new-privs is set and the
capabilities are the sandbox's own.

SPEC is JSON: ``procs`` (cgroup.procs files to join), ``uid`` (the sandbox's
host uid, or null), ``nproc`` (RLIMIT_NPROC, or null), ``ns`` (namespace name
to the number of an inherited namespace file: user first), ``caps`` (the
capability numbers kept), ``cwd``, ``env``, ``argv``, ``kill`` (the ``cgroup.procs``
of the exec's own cgroup, or null: the command's process moves itself in, so that
one write to that cgroup's ``cgroup.kill`` ends it and all it started while this
process, outside, lives on to reap it); and for a verifier:
``hold`` (mount a fresh tmpfs of ``hold_mb`` at each of those paths in a new
mount namespace, say ``ready``, and wait for stdin to close; no command is run).

Exit codes (as ``env`` and ``nsenter``): 125 could not enter or confine,
126 not executable, 127 not found; else the command's (128 + N for signal N).
``hold`` exits 123 (:data:`NOT_A_FOLDER`) when one of its paths is something
else than a folder in the sandbox (a file, a dangling link: what the agent left).
"""

import _json  # json's C scanner alone: the json package imports re, a third of this helper's start-up per exec
import ctypes
import os
import resource
import sys

_NAMESPACE_FLAGS = {
    "user": os.CLONE_NEWUSER, "mnt": os.CLONE_NEWNS, "uts": os.CLONE_NEWUTS, "ipc": os.CLONE_NEWIPC,
    "net": os.CLONE_NEWNET, "pid": os.CLONE_NEWPID, "cgroup": os.CLONE_NEWCGROUP,
}  # fmt: skip
PR_SET_NAME, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 15, 24, 38, 47, 2
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_S_IFMT, _S_IFDIR = 0o170000, 0o040000
NOT_A_FOLDER = 123  # hold's exit status: a path to hold is not a folder in the sandbox
_ENOENT, _EEXIST, _ENOTDIR, _ELOOP = 2, 17, 20, 40  # errno's values on Linux (no import once joined)
_CAPABILITY_VERSION_3 = 0x20080522

libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def fail(message: str, code: int = 125) -> None:
    os.write(2, f"harbor-async enter: {message}\n".encode(errors="replace"))
    os._exit(code)


def check(result: int, what: str) -> None:
    if result != 0:
        fail(f"{what}: {os.strerror(ctypes.get_errno())}")


def confine(caps: list[int], last: int) -> None:
    """No-new-privs, then only ``caps`` in every set (bounding, permitted, effective, inheritable, ambient)."""
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no-new-privs")
    for cap in range(last + 1):
        if cap not in caps:
            check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    mask = sum(1 << cap for cap in caps)
    data = (_CapData * 2)()
    for i in range(2):
        part = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = data[i].inheritable = part
    check(libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_VERSION_3, 0)), data), "capset")
    for cap in caps:
        check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), f"ambient capability {cap}")


def hold(paths: list[str], size_mb: int) -> None:
    """A mount namespace of the sandbox's where each of ``paths`` is a fresh tmpfs; lives until stdin closes."""
    os.unshare(os.CLONE_NEWNS)
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
    options = f"mode=0755,size={size_mb}m".encode()
    for path in paths:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:  # a file or a dangling link there or above it, a link loop: the sandbox's doing
            if exc.errno in (_ENOENT, _EEXIST, _ENOTDIR, _ELOOP):
                fail(f"{path}: {exc.strerror}", NOT_A_FOLDER)
            raise
        check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), f"mounting {path}")
    hide_preload()
    os.write(1, b"ready\n")
    while os.read(0, 4096):
        pass
    os._exit(0)


def hide_preload() -> None:
    """The loader's preload list reads empty in this namespace: no library the sandbox named runs in the verifier.

    ``/dev/null`` is bound over whatever ``/etc/ld.so.preload`` names (a file,
    or what a link leads to); a folder or nothing there preloads nothing.
    """
    try:
        mode = os.stat("/etc/ld.so.preload").st_mode
    except OSError:
        return
    if mode & _S_IFMT != _S_IFDIR:
        check(libc.mount(b"/dev/null", b"/etc/ld.so.preload", None, MS_BIND, None), "hiding /etc/ld.so.preload")


def execute(argv: list[str], env: dict[str, str]) -> None:
    """``execvpe`` without its lazy imports: search the sandbox's PATH, exit 127 (none) or 126 (not runnable)."""
    name = argv[0]
    folders = [""] if "/" in name else env.get("PATH", "/usr/bin:/bin").split(":")
    missing = True
    for folder in folders:
        try:
            os.execve(f"{folder or '.'}/{name}" if folder or "/" not in name else name, argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            missing = False
            reason = exc.strerror
    if missing:
        fail(f"{name!r}: not found", 127)
    fail(f"{name!r}: {reason}", 126)


class _Decoding:
    """What json's C scanner reads from its decoder: plain JSON, as ``json.loads`` decodes it."""

    strict = True
    object_hook = object_pairs_hook = parse_constant = None
    parse_float, parse_int = float, int


def parse_spec(text: str) -> dict:
    spec, end = _json.make_scanner(_Decoding())(text, 0)  # type: ignore[arg-type]  # duck-typed: the attributes it reads
    if end != len(text) or not isinstance(spec, dict):
        fail("malformed SPEC")
    return spec


def main() -> None:
    run(parse_spec(sys.argv[1]))


def run(spec: dict) -> None:
    """Join, confine and run ``spec``'s command (or hold); exits, never returns (``enter_server.py``'s children too)."""
    libc.prctl(PR_SET_NAME, b"ha-enter", 0, 0, 0)  # what ps and a reaper see
    for procs in spec.get("procs") or []:  # host root, before anything else: every child inherits them
        try:
            with open(procs, "w") as file:
                file.write(str(os.getpid()))
        except OSError as exc:
            fail(f"cannot join {procs}: {exc}")
    kill_group = None
    if spec.get("kill"):  # opened as host root: the kernel checks a move against the opener's rights and namespace
        try:
            kill_group = os.open(spec["kill"], os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            fail(f"cannot open {spec['kill']}: {exc}")
    caps = [int(cap) for cap in spec["caps"]]
    with open("/proc/sys/kernel/cap_last_cap") as file:  # the host's, before joining anything
        last = int(file.read())
    uid = spec.get("uid")
    if uid is not None:  # the sandbox's own host uid (from root; all host capabilities go with it)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if spec.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    namespaces = spec["ns"]
    order = sorted(namespaces, key=lambda name: name != "user")
    # Past this point paths resolve in the sandbox: an import would load a module the
    # sandbox planted at our stdlib's path. Everything is imported; no import may happen.
    sys.meta_path.clear()
    sys.path_hooks.clear()
    sys.path_importer_cache.clear()
    for name in order:  # as the namespace's owner: every capability inside it, none outside
        try:
            os.setns(int(namespaces[name]), _NAMESPACE_FLAGS[name])
        except OSError as exc:
            fail(f"cannot join the sandbox's {name} namespace: {exc}")
        os.close(int(namespaces[name]))
    if spec.get("hold"):
        hold(spec["hold"], int(spec.get("hold_mb") or 64))
    child = os.fork()  # a joined PID namespace takes children only
    if child == 0:
        if kill_group is not None:
            try:
                os.write(kill_group, b"0")  # "0": the writer, whatever its pid in the sandbox
            except OSError as exc:
                fail(f"cannot join the exec's cgroup: {exc}")
        confine(caps, last)
        try:
            os.chdir(spec["cwd"])
        except OSError as exc:
            fail(f"cannot change to {spec['cwd']!r}: {exc.strerror}")
        os.closerange(3, 1 << 16)
        execute(spec["argv"], spec["env"])
    if kill_group is not None:
        os.close(kill_group)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # noqa: BLE001 - no traceback: printing one reads (sandbox) source files
        fail(f"{type(exc).__name__}: {exc}")
