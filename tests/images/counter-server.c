/*
 * counter-server: the workload of the end-to-end tests.
 *
 *   counter-server [PORT]      (default 8080, listens on 0.0.0.0)
 *
 * State that a checkpoint/restore must carry over, each visible in the reply to GET /:
 *   - an in-memory request counter and the process id (CRIU restores both);
 *   - /var/lib/counter/state.txt, written at start (the rootfs diff must bring it back);
 *   - /etc/counter/delete-me, deleted at start (the rootfs deletions must be replayed).
 * Once ready it writes `ready-for-checkpoint` into $REKINDLE_CONTROL_DIR. Ready means listening,
 * or, with READY_AFTER_REQUESTS=N (N > 0), having answered N requests to GET / (a client that
 * warms the server up first: its requests then always precede the checkpoint).
 *
 *   GET /        -> "count=<n> pid=<pid> state=<first line of state.txt|missing> deleted=<yes|no>\n"
 *   GET /healthz -> "ok\n"
 *   GET /ready   -> "ready\n" (200) once ready, else "not ready\n" (503): for an HTTP ready probe
 *   GET /verify  -> "warm=<checksum> verify=<ok|bad>\n" (re-reads the warm-up memory)
 *   GET /mapped  -> "mapped=<first line of MAP_FILE, read through its mapping>\n"
 *
 * WARMUP_MIB=N (default 0) makes start-up heavy on purpose, like a model server loading
 * weights: N MiB are filled with a computed pattern (WARMUP_PASSES rounds, default 4) before
 * the server listens. The memory stays live, so a restore must bring back N MiB; /verify
 * proves it came back intact.
 *
 * MAP_FILE=path maps that file read-only and closes it, as a loaded shared library is: the
 * mapping is all that refers to it, and a restore reopens it by path.
 *
 * HTTP/1.0, one request per connection, single-threaded. SIGTERM exits 0. One stdout line per
 * request, so container logs can be checked after a restore. Built static: runs in scratch.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define STATE_DIR "/var/lib/counter"
#define STATE_FILE STATE_DIR "/state.txt"
#define DELETE_ME "/etc/counter/delete-me"

static unsigned long counter;
static unsigned long ready_after; /* READY_AFTER_REQUESTS */
static int ready;
static unsigned char *warm;
static size_t warm_len;
static unsigned long long warm_sum;
static const char *mapped;
static size_t mapped_len;

/* Fill the warm-up memory: several passes of a xorshift stream, so it costs CPU like real
 * start-up work and every page ends up with distinct content. */
static unsigned long long checksum(const unsigned char *p, size_t n)
{
    unsigned long long h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i += 64)
        h = (h ^ *(const unsigned long long *)(p + i)) * 1099511628211ULL;
    return h;
}

static void warm_up(size_t mib, int passes)
{
    warm_len = mib << 20;
    warm = malloc(warm_len);
    if (!warm) {
        perror("counter-server: malloc");
        exit(1);
    }
    unsigned long long x = 88172645463325252ULL;
    for (int pass = 0; pass < passes; pass++)
        for (size_t i = 0; i < warm_len; i += 8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *(unsigned long long *)(warm + i) ^= x;
        }
    warm_sum = checksum(warm, warm_len);
    printf("counter-server: warmed up %zu MiB in %d passes, checksum %016llx\n", mib, passes, warm_sum);
    fflush(stdout);
}

static void on_sigterm(int sig)
{
    (void)sig;
    static const char msg[] = "counter-server: SIGTERM\n";
    ssize_t w = write(STDOUT_FILENO, msg, sizeof(msg) - 1);
    (void)w;
    _exit(0);
}

static void fatal(const char *what)
{
    fprintf(stderr, "counter-server: %s: %s\n", what, strerror(errno));
    exit(1);
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

static void mkdir_p(const char *path)
{
    char buf[PATH_MAX];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0755) < 0 && errno != EEXIST)
                fatal(buf);
            *p = c;
            if (c == '\0')
                break;
        }
    }
}

/* Write path atomically: temp file in the same dir, then rename. */
static void write_file(const char *dir, const char *name, const char *content)
{
    char tmp[PATH_MAX], dst[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s/.%s.tmp", dir, name);
    snprintf(dst, sizeof(dst), "%s/%s", dir, name);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        fatal(tmp);
    if (write_all(fd, content, strlen(content)) < 0 || fsync(fd) < 0)
        fatal(tmp);
    if (close(fd) < 0)
        fatal(tmp);
    if (rename(tmp, dst) < 0)
        fatal(dst);
}

/* First line of STATE_FILE, or "missing". */
static void read_state(char *buf, size_t size)
{
    int fd = open(STATE_FILE, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(buf, size, "missing");
        return;
    }
    size_t len = 0;
    while (len < size - 1) {
        ssize_t n = read(fd, buf + len, size - 1 - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    buf[len] = '\0';
    buf[strcspn(buf, "\r\n")] = '\0';
}

static void reply(int fd, const char *status, const char *body)
{
    char head[256];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.0 %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
                     "Connection: close\r\n\r\n",
                     status, strlen(body));
    /* A client that went away is not our problem (SIGPIPE is ignored). */
    if (write_all(fd, head, (size_t)n) == 0)
        write_all(fd, body, strlen(body));
}

static void map_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || st.st_size == 0)
        fatal("open MAP_FILE");
    mapped_len = (size_t)st.st_size;
    mapped = mmap(NULL, mapped_len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED)
        fatal("mmap MAP_FILE");
    close(fd);
}

