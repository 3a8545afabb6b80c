/* A library a hostile sandbox names in its own /etc/ld.so.preload to outlive the end of its processes.
 *
 * Loaded into every dynamically linked program started in the sandbox, it acts
 * only in a PID 1 or a child of it: an init started after the agent ran (a keeper restarted over
 * the sandbox's files to end the agent's processes) forks a daemon that marks
 * /tmp/survivor while the tests run. The daemon never returns into the init's code.
 */
#include <stdio.h>
#include <time.h>
#include <unistd.h>

__attribute__((constructor)) static void haunt(void) {
    if ((getpid() != 1 && getppid() != 1) || fork() != 0)
        return;
    setsid();
    struct timespec pause = {0, 20 * 1000 * 1000};
    for (;;) {
        FILE *mark = fopen("/tmp/survivor", "w");
        if (mark) {
            fputs("alive\n", mark);
            fclose(mark);
        }
        nanosleep(&pause, NULL);
    }
}
