/*
 * rekindle-init: the in-container init of Rekindle.
 *
 *   rekindle-init --mode source|restore [--control DIR] [--timeout SEC]
 *                 [--on-failure cold-start|fail] -- CMD [ARGS...]
 *
 * It runs as PID 1 of a container whose entrypoint the plugin swapped (docs/design.md,
 * "The init"). Duties in both modes: reap every child, forward SIGTERM, SIGINT, SIGHUP,
 * SIGQUIT, SIGUSR1, SIGUSR2 and SIGWINCH to the main child, and exit with the main child's
 * status (exit code, or 128+signal) once it is gone.
 *
 *   source:  fork/exec CMD at once, so the workload is never PID 1 and the checkpointed tree
 *            is rooted at a normal process.
 *   restore: fork nothing (the pids of the checkpointed tree must stay free for CRIU) and poll
 *            the control dir every 50 ms. On `restore-complete`, adopt the pid in `restore-pid`
 *            as the main child. On `restore-failed`, a bad `restore-pid` or the timeout, kill
 *            every other process of the pid namespace, write `cold-start` (content: the reason)
 *            and fork/exec CMD. The decision is taken once and never retried. While the
 *            agent's `rootfs-pending` is there, the rootfs holds a restore's changes that are
 *            still to be rolled back: instead of starting CMD on it, the init exits with
 *            status 1, so that the container is made again from its image.
 *            With `--on-failure fail` (the pod's rekindle.dev/on-restore-failure: fail) there is
 *            no cold start at all: where it would start CMD, the init writes the reason to
 *            stderr (the container log) and exits with status 75 (FAIL_CLOSED_STATUS), and CMD
 *            never runs.
 *
 * Built static with no dependencies, because it is bind-mounted into arbitrary images.
 * Signals are blocked and read from a signalfd, so there is no handler race and no busy loop.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_CONTROL "/rekindle"
#define DEFAULT_TIMEOUT 1800
#define MAX_TIMEOUT 31536000   /* one year; anything larger is a typo */
#define RESTORE_POLL_MS 50     /* control-dir poll period while waiting for a restore */
#define ORPHAN_POLL_MS 100     /* liveness poll of an adopted main pid that is not our child */
#define KILL_REAP_MS 5000      /* how long to reap SIGKILLed processes before the cold start */
#define REAPED_MAX 64          /* reaped pid -> status memory, see remember() */
#define FAIL_CLOSED_STATUS 75  /* a failed restore under --on-failure fail (sysexits' EX_TEMPFAIL:
                                * a restarted container tries the restore again) */

static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH};

static sigset_t orig_mask;  /* restored in the child before exec */
static int sfd = -1;        /* signalfd for SIGCHLD and the forwarded signals */
static pid_t main_pid;      /* 0 until there is a main child */
static int main_is_child;   /* 0 when the adopted pid is not (yet) our child */
static int fail_closed;     /* --on-failure fail: a failed restore never starts CMD */

/* While waiting for a restore, the restored tree is reparented to us and may exit (and be
 * reaped) before `restore-complete` is read; remember recent statuses so we can report them. */
static struct { pid_t pid; int status; } reaped[REAPED_MAX];
static unsigned reaped_next;

static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* One write() per line, so lines from the init and the workload do not interleave. */
static void logmsg(const char *fmt, ...)
{
    char buf[512];
    int n = snprintf(buf, sizeof(buf), "rekindle-init: ");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - n - 1, fmt, ap);
    va_end(ap);
    if (m < 0)
        m = 0;
    n += m;
    if (n > (int)sizeof(buf) - 2)
        n = sizeof(buf) - 2;
    buf[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, n);
    (void)w; /* nowhere to report a failing stderr */
}

static void die(const char *what)
{
    logmsg("fatal: %s: %s", what, strerror(errno));
    exit(1);
}

static void finish(int code)
{
    logmsg("exiting with status %d", code);
    exit(code);
}