static void serve(int fd)
{
    /* Read until the end of the headers; requests come in arbitrary pieces. */
    char req[4096];
    size_t len = 0;
    while (len < sizeof(req) - 1) {
        ssize_t n = read(fd, req + len, sizeof(req) - 1 - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break; /* EOF, error or the receive timeout */
        len += (size_t)n;
        req[len] = '\0';
        if (strstr(req, "\r\n\r\n") || strstr(req, "\n\n"))
            break;
    }
    req[len] = '\0';

    char method[16] = "", path[256] = "";
    if (sscanf(req, "%15s %255s", method, path) != 2) {
        printf("counter-server: bad request (%zu bytes)\n", len);
        reply(fd, "400 Bad Request", "bad request\n");
    } else if (strcmp(method, "GET") != 0) {
        printf("counter-server: %s %s -> 405\n", method, path);
        reply(fd, "405 Method Not Allowed", "method not allowed\n");
    } else if (strcmp(path, "/healthz") == 0) {
        printf("counter-server: GET /healthz -> ok\n");
        reply(fd, "200 OK", "ok\n");
    } else if (strcmp(path, "/ready") == 0) {
        printf("counter-server: GET /ready -> %s\n", ready ? "ready" : "not ready");
        reply(fd, ready ? "200 OK" : "503 Service Unavailable", ready ? "ready\n" : "not ready\n");
    } else if (strcmp(path, "/verify") == 0) {
        char body[128];
        int ok = warm == NULL || checksum(warm, warm_len) == warm_sum;
        snprintf(body, sizeof(body), "warm=%016llx verify=%s\n", warm_sum, ok ? "ok" : "bad");
        printf("counter-server: GET /verify -> %s", body);
        reply(fd, ok ? "200 OK" : "500 Internal Server Error", body);
    } else if (strcmp(path, "/mapped") == 0 && mapped) {
        char body[128];
        size_t n = 0;
        while (n < mapped_len && n < 100 && mapped[n] != '\n')
            n++;
        snprintf(body, sizeof(body), "mapped=%.*s\n", (int)n, mapped);
        printf("counter-server: GET /mapped -> %s", body);
        reply(fd, "200 OK", body);
    } else if (strcmp(path, "/") == 0) {
        char state[200], body[400];
        read_state(state, sizeof(state));
        const char *deleted = access(DELETE_ME, F_OK) < 0 && errno == ENOENT ? "yes" : "no";
        counter++;
        snprintf(body, sizeof(body), "count=%lu pid=%d state=%s deleted=%s\n", counter,
                 (int)getpid(), state, deleted);
        printf("counter-server: GET / -> %s", body);
        reply(fd, "200 OK", body);
    } else {
        printf("counter-server: GET %s -> 404\n", path);
        reply(fd, "404 Not Found", "not found\n");
    }
    fflush(stdout);
}

/* Say ready: from now on a checkpoint may freeze the server at any instant. */
static void become_ready(void)
{
    ready = 1;
    const char *ctl = getenv("REKINDLE_CONTROL_DIR");
    if (ctl != NULL && *ctl != '\0') {
        write_file(ctl, "ready-for-checkpoint", "ready\n");
        printf("counter-server: wrote %s/ready-for-checkpoint\n", ctl);
    } else {
        printf("counter-server: ready\n");
    }
    fflush(stdout);
}

int main(int argc, char **argv)
{
    long port = 8080;
    if (argc > 1) {
        char *end;
        port = strtol(argv[1], &end, 10);
        if (*argv[1] == '\0' || *end != '\0' || port < 1 || port > 65535) {
            fprintf(stderr, "usage: counter-server [PORT]\n");
            return 2;
        }
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigterm;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGTERM, &sa, NULL) < 0)
        fatal("sigaction");
    signal(SIGPIPE, SIG_IGN);

    /* The filesystem changes a restore must reproduce. */
    mkdir_p(STATE_DIR);
    char line[64];
    snprintf(line, sizeof(line), "written-at-start %ld\n", (long)time(NULL));
    write_file(STATE_DIR, "state.txt", line);
    if (unlink(DELETE_ME) < 0 && errno != ENOENT)
        fatal("unlink " DELETE_ME);

    const char *map = getenv("MAP_FILE");
    if (map && *map)
        map_file(map);

    const char *mib = getenv("WARMUP_MIB"), *passes = getenv("WARMUP_PASSES");
    if (mib && atol(mib) > 0)
        warm_up((size_t)atol(mib), passes && atoi(passes) > 0 ? atoi(passes) : 4);

    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0)
        fatal("socket");
    int one = 1;
    if (setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0)
        fatal("setsockopt");
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_port = htons((unsigned short)port);
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(ls, (struct sockaddr *)&addr, sizeof(addr)) < 0)
        fatal("bind");
    if (listen(ls, 64) < 0)
        fatal("listen");
    printf("counter-server: listening on 0.0.0.0:%ld pid %d\n", port, (int)getpid());
    fflush(stdout);

    const char *after = getenv("READY_AFTER_REQUESTS");
    ready_after = after ? strtoul(after, NULL, 10) : 0;
    if (ready_after == 0)
        become_ready();

    for (;;) {
        int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            /* Transient errors (a client reset, EINTR, fd pressure) must not kill the server. */
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE ||
                errno == ENOBUFS || errno == ENOMEM || errno == EPROTO || errno == EPERM) {
                if (errno != EINTR)
                    usleep(10000);
                continue;
            }
            fatal("accept");
        }
        /* One stuck client must not block the single thread forever. */
        struct timeval tv = {5, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        serve(fd);
        close(fd);
        /* After the reply went out and the connection is closed: a checkpoint that follows
         * the ready file finds no request of this client still in flight. */
        if (!ready && counter >= ready_after)
            become_ready();
    }
}
