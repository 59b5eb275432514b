/* Watcher's OS-level recorder: syscalls, futex waits and wakes, process
 * lifecycle and signals of one process tree.
 *
 * Policies run here, not in the collector:
 *   - only tgids in `traced` are recorded; the set follows fork;
 *   - per-thread per-syscall counts and total time are always exact (`syscall_stats`);
 *   - idle epoll_wait/poll/select calls (timed out, or ready without blocking)
 *     and socket transfers that did not block are counted, not logged;
 *   - futex calls go to their own ring with wait/wake pairing, not to the syscall ring;
 *   - a failed ring reservation is counted per CPU in `drops`, never silent.
 *
 * Compile-time switches (set by bpf/recorder.py): PROBE_SYSCALL, PROBE_FUTEX,
 * PROBE_PROC, PROBE_SIGNAL, LOG_IDLE_POLLS, LOG_QUICK_SOCKET_IO, POLL_LOG_MIN_NS, PID_MAX, RING_PAGES_*,
 * API_ROWS (library-call probes: the loader appends uprobes/api.bpf.c to this
 * file's text, since bcc rewrites map calls only in the main source).
 */
#include <uapi/linux/ptrace.h>
#include "events.h"

#define NR_POLL 7
#define NR_OPEN_FILE 2  /* open(2); NR_OPEN is taken by linux/limits.h */
#define NR_CREAT 85
#define NR_OPENAT 257
#define NR_OPENAT2 437
#define NR_SELECT 23
#define NR_WAIT4 61
#define NR_EXECVE 59
#define NR_FUTEX 202
#define NR_EXECVEAT 322
#define NR_EXIT 60
#define NR_EXIT_GROUP 231
#define NR_EPOLL_WAIT 232
#define NR_WAITID 247
#define NR_PSELECT6 270
#define NR_PPOLL 271
#define NR_EPOLL_PWAIT 281
#define NR_EPOLL_PWAIT2 441
#define NR_URETPROBE 335
#define NR_SENDTO 44
#define NR_RECVFROM 45
#define NR_SENDMSG 46
#define NR_RECVMSG 47
#define NR_RECVMMSG 299
#define NR_SENDMMSG 307

#define WATCH_CLONE_THREAD 0x00010000ULL

struct inflight_t {
    u64 ts;
    u64 args[6];
    s64 aux;        /* futex waits: timeout ns (-1 none) */
    u32 nr;
    u32 have_args;  /* args[] was filled at entry */
};

struct stat_key_t {
    u32 pid;
    u32 tid;
    u32 nr;
    u32 pad;
};

struct stat_val_t {
    u64 count;      /* every completed call */
    u64 dur;        /* total ns over every call */
    u64 logged;     /* calls written to a ring */
    u64 idle;       /* idle polls counted, not logged */
};

struct waker_t {
    u64 ts;
    u32 tid;
    u32 pad;
};

struct exec_args_t {
    char argv[ARGV_SLOTS][ARGV_SLOT_LEN];
};

/* The traced set, indexed by tgid: an array lookup is inlined by the
 * verifier, where a hash lookup on every syscall of the machine is not. */
BPF_ARRAY(traced, u8, PID_MAX);
BPF_HASH(inflight, u32, struct inflight_t, 65536);
BPF_HASH(syscall_stats, struct stat_key_t, struct stat_val_t, 131072);
BPF_TABLE("lru_hash", u32, struct waker_t, wakers, 65536);
BPF_HASH(exit_status, u32, s32, 65536);
/* Last default-fatal signal sent to a traced process: the kernel turns a
 * fatal non-core signal into SIGKILL for every thread, so delivery alone
 * would report SIGKILL for a SIGTERM. */
BPF_HASH(pending_fatal, u32, s32, 65536);
BPF_HASH(exec_args, u32, struct exec_args_t, 1024);
BPF_PERCPU_ARRAY(exec_scratch, struct exec_args_t, 1);
BPF_PERCPU_ARRAY(drops, u64, RING_COUNT);
BPF_ARRAY(stat_overflow, u64, 1);

