/* subreaper CMD [ARGS...]: become a child subreaper, then exec CMD.
 *
 * A zdtm test daemonizes: its first process exits once the test is ready, and the test goes on
 * as an orphan. Under a subreaper the orphan stays in the workload's tree (the tree the agent
 * checkpoints is the init's one child and its descendants) instead of becoming a second child
 * of the container's init. The flag survives execve, so the shell that runs the tests keeps it.
 */
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <sys/prctl.h>

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: subreaper CMD [ARGS...]\n");
        return 2;
    }
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        fprintf(stderr, "subreaper: prctl(PR_SET_CHILD_SUBREAPER): %s\n", strerror(errno));
        return 1;
    }
    execv(argv[1], argv + 1);
    fprintf(stderr, "subreaper: exec %s: %s\n", argv[1], strerror(errno));
    return 127;
}