static int status_code(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 1;
}

static long long now_ms(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) < 0)
        die("clock_gettime");
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void remember(pid_t pid, int status)
{
    reaped[reaped_next % REAPED_MAX].pid = pid;
    reaped[reaped_next % REAPED_MAX].status = status;
    reaped_next++;
}

/* Most recent status of pid, newest entry first. */
static int lookup_reaped(pid_t pid, int *status)
{
    for (unsigned i = 0; i < REAPED_MAX && i < reaped_next; i++) {
        unsigned k = (reaped_next - 1 - i) % REAPED_MAX;
        if (reaped[k].pid == pid) {
            *status = reaped[k].status;
            return 1;
        }
    }
    return 0;
}

/* Reap every exited child. Exits the init when the main child is among them. */
static void reap_all(void)
{
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            if (pid == main_pid) {
                logmsg("main pid %d exited with status %d", pid, status_code(status));
                finish(status_code(status));
            }
            remember(pid, status);
            continue;
        }
        if (pid == 0 || errno == ECHILD)
            return;
        if (errno != EINTR)
            die("waitpid");
    }
}

/* Drain the signalfd: forward signals to the main child, or act on them while there is none. */
static void handle_signals(void)
{
    struct signalfd_siginfo si;
    for (;;) {
        ssize_t n = read(sfd, &si, sizeof(si));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return;
        if (n != (ssize_t)sizeof(si))
            die("read signalfd");
        int sig = (int)si.ssi_signo;
        if (sig == SIGCHLD)
            continue; /* the caller reaps after every wake-up */
        if (main_pid > 0) {
            if (sig != SIGWINCH)
                logmsg("forwarding signal %d to main pid %d", sig, main_pid);
            if (kill(main_pid, sig) < 0 && errno != ESRCH)
                logmsg("kill(%d, %d): %s", main_pid, sig, strerror(errno));
        } else if (sig == SIGTERM || sig == SIGINT) {
            /* Still waiting for a restore: nothing to forward to, stop now. */
            logmsg("signal %d while waiting for a restore", sig);
            finish(128 + sig);
        } else {
            logmsg("ignoring signal %d: no main process yet", sig);
        }
    }
}

/* Sleep until a signal arrives or timeout_ms passes (-1: no timeout), then handle it. */
static void wait_event(int timeout_ms)
{
    struct pollfd p = {.fd = sfd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) < 0 && errno != EINTR)
        die("poll");
    handle_signals();
    reap_all();
}

static pid_t spawn(char **argv)
{
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        /* The workload must start with the signal mask we were given, not our blocked set. */
        if (sigprocmask(SIG_SETMASK, &orig_mask, NULL) < 0)
            _exit(127);
        /* Its own session, so the workload tree is self-contained: CRIU can dump it without
         * --shell-job, and the restored tree keeps a session inside the container. */
        if (setsid() < 0)
            _exit(127);
        execvp(argv[0], argv);
        int e = errno;
        /* Like a shell: 127 when not found, 126 when found but not executable. */
        dprintf(STDERR_FILENO, "rekindle-init: %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT || e == ENOTDIR ? 127 : 126);
    }
    return pid;
}

static int write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Write dir/name atomically (temp file in the same dir, then rename). Failures are logged
 * only: a read-only control dir must not stop the workload from starting. */
static void write_control(const char *dir, const char *name, const char *content)
{
    char tmp[PATH_MAX], dst[PATH_MAX];
    if (snprintf(tmp, sizeof(tmp), "%s/.%s.tmp.%d", dir, name, (int)getpid()) >= (int)sizeof(tmp) ||
        snprintf(dst, sizeof(dst), "%s/%s", dir, name) >= (int)sizeof(dst)) {
        logmsg("cannot write %s: path too long", name);
        return;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        logmsg("cannot write %s: %s", tmp, strerror(errno));
        return;
    }
    int bad = write_all(fd, content, strlen(content)) < 0 || fsync(fd) < 0;
    int e = errno;
    if (close(fd) < 0 && !bad) {
        bad = 1;
        e = errno;
    }
    if (!bad && rename(tmp, dst) < 0) {
        bad = 1;
        e = errno;
    }
    if (bad) {
        logmsg("cannot write %s: %s", dst, strerror(e));
        if (unlink(tmp) < 0 && errno != ENOENT)
            logmsg("cannot remove %s: %s", tmp, strerror(errno));
    }
}