BPF_RINGBUF_OUTPUT(syscall_ring, RING_PAGES_SYSCALL);
BPF_RINGBUF_OUTPUT(futex_ring, RING_PAGES_FUTEX);
BPF_RINGBUF_OUTPUT(proc_ring, RING_PAGES_PROC);
BPF_RINGBUF_OUTPUT(signal_ring, RING_PAGES_SIGNAL);
BPF_RINGBUF_OUTPUT(file_ring, RING_PAGES_FILE);

/* x86_64 pt_regs holds r10, r9, r8, ax, cx, dx, si, di contiguously: one
 * read gets all six syscall arguments (di si dx r10 r8 r9). */
static __always_inline void read_args(struct pt_regs *regs, u64 *out)
{
    u64 w[8] = {};
    bpf_probe_read_kernel(&w, sizeof(w), &regs->r10);
    out[0] = w[7];
    out[1] = w[6];
    out[2] = w[5];
    out[3] = w[0];
    out[4] = w[2];
    out[5] = w[1];
}

static __always_inline void count_drop(int ring)
{
    int key = ring;
    u64 *v = drops.lookup(&key);
    if (v)
        (*v)++;
}

static __always_inline int is_traced(u32 tgid)
{
    u8 *t = traced.lookup(&tgid);
    return t && *t;
}

static __always_inline void set_traced(u32 tgid, u8 on)
{
    u8 *t = traced.lookup(&tgid);
    if (t)
        *t = on;
}

static __always_inline int futex_cmd(u64 op)
{
    return op & 0x7f;  /* strip FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME */
}

static __always_inline int futex_is_wait(int cmd)
{
    /* WAIT, LOCK_PI, TRYLOCK_PI, WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2 */
    return cmd == 0 || cmd == 6 || cmd == 8 || cmd == 9 || cmd == 11 || cmd == 13;
}

static __always_inline int futex_is_wake(int cmd)
{
    /* WAKE, REQUEUE, CMP_REQUEUE, WAKE_OP, UNLOCK_PI, WAKE_BITSET, CMP_REQUEUE_PI */
    return cmd == 1 || cmd == 3 || cmd == 4 || cmd == 5 || cmd == 7 || cmd == 10 || cmd == 12;
}

/* Poll-class calls that timed out with nothing (ret 0), or that returned
 * ready without blocking for POLL_LOG_MIN_NS, are counted, not logged: gloo's
 * transport threads spin on epoll_wait at ~25k calls/s per rank, each
 * returning one ready fd in under a microsecond.  A poll that blocked, or
 * failed, is logged: that is where a thread waited. */
static __always_inline int is_idle_poll(u32 nr, s64 ret, u64 dur)
{
    if (ret < 0 || (ret > 0 && dur >= POLL_LOG_MIN_NS))
        return 0;
    return nr == NR_EPOLL_WAIT || nr == NR_EPOLL_PWAIT || nr == NR_EPOLL_PWAIT2 ||
           nr == NR_POLL || nr == NR_PPOLL || nr == NR_SELECT || nr == NR_PSELECT6;
}

/* Socket transfers that returned within POLL_LOG_MIN_NS having moved data,
 * or with EAGAIN (a non-blocking socket with nothing to read), are counted,
 * not logged: gloo's transport thread reads each message with recvfrom
 * calls that return at once, the last one with EAGAIN (~1,100 calls/s on the
 * reference job, half of all rows).  A transfer that blocked, failed
 * otherwise or met end-of-stream (ret 0) is logged: that is where a thread
 * waited or a peer went away. */
#define EAGAIN_RET (-11)
static __always_inline int is_quick_socket_io(u32 nr, s64 ret, u64 dur)
{
    if ((ret <= 0 && ret != EAGAIN_RET) || dur >= POLL_LOG_MIN_NS)
        return 0;
    return nr == NR_SENDTO || nr == NR_RECVFROM || nr == NR_SENDMSG || nr == NR_RECVMSG ||
           nr == NR_RECVMMSG || nr == NR_SENDMMSG;
}

