"""A one-process training loop that talks to the outside world every step.

Per step it sends 8 bytes on one end of a socketpair, appends a line to a log
file, and opens a TCP connection to a listener thread in the same process that
counts connections.  A replay re-executes this code; if any of that leaked out
of the sandbox, the counts at the end would exceed the number of live steps.
At the end it writes {"bytes", "lines", "connections", "steps"} as JSON.

With --traps STEP, a replay of that step (only a replay: the live run must
not do these) also makes every call the sandbox traps, on the same socket,
file and run directory, and prints one line per call to its stdout (the
replay's log): "TRAP <json>" with the call's result or errno.
"""

import argparse
import ctypes
import errno
import json
import mmap
import os
import socket
import threading

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", required=True)
    p.add_argument("--traps", type=int, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    a, b = socket.socketpair()
    log = open(args.out + ".log", "a", buffering=1)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    connections = []

    def accept() -> None:
        while True:
            try:
                c, _ = listener.accept()
            except OSError:
                return
            connections.append(c)

    threading.Thread(target=accept, daemon=True).start()

    x = torch.randn(512, 16)
    y = x.sum(1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            if step >= args.steps:
                break
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            a.send(b"canary!!")
            log.write(f"{step} {loss.item():.6f}\n")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError:
                pass
            if step == args.traps and _in_replay():
                _traps(args.out, b, log)
            step += 1
    a.close()
    received = b""
    while chunk := b.recv(4096):
        received += chunk
    log.close()
    import time
    deadline = time.monotonic() + 5  # let the acceptor take every connection made (a busy machine delays it)
    while len(connections) < step and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(args.out + ".log") as f:
        lines = sum(1 for _ in f)
    with open(args.out, "w") as f:
        json.dump({"bytes": len(received), "lines": lines, "connections": len(connections), "steps": step}, f)


def _in_replay() -> bool:
    from watcher.runtime import rank

    return rank.RUNTIME is not None and rank.RUNTIME.mode == "replay"


def _traps(out: str, sock: socket.socket, log) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def report(name: str, fn) -> None:
        ctypes.set_errno(0)
        try:
            got = fn()
            line = {"call": name, "ok": True, "result": got}
        except OSError as e:
            line = {"call": name, "ok": False, "errno": errno.errorcode.get(e.errno, e.errno)}
        print("TRAP " + json.dumps(line), flush=True)

    def raw(nr: int, *a) -> int:
        r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(x) if isinstance(x, int) else x for x in a))
        if r < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return r

    logfile = out + ".log"
    report("read", lambda: len(os.read(sock.fileno(), 8)))
    report("ioctl", lambda: raw(16, sock.fileno(), 0x541B, ctypes.byref(ctypes.c_int())))  # FIONREAD
    report("mmap", lambda: raw(9, 0, 4096, mmap.PROT_READ, mmap.MAP_SHARED, log.fileno(), 0))
    report("open_for_write", lambda: (open(out + ".new", "w").close(), os.path.exists(out + ".new"))[1])
    report("unlink", lambda: (os.unlink(logfile), os.path.exists(logfile))[1])
    report("rename", lambda: (os.rename(logfile, logfile + ".moved"), os.path.exists(logfile))[1])
    report("kill", lambda: os.kill(1, 0))
    report("mount", lambda: raw(165, b"none", b"/mnt", b"tmpfs", 0, None))
    report("unshare", lambda: raw(272, 0x00020000))  # CLONE_NEWNS
    report("io_uring_setup", lambda: raw(425, 4, ctypes.byref((ctypes.c_char * 120)())))
    report("io_setup", lambda: raw(206, 4, ctypes.byref(ctypes.c_ulong())))
    report("bpf", lambda: raw(321, 0, None, 0))
    report("mkdir", lambda: os.mkdir(out + ".dir"))
    report("chmod", lambda: os.chmod(logfile, 0o777))
    report("symlink", lambda: os.symlink(logfile, out + ".link"))
    report("shmget", lambda: raw(29, 0, 4096, 0o1600))  # SysV shared memory: not on the allowlist
    report("ptrace", lambda: raw(101, 16, os.getppid(), 0, 0))  # PTRACE_ATTACH to the snapshot
    report("add_key", lambda: raw(248, b"user", b"watcher", b"x", 1, -3))  # into the session keyring
    report("perf_event_open", lambda: raw(298, ctypes.byref((ctypes.c_char * 128)()), 0, -1, -1, 0))
    report("finit_module", lambda: raw(313, 0, b"", 0))
    report("setuid", lambda: raw(105, 0))
    report("chown", lambda: os.chown(logfile, 0, 0))
    report("process_vm_readv", lambda: raw(310, os.getppid(), None, 0, None, 0, 0))
    report("pidfd_getfd", lambda: raw(438, 0, 0, 0))
    report("lseek_inherited", lambda: os.lseek(log.fileno(), 0, os.SEEK_SET))
    report("close_inherited", lambda: (os.close(log.fileno()), os.fstat(log.fileno()).st_ino > 0)[1])
    report("sched_setaffinity_other", lambda: os.sched_setaffinity(os.getppid(), os.sched_getaffinity(0)))
    report("sched_setaffinity_self", lambda: os.sched_setaffinity(0, os.sched_getaffinity(0)))
    with open("/proc/self/status") as f:
        report("capabilities", lambda: next(line.split()[1] for line in f if line.startswith("CapEff:")))
    with open("/proc/self/maps") as f:
        report("shared_writable_mappings", lambda: sum(1 for line in f if line.split()[1][1::2] == "ws"))

    # Every rule, by name: each call the filter traps, with arguments that
    # name nothing of the live job's (the supervisor answers before the
    # kernel would run the call; the capabilities are gone besides).
    from watcher.replay import sandbox

    for name in sandbox.NETWORK + sandbox.ALWAYS + sandbox.NEVER:
        report(f"rule:{name}", lambda nr=sandbox.SYS[name]: raw(nr, -1, 0, 0, 0, 0, 0))
    for name in sandbox.ON_INHERITED_FD:  # on the live job's log file
        report(f"rule:{name}", lambda nr=sandbox.SYS[name]: raw(nr, log.fileno(), 0, 0, 0, 0, 0))

    # A write into the node's control block stays in the replay's own copy.
    from watcher.runtime import rank

    def scribble() -> int:
        rank.RUNTIME.ctl.mm[56:64] = (0x5741544348).to_bytes(8, "little")
        return int.from_bytes(rank.RUNTIME.ctl.mm[56:64], "little")
    report("control_block_write", scribble)


if __name__ == "__main__":
    main()
