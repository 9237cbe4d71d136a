/*
 * rekindle-hostexec: run one of the plugin's own programs (CRIU) in a private copy of the
 * host's mount namespace, with the plugin's own loader and libraries.
 *
 *   rekindle-hostexec --mntns-fd N --at DIR --loader PATH --library-path DIRS
 *                     [--mount-proc] [--shims DIR] [--prog NAME=PATH]... -- PROGRAM [ARGS...]
 *
 * Under the chart the plugin runs in a container with its own mount namespace, where bind
 * sources of other containers (the host's driver libraries, hostPath volumes) are not at their
 * host paths; CRIU must see them there. Every path given is a path in the caller's (the
 * plugin's) view. Steps:
 *
 *   1. clone the caller's whole mount tree (open_tree OPEN_TREE_CLONE|AT_RECURSIVE), detached;
 *   2. setns(N) into the host's mount namespace (N: the plugin's fd of /proc/1/ns/mnt, the
 *      plugin shares the host's pid namespace), then unshare a private copy of it
 *      (MS_REC|MS_PRIVATE: nothing done here reaches the host);
 *   3. --mount-proc: a new /proc for the current pid namespace (CRIU runs in the target's);
 *   4. attach the clone at DIR (created on the host if missing: an empty directory), so the
 *      plugin's files are DIR/<path>; /etc/ld.so.preload of the host, if any, is covered by
 *      DIR/dev/null (the host's loader configuration must not reach the plugin's programs);
 *   5. execve DIR/LOADER --inhibit-cache --library-path DIR/<dirs> DIR/PROGRAM ARGS, with PATH
 *      set to DIR/SHIMS only (or empty): nothing of the host's userland is found or run.
 *
 * Programs CRIU runs by name (tar for tmpfs contents, and gzip which tar runs) are reached
 * through PATH: DIR/SHIMS holds links named after them to this binary, which, started under
 * such a name, execs DIR/LOADER with the plugin's program given by --prog NAME=PATH (passed
 * on in the environment). It is built static, so it runs in the host's view without its libs.
 * Any failure exits 126 with the step and errno on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif

#define SELF "rekindle-hostexec"
#define ENV_LOADER "REKINDLE_HOSTEXEC_LOADER"
#define ENV_LIBS "REKINDLE_HOSTEXEC_LIBS"
#define ENV_PROG "REKINDLE_HOSTEXEC_PROG_"
#define MAX_PROGS 16
#define PATH_BYTES 4096

static void die(const char *what) {
    fprintf(stderr, SELF ": %s: %s\n", what, strerror(errno));
    _exit(126);
}

static void fail(const char *fmt, const char *arg) {
    fprintf(stderr, SELF ": ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
    _exit(126);
}

static char *join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 1;
    char *s = malloc(n);
    if (!s)
        die("malloc");
    snprintf(s, n, "%s%s", a, b);
    return s;
}

/* "d1:d2" -> "AT/d1:AT/d2" */
static char *prefix_dirs(const char *at, const char *dirs) {
    size_t n = strlen(dirs) + 1, parts = 1;
    for (const char *p = dirs; *p; p++)
        parts += *p == ':';
    char *out = malloc(n + parts * strlen(at) + 1), *o = out;
    if (!out)
        die("malloc");
    const char *start = dirs;
    for (;;) {
        const char *end = strchr(start, ':');
        size_t len = end ? (size_t)(end - start) : strlen(start);
        o += sprintf(o, "%s%s%.*s", o == out ? "" : ":", at, (int)len, start);
        if (!end)
            break;
        start = end + 1;
    }
    return out;
}

static void check_abs(const char *what, const char *path) {
    if (path[0] != '/')
        fail("%s must be an absolute path", what);
}

/* Started as tar, gzip, ...: the plugin's program of that name, through the plugin's loader. */
static int shim(const char *name, char **argv) {
    const char *loader = getenv(ENV_LOADER), *libs = getenv(ENV_LIBS);
    char key[128];
    snprintf(key, sizeof(key), ENV_PROG "%s", name);
    const char *prog = getenv(key);
    if (!loader || !libs || !prog)
        fail("no program of the plugin's named %s", name);
    int argc = 0;
    while (argv[argc])
        argc++;
    char **args = calloc((size_t)argc + 6, sizeof(char *));
    if (!args)
        die("calloc");
    int i = 0;
    args[i++] = (char *)loader;
    args[i++] = "--inhibit-cache";
    args[i++] = "--library-path";
    args[i++] = (char *)libs;
    args[i++] = (char *)prog;
    for (int j = 1; j < argc; j++)
        args[i++] = argv[j];
    execv(loader, args);
    die(loader);
    return 126;
}