/* Writes one syscall row; `args` NULL means read them from the registers
 * (only logged calls pay for that read).  Returns 1 if queued. */
static __always_inline int emit_syscall(u64 ts, u64 dur, u32 tgid, u32 tid, s64 ret, u32 nr,
                                        u64 *args, struct pt_regs *regs)
{
    struct syscall_event *e = syscall_ring.ringbuf_reserve(sizeof(struct syscall_event));
    if (!e) {
        count_drop(RING_SYSCALL);
        return 0;
    }
    e->ts = ts;
    e->dur = dur;
    e->pid = tgid;
    e->tid = tid;
    e->ret = ret;
    if (args) {
        #pragma unroll
        for (int i = 0; i < 6; i++)
            e->args[i] = args[i];
    } else {
        read_args(regs, e->args);
    }
    e->nr = nr;
    e->cpu = bpf_get_smp_processor_id();
    syscall_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 1;
}

/* An open-family call, with its path: which files a job opened (a dataset,
 * a checkpoint) is a question syscall numbers alone cannot answer.  The
 * path is read at exit: the caller's buffer is still there. */
static __always_inline void emit_file(u64 ts, u64 dur, u32 tgid, u32 tid, s64 ret, u32 nr,
                                      struct pt_regs *regs)
{
    u64 a[6] = {};
    read_args(regs, a);
    struct file_event *e = file_ring.ringbuf_reserve(sizeof(struct file_event));
    if (!e) {
        count_drop(RING_FILE);
        return;
    }
    e->ts = ts;
    e->dur = dur;
    e->pid = tgid;
    e->tid = tid;
    e->ret = ret;
    e->nr = nr;
    u64 path = nr == NR_OPEN_FILE || nr == NR_CREAT ? a[0] : a[1];
    if (nr == NR_OPEN_FILE)
        e->flags = a[1];
    else if (nr == NR_CREAT)
        e->flags = 01 | 0100 | 01000;  /* O_WRONLY | O_CREAT | O_TRUNC */
    else if (nr == NR_OPENAT)
        e->flags = a[2];
    else {
        u64 how = 0;  /* struct open_how: flags first */
        bpf_probe_read_user(&how, sizeof(how), (void *)a[2]);
        e->flags = how;
    }
    if (bpf_probe_read_user_str(e->path, sizeof(e->path), (void *)path) < 0)
        e->path[0] = 0;
    file_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

static __always_inline struct stat_val_t *stat_slot(u32 tgid, u32 tid, u32 nr)
{
    struct stat_key_t key = {.pid = tgid, .tid = tid, .nr = nr};
    struct stat_val_t *v = syscall_stats.lookup(&key);
    if (v)
        return v;
    struct stat_val_t zero = {};
    if (syscall_stats.update(&key, &zero) != 0) {
        int k = 0;
        u64 *o = stat_overflow.lookup(&k);
        if (o)
            __sync_fetch_and_add(o, 1);
        return 0;
    }
    return syscall_stats.lookup(&key);
}

static __always_inline void emit_proc(u32 kind, u32 pid, u32 tid, u32 ppid, u32 ptid,
                                      s32 code, u64 flags)
{
#if PROBE_PROC
    struct proc_event *e = proc_ring.ringbuf_reserve(sizeof(struct proc_event));
    if (!e) {
        count_drop(RING_PROC);
        return;
    }
    e->ts = bpf_ktime_get_ns();
    e->kind = kind;
    e->pid = pid;
    e->tid = tid;
    e->ppid = ppid;
    e->ptid = ptid;
    e->code = code;
    e->flags = flags;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    e->filename[0] = 0;
    e->argv[0][0] = 0;
    proc_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
#endif
}

/* Raw tracepoints, not perf tracepoints: on this class of VM the perf path
 * costs ~170 ns per event on every syscall of the whole machine, the raw
 * path a fraction of that.  Arguments come from the saved user registers. */
RAW_TRACEPOINT_PROBE(sys_enter)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    u32 nr = ctx->args[1];
    u64 now = bpf_ktime_get_ns();
    u64 sargs[6] = {};

