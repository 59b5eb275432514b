"""The replay sandbox: seccomp with a user-notify supervisor.

A replay child is a fork of a live rank, so it holds copies of every socket
and file the rank had open.  It must never touch them, yet the training code it
re-executes must run exactly as it did live.  So the filter traps:

- the network, always: socket, connect, bind, listen, accept, send*, shutdown,
  setsockopt -> denied (EPERM);
- on an inherited descriptor: reads and receives -> denied (EPERM); writes ->
  swallowed (reported as written, nothing reaches the file, so a training
  script that logs keeps running identically); close -> swallowed (the number
  stays taken, so a later open can never be handed an inherited number);
  seek, dup, epoll and fcntl changes -> denied;
- opening a file for writing -> handed /dev/null instead; unlink and rename ->
  swallowed; signals to other processes, ptrace -> denied;
- ioctl and mmap on an inherited descriptor -> denied;
- what a replay never needs, whatever its arguments -> denied: the mount
  family, namespaces, keyrings, io_uring and AIO, BPF and perf events, module
  and kexec loading, chroot, changes of owner, mode and identity, mkdir,
  rmdir, links, device nodes, clocks, other processes' memory;
- scheduling another process (affinity, priority, limits) -> denied; the
  replay's own threads may;
- anything else not on the replay's allowlist (ALLOWED: computing, memory,
  time, threads, its own signals, reading files, its own pipes) -> refused
  with ENOSYS, what a kernel without the call would answer, so a library
  falls back as it would there.  The filter denies by default: a call added
  to a later kernel is refused until it is listed.

Before the filter the child is made harmless in two more ways (`harden`):
every capability is dropped (effective, permitted, inheritable, ambient and
the bounding set), so even a call the filter lets through cannot act as
root; and every shared writable mapping it inherited (the node's control
block, the state-copy slots, a DataLoader's shared memory) is remapped
private, from the same file at the same address, or made read-only where
it has no file: a replay reads what the live ranks share and writes only
its own copy.

Every trapped call is logged (one JSON line) by the supervisor and later
stored in the recording's `sandbox_event` table.

Why user-notify rather than a ptrace supervisor (`just bench sandbox`,
scripts/bench_sandbox.py, medians of 5 x 20,000 calls on this 2-core VM): a
trapped call answered and logged by this supervisor adds 110 us, a ptrace
tracer that only stops the child at each call's entry and exit 145 us (before
it reads or rewrites a register, which it would need to report "written"),
a kernel-only EPERM nothing (it is cheaper than the call it refuses, but can
neither log, swallow nor redirect); a call the filter lets through adds
nothing measurable (its binary search is at most 24 instructions).  Only
trapped calls pay, and a replay makes few.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import time

from ..syscall_names import SYSCALL_NAMES, syscall_name, syscall_number

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

NETWORK = ("socket", "connect", "bind", "listen", "accept", "accept4", "sendto", "sendmsg", "sendmmsg",
           "shutdown", "setsockopt")
ON_INHERITED_FD = ("read", "write", "close", "lseek", "pread64", "pwrite64", "readv", "writev", "dup", "dup2",
                   "dup3", "recvfrom", "recvmsg", "recvmmsg", "fcntl", "flock", "fsync",
                   "fdatasync", "ftruncate", "epoll_wait", "epoll_ctl", "epoll_pwait", "epoll_pwait2",
                   "fallocate", "preadv", "pwritev", "preadv2", "pwritev2")
# Calls that move data between two descriptors, or reach other processes or
# fds by other means, are trapped whatever their arguments.
ALWAYS = ("creat", "openat2", "unlink", "unlinkat", "rename", "renameat", "renameat2", "truncate", "kill",
          "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal", "ptrace",
          "process_vm_writev", "sendfile", "splice", "copy_file_range", "pidfd_getfd", "io_uring_setup")
# Never needed by a replay: denied whatever the arguments.
NEVER = ("mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
         "mount_setattr", "unshare", "setns", "add_key", "request_key", "keyctl", "io_uring_enter",
         "io_uring_register", "io_setup", "io_submit", "io_getevents", "io_destroy", "io_cancel", "bpf",
         "perf_event_open", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
         "reboot", "swapon", "swapoff", "sethostname", "setdomainname", "chroot", "acct", "settimeofday",
         "clock_settime", "clock_adjtime", "adjtimex", "quotactl", "mknod", "mknodat", "chown", "fchown",
         "lchown", "fchownat", "chmod", "fchmod", "fchmodat", "mkdir", "mkdirat", "rmdir", "link", "linkat",
         "symlink", "symlinkat", "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid",
         "setgroups", "setfsuid", "setfsgid", "capset", "userfaultfd", "open_by_handle_at", "name_to_handle_at",
         "process_vm_readv", "vmsplice", "iopl", "ioperm", "fanotify_init", "close_range", "fchmodat2")
# Allowed on the replay itself (its own threads), denied on any other process;
# the target is the first argument (setpriority's second).
SCHEDULING = ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr", "setpriority",
              "prlimit64", "migrate_pages", "move_pages")
# Trapped when their fifth argument (the descriptor) was inherited.
ON_INHERITED_FD_ARG4 = ("mmap",)
# Let through with no question: what re-executing training code needs and
# cannot reach past its own process with.  (Calls on descriptors are here only
# when the descriptor is the replay's own: inherited ones are ON_INHERITED_FD.)
ALLOWED = (
    # memory
    "brk", "munmap", "mprotect", "mremap", "madvise", "mlock", "mlock2", "munlock", "mlockall", "munlockall",
    "msync", "mincore", "membarrier", "mbind", "get_mempolicy", "set_mempolicy", "set_mempolicy_home_node",
    "memfd_create", "map_shadow_stack", "pkey_alloc", "pkey_free", "pkey_mprotect",
    # time and sleeping
    "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time", "times",
    "getitimer", "setitimer", "alarm", "timer_create", "timer_settime", "timer_gettime", "timer_getoverrun",
    "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    # threads, waiting, its own children
    "futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue", "set_robust_list", "get_robust_list",
    "set_tid_address", "rseq", "sched_yield", "sched_getaffinity", "sched_getparam", "sched_getscheduler",
    "sched_getattr", "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval", "getcpu",
    "clone", "clone3", "fork", "vfork", "execve", "execveat", "wait4", "waitid", "exit", "exit_group",
    "restart_syscall", "pidfd_open",
    # who and where it is
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getresuid",
    "getresgid", "getpgid", "getpgrp", "getsid", "getpriority", "getrlimit", "getrusage", "sysinfo", "uname",
    "prctl", "arch_prctl", "capget", "umask", "getcwd", "chdir", "fchdir", "seccomp", "landlock_create_ruleset",
    "landlock_add_rule", "landlock_restrict_self", "ioprio_get", "getrandom", "kcmp", "setrlimit", "cachestat",
    "mseal",
    # the return path of Watcher's own library probes (the kernel's uprobe trampolines)
    "uretprobe", "uprobe",
    # its own signals
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigtimedwait", "rt_sigsuspend",
    "sigaltstack", "pause", "signalfd", "signalfd4",
    # reading files (opening for writing is trapped by its flags, below)
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2",
    "readlink", "readlinkat", "getdents", "getdents64", "fadvise64", "readahead", "getxattr", "lgetxattr",
    "fgetxattr", "listxattr", "llistxattr", "flistxattr", "inotify_init", "inotify_init1",
    "inotify_add_watch", "inotify_rm_watch",
    # its own pipes, events and socket pairs (the network is trapped)
    "pipe", "pipe2", "eventfd", "eventfd2", "epoll_create", "epoll_create1", "poll", "ppoll", "select",
    "pselect6", "socketpair", "getsockname", "getpeername", "getsockopt", "tee",
)
# Syscall numbers (x86_64, the only ABI the filter admits) of every call it traps.
SYS = {name: syscall_number(name) for name in NETWORK + ON_INHERITED_FD + ALWAYS + NEVER + SCHEDULING
       + ON_INHERITED_FD_ARG4 + ("open", "openat", "ioctl")}
NAME = {v: k for k, v in SYS.items()}
ALLOWED_NR = frozenset(syscall_number(name) for name in ALLOWED)
SYS_SECCOMP, SYS_PIDFD_OPEN = syscall_number("seccomp"), syscall_number("pidfd_open")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# classic BPF
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
X32_BIT = 0x40000000
RET_NOTIFY = 0x7FC00000
AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_SET_MODE_FILTER = 1
FLAG_NEW_LISTENER = 1 << 3
PR_SET_NO_NEW_PRIVS = 38
NOTIF_RECV = 0xC0502100
NOTIF_SEND = 0xC0182101
NOTIF_ADDFD = 0x40182103
FLAG_CONTINUE = 1
ADDFD_FLAG_SEND = 1 << 1
EPERM, ENOSYS = 1, 38


def _ins(code, k, jt=0, jf=0):
    return struct.pack("<HBBI", code, jt, jf, k & 0xFFFFFFFF)


def build_filter(inherited_fds: list[int]) -> bytes:
    """The BPF program: allow ALLOWED, check the arguments of the calls that
    depend on them, notify the supervisor of everything else."""
    NOTIFY, ALLOW = "notify", "allow"
    # Another ABI (ia32 via int 0x80, x32) would dodge every number below.
    prog = [("ld", 4), ("jne", AUDIT_ARCH_X86_64, "wrong_abi"), ("ld", 0), ("jset", X32_BIT, "wrong_abi"),
            ("ja", "by_number"), ("label", "wrong_abi"), ("ret", RET_KILL_PROCESS), ("label", "by_number")]
    route = {nr: ALLOW for nr in ALLOWED_NR}
    route.update({SYS[name]: "fdcheck" for name in ON_INHERITED_FD + ("ioctl",)})
    route.update({SYS[name]: "fdcheck4" for name in ON_INHERITED_FD_ARG4})
    route.update({SYS["openat"]: "openat", SYS["open"]: "open"})
    route.update({SYS[name]: NOTIFY for name in NETWORK + ALWAYS + NEVER + SCHEDULING})
    prog += _route_by_number(route, default=NOTIFY)
    prog += [("label", "openat"), ("ld", 16 + 2 * 8), ("jset", WRITE_FLAGS, NOTIFY), ("ja", ALLOW),
             ("label", "open"), ("ld", 16 + 1 * 8), ("jset", WRITE_FLAGS, NOTIFY), ("ja", ALLOW),
             ("label", ALLOW), ("ret", RET_ALLOW),
             ("label", NOTIFY), ("ret", RET_NOTIFY),
             ("label", "fdcheck"), ("ld", 16)]  # args[0] low word: the descriptor
    for fd in inherited_fds:  # pairs, so no jump grows with the number of descriptors
        prog += [("jeq_skip", fd), ("ret", RET_NOTIFY)]
    prog += [("ret", RET_ALLOW), ("label", "fdcheck4"), ("ld", 16 + 4 * 8)]  # args[4] low word
    for fd in inherited_fds:
        prog += [("jeq_skip", fd), ("ret", RET_NOTIFY)]
    prog.append(("ret", RET_ALLOW))
    return _assemble(prog)


def _route_by_number(route: dict[int, str], default: str) -> list[tuple]:
    """A binary search over the syscall number (in the accumulator) that
    jumps to route[nr], or to `default` for a number not in it: about
    log2(runs) comparisons a call, where a list of equality tests would cost
    one per listed call."""
    top = max(max(SYSCALL_NAMES), max(route)) + 1
    runs = []  # (first number, label), one per run of numbers that go to the same place
    for nr in range(top + 1):
        label = route.get(nr, default) if nr < top else default
        if not runs or runs[-1][1] != label:
            runs.append((nr, label))
    counter = iter(range(1 << 30))

    def tree(part):
        if len(part) == 1:
            return [("ja", part[0][1])]
        mid = len(part) // 2
        upper = f"nr>={part[mid][0]}#{next(counter)}"
        # Conditional jumps reach only 255 instructions: the comparison
        # falls through to a long jump for the upper half and skips it for
        # the lower one.
        return ([("jge_next", part[mid][0]), ("ja", upper)] + tree(part[:mid])
                + [("label", upper)] + tree(part[mid:]))
    return tree(runs)


def _assemble(prog: list[tuple]) -> bytes:
    labels, index = {}, 0
    for item in prog:
        if item[0] == "label":
            labels[item[1]] = index
        else:
            index += 1
    out, index = [], 0
    for item in prog:
        op = item[0]
        if op == "label":
            continue
        here = index
        index += 1
        if op == "ld":
            out.append(_ins(LD_W_ABS, item[1]))
        elif op == "ret":
            out.append(_ins(RET_K, item[1]))
        elif op == "ja":
            out.append(_ins(0x05, labels[item[1]] - here - 1))
        elif op == "jeq":
            out.append(_ins(JEQ_K, item[1], jt=_off(labels[item[2]], here)))
        elif op == "jge_next":  # true: the next instruction; false: the one after
            out.append(_ins(JGE_K, item[1], jt=0, jf=1))
        elif op == "jeq_skip":
            out.append(_ins(JEQ_K, item[1], jt=0, jf=1))
        elif op == "jne":
            out.append(_ins(JEQ_K, item[1], jf=_off(labels[item[2]], here)))
        elif op == "jset":
            out.append(_ins(JSET_K, item[1], jt=_off(labels[item[2]], here)))
    return b"".join(out)


def _off(target: int, here: int) -> int:
    off = target - here - 1
    if not 0 <= off <= 255:
        raise ValueError("seccomp filter too long for a conditional jump")
    return off


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


CAP_VERSION_3 = 0x20080522
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_FIXED = 1, 2, 0x02, 0x10
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def harden() -> dict:
    """In the replay child, before the filter: drop every capability and seal
    the shared mappings (see the module's docstring).  Returns what was done,
    for the replay's result."""
    return {"shared_mappings": seal_shared_mappings(), "capabilities": drop_capabilities()}


def drop_capabilities() -> str:
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):  # the bounding set first: it needs CAP_SETPCAP, dropped next
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (two 32-bit halves each): none
    if libc.syscall(syscall_number("capset"), header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    with open("/proc/self/status") as f:
        return next((line.split()[1] for line in f if line.startswith("CapEff:")), "?")


def seal_shared_mappings() -> list[dict]:
    """Remap every shared writable mapping private (from the same file, at the
    same address and offset) or, with no file to map, read-only."""
    sealed = []
    with open("/proc/self/maps") as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[1][1] != "w" or parts[1][3] != "s":
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        offset, path = int(parts[2], 16), parts[5] if len(parts) > 5 else ""
        how = None
        try:
            # map_files opens the very file mapped, deleted or not.
            fd = os.open(f"/proc/self/map_files/{parts[0]}", os.O_RDONLY)
        except OSError:
            fd = None
        if fd is not None:
            try:
                got = libc.mmap(lo, hi - lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, offset)
                how = "private" if got == lo else None
            finally:
                os.close(fd)
        if how is None:
            if libc.mprotect(lo, hi - lo, PROT_READ) != 0:
                raise OSError(ctypes.get_errno(), f"mprotect of the shared mapping {path or parts[0]}")
            how = "read-only"
        sealed.append({"range": parts[0], "path": path, "now": how})
    return sealed


def install(allowed_fds: set[int]) -> tuple[int, list[int]]:
    """In the replay child: trap calls on every descriptor open now except
    `allowed_fds`.  Returns (listener fd, inherited fds)."""
    import platform

    if platform.machine() != "x86_64":
        raise OSError(f"the replay sandbox is built for x86_64, not {platform.machine()}")
    inherited = sorted(int(x) for x in os.listdir("/proc/self/fd") if int(x) not in allowed_fds)
    code = build_filter(inherited)
    buf = ctypes.create_string_buffer(code)
    prog = _SockFprog(len(code) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    fd = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, FLAG_NEW_LISTENER, ctypes.byref(prog))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SET_MODE_FILTER)")
    return fd, inherited


