/* An agent's way past a process kill that keeps the container's main command.
 *
 * `inject PID COMMAND` attaches to PID (the main command, `sleep infinity`)
 * with ptrace (the same uid: Docker's default profile allows it), makes it
 * fork, and turns the child into `/bin/sh -c COMMAND`: a daemon that is the
 * main command's child, which a kill that spares the main command's
 * descendants spares too. The main command goes on as before. x86-64 only.
 * Built static by the test on the host and copied into the sandbox.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/user.h>
#include <sys/wait.h>

static void die(const char *what) {
    perror(what);
    exit(1);
}

/* Copy `len` bytes into the tracee at `addr`, a word at a time. */
static void poke(pid_t pid, unsigned long addr, const void *data, size_t len) {
    for (size_t i = 0; i < len; i += sizeof(long)) {
        long word = 0;
        memcpy(&word, (const char *)data + i, len - i < sizeof(long) ? len - i : sizeof(long));
        if (ptrace(PTRACE_POKEDATA, pid, addr + i, word) < 0) die("poke");
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: inject PID COMMAND\n");
        return 2;
    }
    pid_t pid = atoi(argv[1]);
    int status;
    if (ptrace(PTRACE_ATTACH, pid, 0, 0) < 0) die("attach");
    if (waitpid(pid, &status, 0) < 0) die("waitpid");
    struct user_regs_struct saved, regs;
    if (ptrace(PTRACE_GETREGS, pid, 0, &saved) < 0) die("getregs");
    /* A `syscall` instruction at the current instruction pointer (restored after). */
    unsigned long at = saved.rip;
    long text = ptrace(PTRACE_PEEKTEXT, pid, at, 0);
    if (ptrace(PTRACE_POKETEXT, pid, at, (text & ~0xffffL) | 0x050f) < 0) die("poketext");
    if (ptrace(PTRACE_SETOPTIONS, pid, 0, PTRACE_O_TRACEFORK) < 0) die("setoptions");
    regs = saved;
    regs.rax = SYS_fork;
    regs.rip = at;
    if (ptrace(PTRACE_SETREGS, pid, 0, &regs) < 0) die("setregs");
    if (ptrace(PTRACE_SINGLESTEP, pid, 0, 0) < 0) die("step");
    pid_t child = 0;
    for (;;) {  /* the fork event, then the parent back from its syscall */
        if (waitpid(pid, &status, 0) < 0) die("waitpid fork");
        if (status >> 8 == (SIGTRAP | (PTRACE_EVENT_FORK << 8))) {
            unsigned long message;
            ptrace(PTRACE_GETEVENTMSG, pid, 0, &message);
            child = (pid_t)message;
            ptrace(PTRACE_SINGLESTEP, pid, 0, 0);
            continue;
        }
        break;
    }
    if (child <= 0) die("no child");
    if (waitpid(child, &status, __WALL) < 0) die("waitpid child");
    /* The parent: its text and registers as they were, then let go. */
    ptrace(PTRACE_POKETEXT, pid, at, text);
    ptrace(PTRACE_SETREGS, pid, 0, &saved);
    ptrace(PTRACE_DETACH, pid, 0, 0);
    /* The child (its own copy still holds the `syscall`): execve("/bin/sh", {"sh", "-c", COMMAND}, NULL). */
    struct user_regs_struct c;
    if (ptrace(PTRACE_GETREGS, child, 0, &c) < 0) die("child getregs");
    unsigned long base = (c.rsp - 65536) & ~0xfUL;
    const char *shell = "/bin/sh", *dash_c = "-c";
    size_t command_len = strlen(argv[2]) + 1;
    unsigned long s_shell = base, s_c = base + 16, s_command = base + 32;
    unsigned long s_argv = (s_command + command_len + 15) & ~0xfUL;
    poke(child, s_shell, shell, strlen(shell) + 1);
    poke(child, s_c, dash_c, strlen(dash_c) + 1);
    poke(child, s_command, argv[2], command_len);
    unsigned long vector[4] = {s_shell, s_c, s_command, 0};
    poke(child, s_argv, vector, sizeof vector);
    c.rax = SYS_execve;
    c.rdi = s_shell;
    c.rsi = s_argv;
    c.rdx = 0;
    c.rip = at;
    c.rsp = base - 4096;
    if (ptrace(PTRACE_SETREGS, child, 0, &c) < 0) die("child setregs");
    if (ptrace(PTRACE_DETACH, child, 0, 0) < 0) die("child detach");
    printf("%d\n", child);
    return 0;
}