    if (nr == NR_EXIT || nr == NR_EXIT_GROUP) {
        /* These never return: count them here. */
        read_args(regs, sargs);
        struct stat_val_t *s = stat_slot(tgid, tid, nr);
        if (s)
            s->count++;
        if (nr == NR_EXIT_GROUP) {
            s32 status = (s32)((sargs[0] & 0xff) << 8);
            exit_status.update(&tgid, &status);
        }
#if PROBE_SYSCALL
        if (emit_syscall(now, 0, tgid, tid, 0, nr, sargs, regs) && s)
            s->logged++;
#endif
        return 0;
    }

    /* One slot per thread, reused for every call: an in-place write is far
     * cheaper than inserting and deleting a hash entry per syscall. */
    struct inflight_t *in = inflight.lookup(&tid);
    if (!in) {
        struct inflight_t zero = {};
        inflight.update(&tid, &zero);
        in = inflight.lookup(&tid);
        if (!in)
            return 0;
    }
    in->nr = nr;
    in->aux = -1;
    /* Arguments are read at exit, from the same registers, and only when the
     * call is logged; futex (needed by sched_waking while the call runs) and
     * exec (whose registers are replaced on success) are read now. */
    in->have_args = nr == NR_FUTEX || nr == NR_EXECVE || nr == NR_EXECVEAT;
    if (in->have_args)
        read_args(regs, in->args);
    if (nr == NR_FUTEX && futex_is_wait(futex_cmd(in->args[1])) && in->args[3]) {
        s64 tsp[2] = {};
        if (bpf_probe_read_user(&tsp, sizeof(tsp), (void *)in->args[3]) == 0)
            in->aux = tsp[0] * 1000000000LL + tsp[1];
    }
    in->ts = now;  /* last: marks the slot live */
    return 0;
}

RAW_TRACEPOINT_PROBE(sys_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    struct inflight_t *in = inflight.lookup(&tid);
    if (!in || in->ts == 0)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u32 nr = in->nr;
    s64 ret = (s64)ctx->args[1];
    u64 dur = now - in->ts;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];

    struct stat_val_t *s = stat_slot(tgid, tid, nr);
    /* Keyed by thread: only this thread writes the slot, no atomics needed. */
    if (s) {
        s->count++;
        s->dur += dur;
    }

    /* A traced parent reaped a child: the authoritative exit status.
     * wait4 returns the child's pid; waitid returns 0 and fills a siginfo. */
    if ((nr == NR_WAIT4 && ret > 0) || (nr == NR_WAITID && ret == 0)) {
        read_args(regs, in->args);
        in->have_args = 1;
        s32 status = -1;
        u32 child = 0;
        if (nr == NR_WAIT4) {
            child = ret;
            if (!in->args[1] || bpf_probe_read_user(&status, sizeof(status), (void *)in->args[1]))
                status = -1;  /* NULL status pointer: nothing to learn */
        } else {
            s32 si[7] = {};
            /* si_code CLD_EXITED=1 carries an exit code, CLD_KILLED=2/CLD_DUMPED=3 a signal */
            if (in->args[2] && bpf_probe_read_user(&si, sizeof(si), (void *)in->args[2]) == 0 &&
                si[4] != 0 && si[2] >= 1 && si[2] <= 3) {
                child = si[4];
                status = si[2] == 1 ? ((si[6] & 0xff) << 8) : (si[6] & 0x7f);
            }
        }
        if (child && status != -1)
            emit_proc(PROC_REAP, tgid, child, tgid, tid, status, 0);
    }

    if (nr == NR_FUTEX) {
        int cmd = futex_cmd(in->args[1]);
        int wait = futex_is_wait(cmd);
        int wake = futex_is_wake(cmd);
        if (!wait && !(wake && ret != 0)) {
            /* a wake that woke nobody: counted above, not logged */
            in->ts = 0;
            return 0;
        }
#if PROBE_FUTEX
        struct futex_event *f = futex_ring.ringbuf_reserve(sizeof(struct futex_event));
        if (!f) {
            count_drop(RING_FUTEX);
            in->ts = 0;
            return 0;
        }
        f->ts = in->ts;
        f->dur = dur;
        f->pid = tgid;
        f->tid = tid;
        f->uaddr = in->args[0];
        f->ret = ret;
        f->op = in->args[1];
        f->val = in->args[2];
        f->kind = wait ? FUTEX_KIND_WAIT : FUTEX_KIND_WAKE;
        f->timeout_ns = wait ? in->aux : -1;
        f->waker_tid = 0;
        f->wake_ts = 0;
        if (wait) {
            struct waker_t *w = wakers.lookup(&tid);
            if (w) {
                if (w->ts >= in->ts) {
                    f->waker_tid = w->tid;
                    f->wake_ts = w->ts;
                }
                wakers.delete(&tid);
            }
        }
        futex_ring.ringbuf_submit(f, BPF_RB_NO_WAKEUP);
        if (s)
            s->logged++;
#endif
        in->ts = 0;
        return 0;
    }

    /* uretprobe(2) is the kernel's return-probe trampoline: our own library
     * probes cause it.  Counted (in idle_skipped), never logged. */
    if (nr == NR_URETPROBE || (!LOG_IDLE_POLLS && is_idle_poll(nr, ret, dur)) ||
        (!LOG_QUICK_SOCKET_IO && is_quick_socket_io(nr, ret, dur))) {
        if (s)
            s->idle++;
        in->ts = 0;
        return 0;
    }