# -- supervisor (runs in the snapshot process, the replay child's parent) ----------------------

class _Data(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _Data)]


class _Resp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class _AddFd(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("srcfd", ctypes.c_uint32),
                ("newfd", ctypes.c_uint32), ("newfd_flags", ctypes.c_uint32)]


def grab_listener(child_pid: int, child_fd: int) -> int:
    pidfd = libc.syscall(SYS_PIDFD_OPEN, child_pid, 0)
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_open")
    try:
        fd = libc.syscall(SYS["pidfd_getfd"], pidfd, child_fd, 0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return fd
    finally:
        os.close(pidfd)


def _iov_total(pid: int, addr: int, count: int) -> int:
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            mem.seek(addr)
            raw = mem.read(16 * min(count, 1024))
        return sum(struct.unpack_from("<QQ", raw, 16 * i)[1] for i in range(len(raw) // 16))
    except OSError:
        return 0


def _own_task(child_pid: int, args: list[int], name: str) -> bool:
    """Does a scheduling call act on the replay itself (0, or one of its threads)?"""
    if name == "setpriority":
        if args[0] != 0:  # PRIO_PGRP, PRIO_USER: other processes
            return False
        target = args[1]
    else:
        target = args[0]
    target &= 0xFFFFFFFF
    return target == 0 or os.path.exists(f"/proc/{child_pid}/task/{target}")


def supervise(listener: int, child_pid: int, log_path, inherited: list[int]) -> int:
    """Answer trapped calls until the child exits; returns its wait status."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    pidfd = libc.syscall(SYS_PIDFD_OPEN, child_pid, 0)
    log = open(log_path, "a", buffering=1)
    inherited_set = set(inherited)
    notif, resp = _Notif(), _Resp()
    try:
        while True:
            ready, _, _ = select.select([listener, pidfd], [], [], 1.0)
            if listener in ready:
                ctypes.memset(ctypes.byref(notif), 0, ctypes.sizeof(notif))
                if libc.ioctl(listener, NOTIF_RECV, ctypes.byref(notif)) != 0:
                    if pidfd in ready:
                        break
                    continue
                d = notif.data
                name = NAME.get(d.nr) or syscall_name(d.nr)
                args = list(d.args)
                val, err, flags, action = 0, 0, 0, "denied"
                fd = args[0] & 0xFFFFFFFF
                if name in ("write", "pwrite64", "sendto") and fd in inherited_set:
                    val, action = args[2], "swallowed"
                elif name in ("writev", "pwritev", "pwritev2") and fd in inherited_set:
                    val, action = _iov_total(notif.pid, args[1], args[2]), "swallowed"
                elif name == "close" and fd in inherited_set:
                    action = "swallowed"
                elif name in ("unlink", "unlinkat", "rename", "renameat", "renameat2", "truncate"):
                    action = "swallowed"
                elif name == "fcntl" and args[1] in (1, 3):  # F_GETFD, F_GETFL change nothing
                    flags, action = FLAG_CONTINUE, "allowed"
                elif name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo") \
                        and args[0] == notif.pid:  # signals to itself (raise, abort)
                    flags, action = FLAG_CONTINUE, "allowed"
                elif name in SCHEDULING and _own_task(child_pid, args, name):
                    flags, action = FLAG_CONTINUE, "allowed"
                elif name in ("open", "openat", "creat"):
                    add = _AddFd(notif.id, ADDFD_FLAG_SEND, devnull, 0, os.O_CLOEXEC)
                    action = "redirected to /dev/null"
                    log.write(json.dumps({"ts": time.monotonic_ns(), "pid": notif.pid, "syscall": name,
                                          "fd": None, "args": args, "action": action}) + "\n")
                    if libc.ioctl(listener, NOTIF_ADDFD, ctypes.byref(add)) < 0:
                        resp.id, resp.val, resp.error, resp.flags = notif.id, 0, -EPERM, 0
                        libc.ioctl(listener, NOTIF_SEND, ctypes.byref(resp))
                    continue
                elif d.nr not in NAME:  # not on the allowlist, nor trapped for a reason
                    err, action = -ENOSYS, "not allowed (ENOSYS)"
                else:
                    err = -EPERM
                if action != "allowed":
                    log.write(json.dumps({"ts": time.monotonic_ns(), "pid": notif.pid, "syscall": name,
                                          "fd": fd if name in ON_INHERITED_FD else None,
                                          "args": args, "action": action}) + "\n")
                resp.id, resp.val, resp.error, resp.flags = notif.id, val, err, flags
                libc.ioctl(listener, NOTIF_SEND, ctypes.byref(resp))
            elif pidfd in ready:
                break
        _, status = os.waitpid(child_pid, 0)
        return status
    finally:
        log.close()
        os.close(devnull)
        os.close(pidfd)