/* 1 if dir/name exists. Errors other than ENOENT are logged and count as "absent". */
static int control_exists(const char *dir, const char *name)
{
    char path[PATH_MAX];
    struct stat st;
    if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path))
        return 0;
    if (stat(path, &st) == 0)
        return 1;
    if (errno != ENOENT)
        logmsg("stat %s: %s", path, strerror(errno));
    return 0;
}

/* Read the first line of dir/name into buf (at most size-1 bytes), with non-printable bytes
 * replaced, so it can go into a log line. Returns -1 with errno set on failure. */
static int read_control(const char *dir, const char *name, char *buf, size_t size)
{
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = 0;
    while (len < size - 1) {
        ssize_t n = read(fd, buf + len, size - 1 - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            int e = errno;
            close(fd);
            errno = e;
            return -1;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    if (close(fd) < 0)
        return -1;
    buf[len] = '\0';
    buf[strcspn(buf, "\n")] = '\0';
    for (char *p = buf; *p; p++)
        if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e)
            *p = '?';
    return 0;
}

/*
 * `restore-complete` is there: adopt the pid in `restore-pid`. Returns 1 when adopted,
 * 0 with a reason when the restore must be treated as failed; exits when the restored
 * process has already exited (its status is the container's status).
 */
static int adopt(const char *ctl, char *reason, size_t rsize)
{
    char buf[64];
    if (read_control(ctl, "restore-pid", buf, sizeof(buf)) < 0) {
        snprintf(reason, rsize, "restore-complete without a readable restore-pid: %s", strerror(errno));
        return 0;
    }
    size_t len = strlen(buf);
    while (len > 0 && (buf[len - 1] == ' ' || buf[len - 1] == '\r' || buf[len - 1] == '\t'))
        buf[--len] = '\0';
    char *end;
    errno = 0;
    long v = strtol(buf, &end, 10);
    if (len == 0 || buf[0] < '0' || buf[0] > '9' || *end != '\0' || errno != 0 || v < 2 ||
        v > INT_MAX || (pid_t)v == getpid()) {
        snprintf(reason, rsize, "restore-pid is not a usable pid: '%s'", buf);
        return 0;
    }
    pid_t pid = (pid_t)v;
    int status;

    reap_all(); /* so that the reaped table is current */
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
        logmsg("restored pid %d has already exited", pid);
        finish(status_code(status));
    }
    if (r == 0) {
        main_pid = pid;
        main_is_child = 1;
        logmsg("restore complete: adopted main pid %d", pid);
        return 1;
    }
    if (errno != ECHILD)
        die("waitpid restore-pid");
    if (lookup_reaped(pid, &status)) {
        logmsg("restored pid %d had already exited", pid);
        finish(status_code(status));
    }
    if (kill(pid, 0) == 0 || errno == EPERM) {
        /* Alive but parented elsewhere (e.g. CRIU restored it as a sibling of a process
         * outside the namespace): watch it by polling until it becomes our child. */
        main_pid = pid;
        main_is_child = 0;
        logmsg("restore complete: main pid %d is not our child; polling its liveness", pid);
        return 1;
    }
    snprintf(reason, rsize, "restore-pid %d does not exist", pid);
    return 0;
}

/* Wait for the agent's verdict. Returns 1 when a restored process was adopted, 0 with a reason
 * for the cold start otherwise. */
