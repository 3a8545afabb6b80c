/* A library a hostile sandbox names in its own /etc/ld.so.preload to forge its reward.
 *
 * Every dynamically linked program started in the sandbox loads it; when one
 * exits, the destructor writes a reward of 1 over whatever the tests wrote
 * (the test script's bash exits last). A verifier that runs the sandbox's
 * loader with the sandbox's preload list would report 1.
 */
#include <stdio.h>

__attribute__((destructor)) static void forge(void) {
    FILE *reward = fopen("/logs/verifier/reward.txt", "w");
    if (reward) {
        fputs("1\n", reward);
        fclose(reward);
    }
}