#if PROBE_FILE
    if (nr == NR_OPENAT || nr == NR_OPEN_FILE || nr == NR_OPENAT2 || nr == NR_CREAT)
        emit_file(in->ts, dur, tgid, tid, ret, nr, regs);
#endif

#if PROBE_SYSCALL
    if (emit_syscall(in->ts, dur, tgid, tid, ret, nr, in->have_args ? in->args : 0, regs) && s)
        s->logged++;
#endif
    in->ts = 0;
    return 0;
}

/* Runs in the waker's context: if the waker is inside a futex wake, remember
 * who woke whom so the wait can be joined to the wake that ended it. */
TRACEPOINT_PROBE(sched, sched_waking)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct inflight_t *in = inflight.lookup(&tid);
    if (!in || in->ts == 0 || in->nr != NR_FUTEX || !futex_is_wake(futex_cmd(in->args[1])))
        return 0;
    u32 wakee = args->pid;
    struct waker_t w = {.ts = in->ts, .tid = tid};
    wakers.update(&wakee, &w);
    return 0;
}

TRACEPOINT_PROBE(task, task_newtask)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    u32 child = args->pid;
    if (args->clone_flags & WATCH_CLONE_THREAD) {
        emit_proc(PROC_THREAD, tgid, child, tgid, tid, 0, args->clone_flags);
    } else {
        set_traced(child, 1);
        emit_proc(PROC_FORK, child, child, tgid, tid, 0, args->clone_flags);
    }
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_execve)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    int zero = 0;
    struct exec_args_t *a = exec_scratch.lookup(&zero);
    if (!a)
        return 0;
    const char *const *argv = (const char *const *)args->argv;
    #pragma unroll
    for (int i = 0; i < ARGV_SLOTS; i++) {
        const char *p = 0;
        a->argv[i][0] = 0;
        if (argv && bpf_probe_read_user(&p, sizeof(p), &argv[i]) == 0 && p)
            bpf_probe_read_user_str(a->argv[i], ARGV_SLOT_LEN, p);
        else
            argv = 0;
    }
    exec_args.update(&tid, a);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