int main(int argc, char **argv) {
    const char *base = strrchr(argv[0], '/');
    base = base ? base + 1 : argv[0];
    if (strcmp(base, SELF) != 0)
        return shim(base, argv);

    int mntns = -1, mount_proc = 0, nprogs = 0, i;
    const char *at = NULL, *loader = NULL, *libs = NULL, *shims = NULL;
    const char *progs[MAX_PROGS];
    for (i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "--mount-proc") == 0) {
            mount_proc = 1;
            continue;
        }
        if (i + 1 >= argc)
            fail("%s needs a value", a);
        const char *v = argv[++i];
        if (strcmp(a, "--mntns-fd") == 0)
            mntns = atoi(v);
        else if (strcmp(a, "--at") == 0)
            at = v;
        else if (strcmp(a, "--loader") == 0)
            loader = v;
        else if (strcmp(a, "--library-path") == 0)
            libs = v;
        else if (strcmp(a, "--shims") == 0)
            shims = v;
        else if (strcmp(a, "--prog") == 0) {
            if (nprogs == MAX_PROGS || !strchr(v, '='))
                fail("bad --prog %s", v);
            progs[nprogs++] = v;
        } else
            fail("unknown option %s", a);
    }
    if (mntns < 0 || !at || !loader || !libs || i >= argc)
        fail("%s", "usage: " SELF " --mntns-fd N --at DIR --loader PATH --library-path DIRS "
                   "[--mount-proc] [--shims DIR] [--prog NAME=PATH]... -- PROGRAM [ARGS...]");
    check_abs("--at", at);
    check_abs("--loader", loader);
    check_abs("PROGRAM", argv[i]);
    if (strlen(at) < 2 || strlen(at) > 256)
        fail("bad --at %s", at);

    /* 1. the plugin's tree, detached, before leaving the plugin's namespace */
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, "/", OPEN_TREE_CLONE | O_CLOEXEC | AT_RECURSIVE);
    if (tree < 0)
        die("open_tree /");
    /* 2. a private copy of the host's namespace */
    if (setns(mntns, CLONE_NEWNS) < 0)
        die("setns host mount namespace");
    close(mntns);
    if (unshare(CLONE_NEWNS) < 0)
        die("unshare mount namespace");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("make / private");
    /* 3. */
    if (mount_proc && mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        die("mount /proc");
    /* 4. */
    if (mkdir(at, 0700) < 0 && errno != EEXIST)
        die(at);
    struct stat st;
    if (lstat(at, &st) < 0)
        die(at);
    if (!S_ISDIR(st.st_mode))
        fail("%s is not a directory", at);
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, at, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        die("move_mount");
    close(tree);
    if (access("/etc/ld.so.preload", F_OK) == 0) {
        char *null = join(at, "/dev/null");
        if (mount(null, "/etc/ld.so.preload", NULL, MS_BIND, NULL) < 0)
            die("cover /etc/ld.so.preload");
        free(null);
    }
    if (chdir("/") < 0)
        die("chdir /");

    /* 5. */
    char *at_loader = join(at, loader), *at_libs = prefix_dirs(at, libs);
    if (setenv("PATH", shims ? join(at, shims) : "", 1) < 0 || setenv(ENV_LOADER, at_loader, 1) < 0
        || setenv(ENV_LIBS, at_libs, 1) < 0)
        die("setenv");
    for (int p = 0; p < nprogs; p++) {
        const char *eq = strchr(progs[p], '=');
        char name[PATH_BYTES];
        snprintf(name, sizeof(name), ENV_PROG "%.*s", (int)(eq - progs[p]), progs[p]);
        check_abs("--prog", eq + 1);
        if (setenv(name, join(at, eq + 1), 1) < 0)
            die("setenv");
    }
    int n = argc - i;
    char **args = calloc((size_t)n + 6, sizeof(char *));
    if (!args)
        die("calloc");
    int k = 0;
    args[k++] = at_loader;
    args[k++] = "--inhibit-cache";
    args[k++] = "--library-path";
    args[k++] = at_libs;
    args[k++] = join(at, argv[i]);
    for (int j = i + 1; j < argc; j++)
        args[k++] = argv[j];
    execv(at_loader, args);
    die(at_loader);
    return 126;
}
