"""`just bench sandbox`: what a trapped call costs a replay, by trapping method.

A child process makes the same system call N times (kill(1, 0): a signal
to another process, which the replay sandbox traps) under each method, and
times the loop itself; the per-call cost added is its time less the
unfiltered loop's of the same call:

- none: no filter (the baselines, kill and getppid: a ctypes call and the syscall);
- filter, let through: the replay sandbox's real filter (replay/sandbox.py,
  20 inherited descriptors), on getppid, which it allows: what every other
  call of a replay pays;
- kernel-only: a filter that answers EPERM itself (SECCOMP_RET_ERRNO):
  fastest, but nothing can be logged, swallowed or redirected;
- user-notify: the replay sandbox as it runs, its supervisor answering
  and logging each call (what Watcher uses);
- ptrace: a tracer stopping the child at every system call's entry and exit
  (PTRACE_SYSCALL), the least a ptrace supervisor pays per call, before
  reading or rewriting any register.

Each method runs REPEATS times; the table has medians.  Writes
bench-results/sandbox.json.  Needs no privileges (ptrace of one's own child).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from watcher.replay import sandbox  # noqa: E402
from watcher.syscall_names import syscall_number  # noqa: E402

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
SYS_KILL, SYS_GETPPID = syscall_number("kill"), syscall_number("getppid")
PTRACE_TRACEME, PTRACE_SYSCALL, PTRACE_SETOPTIONS = 0, 24, 0x4200
PTRACE_O_TRACESYSGOOD, PTRACE_O_EXITKILL = 1, 0x100000
RET_ERRNO = 0x00050000


def _errno_filter(nr: int) -> bytes:
    """x86_64 only; `nr` -> EPERM from the kernel, everything else allowed."""
    ins = [(0x20, 0, 0, 4), (0x15, 1, 0, sandbox.AUDIT_ARCH_X86_64), (0x06, 0, 0, sandbox.RET_KILL_PROCESS),
           (0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, RET_ERRNO | 1), (0x06, 0, 0, sandbox.RET_ALLOW)]
    return b"".join(struct.pack("<HBBI", *i) for i in ins)


def _install_errno_filter(nr: int) -> None:
    code = _errno_filter(nr)
    buf = ctypes.create_string_buffer(code)
    prog = sandbox._SockFprog(len(code) // 8, ctypes.addressof(buf))
    libc.prctl(sandbox.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if libc.syscall(syscall_number("seccomp"), sandbox.SECCOMP_SET_MODE_FILTER, 0, ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp")


def _loop(nr: int, n: int, args: tuple) -> int:
    call, a = libc.syscall, [ctypes.c_long(x) for x in args]
    t0 = time.perf_counter_ns()
    for _ in range(n):
        call(nr, *a)
    return time.perf_counter_ns() - t0


def measure(method: str, n: int, log_dir: Path) -> float:
    """ns per call under `method`, timed inside the child."""
    r, w = os.pipe()
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(20)]  # inherited descriptors, as a rank has
    listener_r, listener_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.close(listener_r)
            nr, args = (SYS_GETPPID, ()) if "getppid" in method or "let through" in method else (SYS_KILL, (1, 0))
            if method == "kernel-only":
                _install_errno_filter(SYS_KILL)
            elif method in ("user-notify", "filter, let through"):
                listener, _ = sandbox.install({w, listener_w, 0, 1, 2})
                os.write(listener_w, f"{listener}\n".encode())
            elif method == "ptrace":
                libc.ptrace(PTRACE_TRACEME, 0, None, None)
                os.kill(os.getpid(), signal.SIGSTOP)
            _loop(nr, min(n, 1000), args)  # warm
            os.write(w, str(_loop(nr, n, args)).encode())
            os._exit(0)
        except BaseException as e:
            os.write(2, f"bench child ({method}): {e}\n".encode())
            os._exit(3)
    os.close(w)
    os.close(listener_w)
    for fd in spare:
        os.close(fd)
    status = None
    if method in ("user-notify", "filter, let through"):
        child_fd = int(os.read(listener_r, 64))
        listener = sandbox.grab_listener(pid, child_fd)
        status = sandbox.supervise(listener, pid, log_dir / f"{method.replace(' ', '_')}.jsonl", [])
        os.close(listener)
    elif method == "ptrace":
        _, st = os.waitpid(pid, 0)  # the SIGSTOP
        libc.ptrace(PTRACE_SETOPTIONS, pid, None, ctypes.c_void_p(PTRACE_O_TRACESYSGOOD | PTRACE_O_EXITKILL))
        libc.ptrace(PTRACE_SYSCALL, pid, None, None)
        while True:
            _, st = os.waitpid(pid, 0)
            if os.WIFEXITED(st) or os.WIFSIGNALED(st):
                status = st
                break
            sig = os.WSTOPSIG(st)
            deliver = 0 if sig in (signal.SIGTRAP | 0x80, signal.SIGTRAP) else sig
            libc.ptrace(PTRACE_SYSCALL, pid, None, ctypes.c_void_p(deliver))
    if status is None:
        _, status = os.waitpid(pid, 0)
    os.close(listener_r)
    out = os.read(r, 64)
    os.close(r)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0) or not out:
        raise RuntimeError(f"{method}: the child failed (status {status})")
    return int(out) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "sandbox.json")
    a = ap.parse_args()
    methods = ["none", "none (getppid)", "filter, let through", "kernel-only", "user-notify", "ptrace"]
    runs: dict[str, list[float]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeats):  # interleaved, so drift hits every method alike
            for m in methods:
                runs[m].append(measure(m, a.calls, Path(d)))
            print(f"bench sandbox: round {i + 1}/{a.repeats}", file=sys.stderr, flush=True)
    def base(m: str) -> float:
        return statistics.median(runs["none (getppid)" if "getppid" in m or "let through" in m else "none"])

    rows = [{"method": m, "syscall": "getppid" if "getppid" in m or "let through" in m else "kill(1, 0)",
             "ns_per_call": round(statistics.median(runs[m])),
             "added_us": round((statistics.median(runs[m]) - base(m)) / 1000, 2),
             "runs_ns": [round(x) for x in runs[m]]} for m in methods]
    print(f"{'method':22} {'ns/call':>9} {'added us/call':>14}")
    for r in rows:
        print(f"{r['method']:22} {r['ns_per_call']:>9} {r['added_us']:>14}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"calls": a.calls, "repeats": a.repeats,
                                 "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