static int wait_for_restore(const char *ctl, int timeout_s, char *reason, size_t rsize)
{
    struct stat st;
    if (stat(ctl, &st) < 0 || !S_ISDIR(st.st_mode)) {
        /* Nobody can ever signal us: do not sit out the timeout. */
        snprintf(reason, rsize, "control dir %s is missing", ctl);
        return 0;
    }
    long long deadline = now_ms() + (long long)timeout_s * 1000;
    for (;;) {
        /* restore-failed wins over restore-complete: the agent gave up on this restore. */
        if (control_exists(ctl, "restore-failed")) {
            char why[256];
            if (read_control(ctl, "restore-failed", why, sizeof(why)) < 0)
                snprintf(why, sizeof(why), "(unreadable: %s)", strerror(errno));
            snprintf(reason, rsize, "restore-failed: %s", why);
            return 0;
        }
        if (control_exists(ctl, "restore-complete"))
            return adopt(ctl, reason, rsize);
        long long left = deadline - now_ms();
        if (left <= 0) {
            snprintf(reason, rsize, "no restore within %d s", timeout_s);
            return 0;
        }
        wait_event(left < RESTORE_POLL_MS ? (int)left : RESTORE_POLL_MS);
    }
}

/* The restore did not happen: clear the namespace, record why, start the original command. */
static void cold_start(const char *ctl, const char *reason, char **cmd)
{
    if (fail_closed) {
        /* Exiting as PID 1 also kills whatever a half-done restore left in the namespace. */
        logmsg("restore failed: %s; not starting the original command (on-restore-failure: fail)", reason);
        finish(FAIL_CLOSED_STATUS);
    }
    if (control_exists(ctl, "rootfs-pending")) {
        /* The agent has not rolled back (or could not roll back) what the restore changed in
         * the rootfs: the original command must never run on a half-restored rootfs. */
        logmsg("no cold start (%s): rootfs-pending, the restore's rootfs changes are not rolled "
               "back; exiting so that the container is made again", reason);
        finish(1);
    }
    logmsg("cold start: %s", reason);
    if (getpid() == 1) {
        /* Leftovers of a half-done restore must not share the container with the workload.
         * Only as PID 1: elsewhere kill(-1) would hit every process we may signal. */
        if (kill(-1, SIGKILL) < 0 && errno != ESRCH)
            logmsg("kill(-1, SIGKILL): %s", strerror(errno));
        long long deadline = now_ms() + KILL_REAP_MS;
        for (;;) {
            int status;
            pid_t pid = waitpid(-1, &status, WNOHANG);
            if (pid > 0)
                continue;
            if (pid < 0 && errno == EINTR)
                continue;
            if (pid < 0 && errno == ECHILD)
                break;
            if (pid < 0)
                die("waitpid");
            if (now_ms() >= deadline) {
                logmsg("some killed processes have not exited yet; going on");
                break;
            }
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    char content[600];
    snprintf(content, sizeof(content), "%s\n", reason);
    write_control(ctl, "cold-start", content);
    main_pid = spawn(cmd);
    main_is_child = 1;
    logmsg("main pid %d (cold start)", main_pid);
}

/* Run until the main child is gone; never returns. */
static void supervise(void)
{
    for (;;) {
        reap_all(); /* exits when the main child was reaped */
        if (!main_is_child) {
            int status;
            pid_t r = waitpid(main_pid, &status, WNOHANG);
            if (r == main_pid) {
                logmsg("main pid %d exited with status %d", main_pid, status_code(status));
                finish(status_code(status));
            } else if (r == 0) {
                logmsg("main pid %d is now our child", main_pid);
                main_is_child = 1;
            } else if (errno != ECHILD) {
                die("waitpid main pid");
            } else if (kill(main_pid, 0) < 0 && errno == ESRCH) {
                /* Its parent reaped it; the status is lost. */
                logmsg("main pid %d is gone; its exit status is unknown", main_pid);
                finish(1);
            }
        }
        wait_event(main_is_child ? -1 : ORPHAN_POLL_MS);
    }
}

static void usage(void)
{
    logmsg("usage: rekindle-init --mode source|restore [--control DIR] [--timeout SEC] "
           "[--on-failure cold-start|fail] -- CMD [ARGS...]");
}

int main(int argc, char **argv)
{
    const char *mode = NULL, *ctl = DEFAULT_CONTROL, *on_failure = "cold-start";
    int timeout_s = DEFAULT_TIMEOUT;
    char **cmd = NULL;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = NULL;
        if (strcmp(a, "--") == 0) {
            cmd = argv + i + 1;
            break;
        }
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage();
            return 0;
        }
        const char *names[] = {"--mode", "--control", "--timeout", "--on-failure"};
        int which = -1;
        for (int k = 0; k < 4; k++) {
            size_t l = strlen(names[k]);
            if (strcmp(a, names[k]) == 0) {
                if (i + 1 >= argc) {
                    logmsg("%s needs a value", a);
                    usage();
                    return 2;
                }
                which = k;
                val = argv[++i];
            } else if (strncmp(a, names[k], l) == 0 && a[l] == '=') {
                which = k;
                val = a + l + 1;
            }
        }
        if (which == 0) {
            mode = val;
        } else if (which == 1) {
            ctl = val;
        } else if (which == 2) {
            char *end;
            errno = 0;
            long t = strtol(val, &end, 10);
            if (*val < '0' || *val > '9' || *end != '\0' || errno != 0 || t < 1 || t > MAX_TIMEOUT) {
                logmsg("--timeout: not a number of seconds in 1..%d: '%s'", MAX_TIMEOUT, val);
                return 2;
            }
            timeout_s = (int)t;
        } else if (which == 3) {
            on_failure = val;
        } else {
            logmsg("unknown argument '%s'", a);
            usage();
            return 2;
        }
    }
    if (mode == NULL || (strcmp(mode, "source") != 0 && strcmp(mode, "restore") != 0)) {
        logmsg("--mode must be source or restore");
        usage();
        return 2;
    }
    if (strcmp(on_failure, "cold-start") != 0 && strcmp(on_failure, "fail") != 0) {
        logmsg("--on-failure must be cold-start or fail");
        usage();
        return 2;
    }
    fail_closed = strcmp(on_failure, "fail") == 0;
    if (cmd == NULL || cmd[0] == NULL || ctl[0] == '\0') {
        logmsg("no command given after --");
        usage();
        return 2;
    }

    /* Block what we handle and read it from a signalfd. Blocked signals are queued even for
     * a pid-namespace init, which would otherwise drop signals left at SIG_DFL. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    for (size_t k = 0; k < sizeof(forwarded) / sizeof(forwarded[0]); k++)
        sigaddset(&set, forwarded[k]);
    if (sigprocmask(SIG_BLOCK, &set, &orig_mask) < 0)
        die("sigprocmask");
    sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0)
        die("signalfd");

    /* Not PID 1 (a test, or a container sharing the pod's pid namespace): become a subreaper
     * so orphans of the workload, and a restored tree, are still reparented to us. */
    if (getpid() != 1 && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
        logmsg("prctl(PR_SET_CHILD_SUBREAPER): %s", strerror(errno));

    logmsg("mode=%s control=%s timeout=%d pid=%d%s", mode, ctl, timeout_s, (int)getpid(),
           fail_closed ? " on-failure=fail" : "");
    if (strcmp(mode, "source") == 0) {
        main_pid = spawn(cmd);
        main_is_child = 1;
        logmsg("main pid %d (source)", main_pid);
    } else {
        char reason[512];
        logmsg("waiting for a restore (timeout %d s)", timeout_s);
        if (!wait_for_restore(ctl, timeout_s, reason, sizeof(reason)))
            cold_start(ctl, reason, cmd);
    }
    supervise();
    return 1; /* not reached */
}