#if PROBE_PROC
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    struct proc_event *e = proc_ring.ringbuf_reserve(sizeof(struct proc_event));
    if (!e) {
        count_drop(RING_PROC);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->kind = PROC_EXEC;
    e->pid = tgid;
    e->tid = tid;
    e->ppid = 0;
    e->ptid = args->old_pid;
    e->code = 0;
    e->flags = 0;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    TP_DATA_LOC_READ_STR(e->filename, filename, sizeof(e->filename));
    /* exec may run on another thread id (old_pid) than the one that called execve */
    u32 caller = args->old_pid;
    struct exec_args_t *a = exec_args.lookup(&caller);
    if (a) {
        bpf_probe_read_kernel(e->argv, sizeof(e->argv), a->argv);
        exec_args.delete(&caller);
    } else {
        e->argv[0][0] = 0;
    }
    proc_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
#endif
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    inflight.delete(&tid);
    exec_args.delete(&tid);
    s32 status = -1;
#if HAVE_GROUP_DEAD
    u64 group_dead = args->group_dead ? 1 : 0;
#else
    u64 group_dead = tid == tgid;  /* kernels before group_dead: the leader's exit stands for the group */
#endif
    if (group_dead) {
        s32 *st = exit_status.lookup(&tgid);
        if (st) {
            status = *st;
            exit_status.delete(&tgid);
        }
    }
    emit_proc(PROC_EXIT, tgid, tid, 0, 0, status, group_dead);
    if (group_dead) {
        set_traced(tgid, 0);
        pending_fatal.delete(&tgid);
    }
    return 0;
}

/* Fatal default-action signals, as in the kernel's sig_kernel_coredump/kill sets. */
static __always_inline int default_fatal(int sig)
{
    return sig == 1 || sig == 2 || sig == 3 || sig == 4 || sig == 5 || sig == 6 ||
           sig == 7 || sig == 8 || sig == 9 || sig == 10 || sig == 11 || sig == 12 ||
           sig == 13 || sig == 14 || sig == 15 || sig == 16 || sig == 24 || sig == 25 ||
           sig == 26 || sig == 27 || sig == 29 || sig == 30 || sig == 31 || sig >= 32;
}

TRACEPOINT_PROBE(signal, signal_generate)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    u32 target = args->pid;
    /* Sent by a traced process, or to one (target is a tgid for kill(2)). */
    if (!is_traced(tgid) && !is_traced(target))
        return 0;
    if (is_traced(target) && args->sig != 9 && default_fatal(args->sig)) {
        s32 sig = args->sig;
        pending_fatal.update(&target, &sig);
    }
#if PROBE_SIGNAL
    struct signal_event *e = signal_ring.ringbuf_reserve(sizeof(struct signal_event));
    if (!e) {
        count_drop(RING_SIGNAL);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->kind = SIGNAL_GENERATE;
    e->sig = args->sig;
    e->pid = tgid;
    e->tid = tid;
    e->target_tid = target;
    e->code = args->code;
    e->result = args->result;
    e->group = args->group;
    signal_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
#endif
    return 0;
}

TRACEPOINT_PROBE(signal, signal_deliver)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    int sig = args->sig;
    if (args->sa_handler == 0 && default_fatal(sig)) {
        /* Default action kills the process: that is its exit status unless
         * an exit_group already set one. */
        s32 status = sig;
        if (sig == 9) {
            s32 *sent = pending_fatal.lookup(&tgid);
            if (sent)
                status = *sent;
        }
        exit_status.insert(&tgid, &status);
    } else if (args->sa_handler != 0) {
        pending_fatal.delete(&tgid);  /* handled: it did not kill */
    }
#if PROBE_SIGNAL
    struct signal_event *e = signal_ring.ringbuf_reserve(sizeof(struct signal_event));
    if (!e) {
        count_drop(RING_SIGNAL);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->kind = SIGNAL_DELIVER;
    e->sig = sig;
    e->pid = tgid;
    e->tid = tid;
    e->target_tid = tid;
    e->code = args->code;
    e->result = 0;
    e->group = 0;
    signal_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
#endif
    return 0;
}
