"""The sandbox's layout: host folders it sees, folders it always has, its environment and capabilities."""

from __future__ import annotations

RUN_LABEL_ENV = "HARBOR_ASYNC_RUN_LABEL"

# Host folders the sandbox sees read-only. /bin, /lib ... are usually symlinks
# into /usr (merged /usr); those are recreated as symlinks, real folders bound.
# /etc is the sandbox's own (see rootfs.py), never the host's.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Docker's default masked paths (an empty read-only tmpfs on folders, /dev/null
# on files) and read-only paths; those the running kernel lacks are skipped.
MASKED_PATHS = (
    "/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys",
    "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
    "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
    # The host's network interfaces (a container's sysfs shows its own namespace's; the sandbox's has only a
    # loopback, which netlink, not sysfs, serves to `ip` and Python's socket.if_nameindex).
    "/sys/class/net", "/sys/devices/virtual/net",
)  # fmt: skip
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
#: Docker's default /dev/shm size.
SHM_SIZE = 64 * 1024 * 1024
#: Default per-sandbox limits (backend keywords and task.toml override them).
DEFAULT_PIDS = 1024
DEFAULT_MEMORY_MB = 4096
DEFAULT_STORAGE_MB = 2048
#: Exec output kept per stream: its first and last halves (the middle is counted, not kept).
DEFAULT_OUTPUT_LIMIT = 1024 * 1024
# Kernel file systems: never a source or target of a file transfer.
SPECIAL_DIRS = ("/proc", "/dev", "/sys")
# Folders every sandbox has, whatever its Dockerfile says.
SANDBOX_DIRS = (
    "tmp", "var/tmp", "run", "root", "home/user", "workdir",
    "logs/agent", "logs/verifier", "logs/artifacts", "tests", "solution",
)  # fmt: skip
# Docker's default capability set, less the ones that could reach the host
# through the writable folder (MKNOD, SETFCAP) and NET_RAW (no network anyway).
# Root with every capability (bwrap's default for root) could remount /usr rw.
SANDBOX_CAPS = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE",
)  # fmt: skip
# Numbers of the capabilities above (linux/capability.h), for the join helper.
CAP_NUMBERS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
    "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10,
    "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19, "CAP_AUDIT_WRITE": 29,
}  # fmt: skip
# The verifier's processes have one capability more than the agent's: the
# kernel lets a process reach another's /proc/PID/root, cwd, fd and memory only
# when its capabilities are a superset of the other's, so no process the agent
# started can reach into the verifier's (private) mount namespace.
VERIFIER_EXTRA_CAPS = ("CAP_SYS_PTRACE",)
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "HOSTNAME": "sandbox",
}
# PID 1 of every sandbox (the keeper's command): it says it is up, then waits
# forever. ``wait`` reaps every child, so orphans of finished execs never stay
# zombies. A namespace's PID 1 gets only the signals it handles from inside:
# SIGKILL and SIGSTOP never, the others are ignored here (a shell in ``wait``
# would die of SIGINT), so nothing in the sandbox can end it by accident.
KEEPER_INIT = (
    "trap '' HUP INT QUIT TERM USR1 USR2 ALRM PIPE; echo ready; exec >/dev/null 2>&1;"
    " while :; do sleep 86400 & wait; done"
)
#: How long the keeper may take to come up (it takes milliseconds).
KEEPER_START_TIMEOUT = 30.0
# Namespaces the keeper may live in; an exec joins each one that differs from
# ours (bwrap makes a user namespace too when it can, even as root).
NAMESPACES = ("user", "mnt", "uts", "ipc", "net", "pid", "cgroup")
# After an exec's shell ended, how long to keep reading what is already in its
# output pipes (bounded: a background process may write without end).
OUTPUT_SETTLE_SEC = 0.1


def under(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``path`` is one of ``prefixes`` or below one."""
    return any(path == p or path.startswith(p + "/") for p in prefixes)
