/* The crash site: the native frames of a thread that dies of a fatal signal.
 *
 * A rank (or its replay) that faults in native code dies before any Python
 * code can look at it.  This handler writes the faulting thread's native
 * frames to a file descriptor opened in advance, then hands the signal on to
 * the handler it replaced (Python's faulthandler, which writes the Python
 * frames and re-raises), so the process still dies of the same signal: the
 * launcher, the recording and the crash verdict see the real death.
 *
 * Only async-signal-safe calls once the signal has come: write(2),
 * backtrace(3) (its unwinder is loaded in wcs_arm, not in the handler),
 * backtrace_symbols_fd(3), sigaction(2), raise(3).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#define MAX_FRAMES 64

static volatile int out_fd = -1;
static struct sigaction replaced[NSIG];
static const int FATAL[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static int armed;

static void put(const char *s) {
    ssize_t ignored = write(out_fd, s, strlen(s));
    (void)ignored;
}

static void put_hex(unsigned long v) {
    char buf[2 + 16 + 1];
    int i = sizeof buf - 1;
    buf[i] = 0;
    do {
        buf[--i] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v && i > 2);
    buf[--i] = 'x';
    buf[--i] = '0';
    put(buf + i);
}

static void put_dec(int v) {
    char buf[12];
    int i = sizeof buf - 1;
    buf[i] = 0;
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v && i > 0);
    put(buf + i);
}

static void on_fatal(int sig, siginfo_t *info, void *ctx) {
    int saved = errno;
    (void)ctx;
    if (out_fd >= 0) {
        void *frames[MAX_FRAMES];
        int n = backtrace(frames, MAX_FRAMES);
        put("native signal ");
        put_dec(sig);
        put(" address ");
        put_hex((unsigned long)info->si_addr);
        put("\n");
        backtrace_symbols_fd(frames, n, out_fd);
        put("end native\n");
    }
    /* Hand the signal on: the replaced handler runs when this one returns,
     * and a fault that was not raised by a call comes back on the same
     * instruction, to it as well. */
    sigaction(sig, &replaced[sig], NULL);
    errno = saved;
    raise(sig);
}

/* Install the handler (once per process; a fork inherits it), writing to fd. */
int wcs_arm(int fd) {
    void *warm[2];
    backtrace(warm, 2);
    out_fd = fd;
    if (armed)
        return 0;
    for (unsigned i = 0; i < sizeof FATAL / sizeof FATAL[0]; i++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_fatal;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        if (sigaction(FATAL[i], &sa, &replaced[FATAL[i]]) != 0)
            return -1;
    }
    armed = 1;
    return 0;
}
