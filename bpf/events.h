/* Event records shared by the recorder's BPF programs and the collector.
 *
 * Every record has a fixed size that is a multiple of 8, one ring buffer per
 * record type, so the collector can view a run of committed records as a numpy
 * structured array without walking them one by one.  bpf/events.py mirrors
 * these structs; tests/test_events_abi.py checks that the sizes agree.
 */
#ifndef WATCHER_EVENTS_H
#define WATCHER_EVENTS_H

#ifndef __BPF_TRACING__
#include <stdint.h>
typedef uint8_t u8;
typedef uint32_t u32;
typedef int32_t s32;
typedef uint64_t u64;
typedef int64_t s64;
#endif

#define ARGV_SLOTS 12
#define ARGV_SLOT_LEN 64
#define FILENAME_LEN 128
#define COMM_LEN 16
#define PATH_LEN 112

/* Ring ids, also the index into the per-CPU drop counters. */
#define RING_SYSCALL 0
#define RING_FUTEX 1
#define RING_PROC 2
#define RING_SIGNAL 3
#define RING_API 4
#define RING_FILE 5
#define RING_PYSTACK 6
#define RING_COUNT 7

/* One completed syscall (enter and exit joined in the kernel). */
struct syscall_event {
    u64 ts;        /* enter, CLOCK_MONOTONIC ns */
    u64 dur;       /* exit - enter, ns */
    u32 pid;       /* tgid */
    u32 tid;
    s64 ret;
    u64 args[6];
    u32 nr;
    u32 cpu;       /* CPU at exit */
};

#define FUTEX_KIND_WAIT 1
#define FUTEX_KIND_WAKE 2

/* A futex wait (with how long it blocked and which wake ended it) or a wake
 * that woke at least one waiter. */
struct futex_event {
    u64 ts;
    u64 dur;
    u32 pid;
    u32 tid;
    u64 uaddr;
    s64 ret;
    s64 timeout_ns;  /* -1: no timeout */
    u32 op;          /* full op, flags included */
    u32 val;
    u32 kind;
    u32 waker_tid;   /* waits: thread whose futex wake woke this one, 0 if none */
    u64 wake_ts;     /* waits: enter ts of that wake call */
};

#define PROC_FORK 1    /* new process: pid = child, ppid/ptid = parent */
#define PROC_THREAD 2  /* new thread: tid = child, pid = its process */
#define PROC_EXEC 3
#define PROC_EXIT 4    /* a thread exited; flags bit 0 = whole process exited */
#define PROC_REAP 5    /* a traced parent reaped child pid = tid field; code = wait status */
#define PROC_DLOPEN 6  /* the dynamic loader changed its link map (a library was loaded or unloaded) */

struct proc_event {
    u64 ts;
    u32 kind;
    u32 pid;
    u32 tid;
    u32 ppid;
    u32 ptid;
    s32 code;       /* EXIT: wait status (code<<8 or signal), -1 unknown; REAP: wait status */
    u64 flags;      /* FORK/THREAD: clone flags; EXIT: 1 if the group died */
    char comm[COMM_LEN];
    char filename[FILENAME_LEN];
    char argv[ARGV_SLOTS][ARGV_SLOT_LEN];
};

#define SIGNAL_GENERATE 1
#define SIGNAL_DELIVER 2

struct signal_event {
    u64 ts;
    u32 kind;
    s32 sig;
    u32 pid;         /* current process: sender for GENERATE, receiver for DELIVER */
    u32 tid;
    u32 target_tid;  /* GENERATE: the target task; DELIVER: tid */
    s32 code;        /* si_code */
    s32 result;      /* GENERATE: TRACE_SIGNAL_* result */
    s32 group;       /* GENERATE: sent to the whole group */
};

/* One open(2)-family call (open, openat, openat2, creat), with the path as
 * passed (relative paths stay relative), cut at PATH_LEN - 1 bytes. */
struct file_event {
    u64 ts;          /* enter */
    u64 dur;
    u32 pid;
    u32 tid;
    s64 ret;         /* the new fd, or -errno */
    u32 flags;       /* O_* flags */
    u32 nr;
    char path[PATH_LEN];
};

/* One library call caught by a uprobe (entry and return joined), see uprobes/. */
struct api_event {
    u64 ts;          /* entry */
    u64 dur;         /* 0 for entry-only probes */
    u32 pid;
    u32 tid;
    u32 slot;        /* index into the collector's table of attached probes */
    u32 flags;       /* bit 0: deref read ok; bit 1: tensor[] read ok */
    s64 ret;         /* integer return value (rax) */
    u64 args[6];     /* integer argument registers at entry */
    u64 deref[2];    /* 16 bytes read from the pointer argument the spec names */
    u64 tensor[2];   /* tensor_vector probes: first tensor's numel and raw dtype (flags bit 1) */
};

/* The Python stack of the thread making a probed library call, read at the
 * call's entry (uprobes/python_frames.py): per frame, innermost first, the
 * code object's address and the last instruction run.  The collector joins
 * it to the api_event by (tid, ts). */
#ifndef PY_FRAMES
#define PY_FRAMES 32
#endif
struct py_stack_event {
    u64 ts;          /* = the api_event's ts */
    u32 pid;
    u32 tid;
    u32 depth;       /* frames filled */
    u32 more;        /* 1: the stack is deeper than PY_FRAMES */
    u64 code[PY_FRAMES];
    u64 instr[PY_FRAMES];
};

#endif
