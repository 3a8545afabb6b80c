/* A library a hostile sandbox plants in its own /etc/ld.so.preload.
 *
 * Every dynamically linked program started in the sandbox loads it first.
 * It appends one line per program to /tmp/preload.log (in the sandbox): the
 * program, its effective capabilities and its no-new-privs flag, so a test
 * can tell whether anything ran before the sandbox's confinement applied.
 * It also tries what the attacker did: write its own text to its
 * stdout when that is a file (a download's host file, if a transfer handed
 * it one).
 */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

__attribute__((constructor)) static void planted(void) {
    char exe[256] = {0}, line[256], caps[64] = "?", nnp[16] = "?";
    if (readlink("/proc/self/exe", exe, sizeof exe - 1) < 0) strcpy(exe, "?");
    FILE *status = fopen("/proc/self/status", "r");
    if (status) {
        while (fgets(line, sizeof line, status)) {
            if (!strncmp(line, "CapEff:", 7)) sscanf(line + 7, "%63s", caps);
            if (!strncmp(line, "NoNewPrivs:", 11)) sscanf(line + 11, "%15s", nnp);
        }
        fclose(status);
    }
    FILE *log = fopen("/tmp/preload.log", "a");
    if (log) {
        fprintf(log, "%s caps=%s nnp=%s\n", exe, caps, nnp);
        fclose(log);
    }
    struct stat out;
    if (fstat(1, &out) == 0 && S_ISREG(out.st_mode)) { /* a file as stdout: a download's host file */
        (void)!write(1, "PLANTED\n", 8);
    }
}
