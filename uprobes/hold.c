/* Hold a library load until Watcher has probed the library (an LD_AUDIT module).
 *
 * Probes attached after a library is mapped miss the calls the program makes
 * at once (NCCL's first use is ncclCommInitRank).  The dynamic loader calls
 * la_objopen for every object it maps, before the object's constructors run
 * and before dlopen returns: here, for a library whose file name starts with
 * one of WATCHER_HOLD_LIBS (colon-separated prefixes), the loading thread
 * tells Watcher over the unix socket WATCHER_HOLD_SOCK ("<pid> <path>\n") and
 * waits for one byte back, which Watcher sends once its probes are on the
 * file (uprobes live on the file, so they cover the mapping already made).
 *
 * It fails open: no socket, a refused connection (a replay's sandbox) or no
 * answer within WATCHER_HOLD_TIMEOUT_MS (default 5000) and the load goes on
 * unprobed, never blocked.  Every other object costs one prefix comparison.
 */
#define _GNU_SOURCE
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

static char prefixes[512];
static char sock_path[108];
static int timeout_ms = 5000;

unsigned int la_version(unsigned int version)
{
    const char *p = getenv("WATCHER_HOLD_LIBS");
    const char *s = getenv("WATCHER_HOLD_SOCK");
    const char *t = getenv("WATCHER_HOLD_TIMEOUT_MS");
    if (p && s && strlen(p) < sizeof(prefixes) && strlen(s) < sizeof(sock_path)) {
        strcpy(prefixes, p);
        strcpy(sock_path, s);
    }
    if (t && atoi(t) > 0)
        timeout_ms = atoi(t);
    return version < LAV_CURRENT ? version : LAV_CURRENT;
}

static int wanted(const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    for (const char *p = prefixes; *p;) {
        const char *end = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n && strncmp(base, p, n) == 0)
            return 1;
        if (!end)
            break;
        p = end + 1;
    }
    return 0;
}

static void hold(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strcpy(addr.sun_path, sock_path);
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
        char line[4200];
        int n = snprintf(line, sizeof(line), "%d %s\n", (int)getpid(), path);
        if (n > 0 && n < (int)sizeof(line) && write(fd, line, n) == n) {
            char ack;
            if (read(fd, &ack, 1) < 0) { /* timed out: go on unprobed */ }
        }
    }
    close(fd);
}

unsigned int la_objopen(struct link_map *map, Lmid_t lmid, uintptr_t *cookie)
{
    (void)lmid;
    (void)cookie;
    if (prefixes[0] && map->l_name && map->l_name[0] && wanted(map->l_name))
        hold(map->l_name);
    return 0; /* no symbol binding audit: calls into the object are not slowed */
}
