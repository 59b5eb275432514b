"""The replay sandbox, trap by trap: a real replay child (a replay check of the
canary workload, tests/workloads/canary.py --traps) makes every call the
sandbox traps, on the live job's socket, file and run directory, and prints
what it got; the sandbox's log (the recording's sandbox_event table) says
what it did.  And the filter itself: calls through another ABI kill the
process."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import sys
from pathlib import Path

from watcher.rundir import RunDir

from .conftest import ROOT, needs_bpf, query, watcher

CANARY = str(ROOT / "tests" / "workloads" / "canary.py")


@needs_bpf
def test_every_trap_answers_a_real_replay_child_and_is_logged(tmp_path):
    run = tmp_path / "run"
    result = tmp_path / "canary.json"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "4", "--replay-check", "11", "--",
                sys.executable, CANARY, "--steps", "16", "--out", str(result), "--traps", "10")
    assert p.returncode == 0, p.stderr
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert inc["replay"]["exact"] is True  # the traps changed nothing the replay computes
    # The live job saw exactly its own traffic and files.
    assert json.loads(result.read_text()) == {"bytes": 16 * 8, "lines": 16, "connections": 16, "steps": 16}
    assert not Path(str(result) + ".new").exists() and not Path(str(result) + ".dir").exists()
    assert not Path(str(result) + ".link").exists() and not Path(str(result) + ".log.moved").exists()
    assert (Path(str(result) + ".log").stat().st_mode & 0o777) != 0o777
    assert (run / "runtime" / "control").read_bytes()[56:64] == bytes(8)  # the live control block is untouched

    log = (run / "incidents" / "inc-0001" / "rank0.replay.log").read_text()
    got = {t["call"]: t for t in (json.loads(line[5:]) for line in log.splitlines() if line.startswith("TRAP "))}
    denied = ["read", "ioctl", "mmap", "kill", "mount", "unshare", "io_uring_setup", "io_setup", "bpf", "mkdir",
              "chmod", "symlink", "sched_setaffinity_other", "ptrace", "add_key", "perf_event_open", "finit_module",
              "setuid", "chown", "process_vm_readv", "pidfd_getfd", "lseek_inherited"]
    for call in denied:
        assert got[call] == {"call": call, "ok": False, "errno": "EPERM"}, got[call]
    assert got["close_inherited"] == {"call": "close_inherited", "ok": True, "result": True}  # swallowed: still open
    assert got["shmget"] == {"call": "shmget", "ok": False, "errno": "ENOSYS"}  # default deny
    assert got["open_for_write"] == {"call": "open_for_write", "ok": True, "result": False}  # /dev/null instead
    assert got["unlink"]["result"] is True and got["rename"]["result"] is True  # swallowed: still there
    assert got["sched_setaffinity_self"]["ok"] is True
    assert got["capabilities"]["result"] == "0000000000000000"
    assert got["shared_writable_mappings"]["result"] == 0
    assert got["control_block_write"]["result"] == 0x5741544348  # written, in the replay's own copy

    # Every trap rule by name, with the answer and the log line it owes.
    from watcher.replay import sandbox

    swallowed = {"unlink", "unlinkat", "rename", "renameat", "renameat2", "truncate", "write", "pwrite64",
                 "writev", "pwritev", "pwritev2", "close"}
    events = [json.loads(line) for line in
              RunDir(run).incident_dir("inc-0001").sandbox_log(0).read_text().splitlines()]
    logged = {(e["syscall"], e["action"]) for e in events}
    for name in sandbox.NETWORK + sandbox.ALWAYS + sandbox.NEVER + sandbox.ON_INHERITED_FD:
        answer = got[f"rule:{name}"]
        if name == "creat":
            assert answer["ok"] is True and (name, "redirected to /dev/null") in logged
        elif name in swallowed:
            assert answer == {"call": f"rule:{name}", "ok": True, "result": 0}, answer
            assert (name, "swallowed") in logged, name
        else:
            assert answer == {"call": f"rule:{name}", "ok": False, "errno": "EPERM"}, answer
            assert (name, "denied") in logged, name

    rows = dict(((s, a), n) for s, a, n in query(
        run / "recording.duckdb", "SELECT syscall, action, count(*) FROM sandbox_event GROUP BY ALL"))
    for syscall in ("read", "ioctl", "mmap", "kill", "mount", "unshare", "io_uring_setup", "io_setup", "bpf",
                    "mkdir", "chmod", "symlink", "sched_setaffinity", "ptrace", "add_key", "perf_event_open",
                    "finit_module", "setuid", "chown", "process_vm_readv", "pidfd_getfd", "lseek"):
        assert rows.get((syscall, "denied"), 0) >= 1, (syscall, rows)
    assert rows.get(("close", "swallowed"), 0) >= 1
    assert rows.get(("shmget", "not allowed (ENOSYS)")) == 1, rows
    assert rows[("unlink", "swallowed")] == 2 and rows[("rename", "swallowed")] == 2  # by its test and its rule
    assert rows[("openat", "redirected to /dev/null")] >= 1
    # The affinity call on itself was let through, not logged as a trap.
    assert sum(n for (s, a), n in rows.items() if s == "sched_setaffinity") == 1
    hardening = _result(run)["sandbox"]
    assert hardening["capabilities"] == "0000000000000000"
    assert {m["now"] for m in hardening["shared_mappings"]} == {"private"}
    assert any(m["path"].endswith("/runtime/control") for m in hardening["shared_mappings"])


def _result(run: Path) -> dict:
    import torch

    return torch.load(run / "incidents" / "inc-0001" / "rank0.result.pt", weights_only=False)


def _status_of(call, filtered: bool = True) -> int:
    """Fork a child that installs the sandbox's filter (unless not `filtered`)
    and makes `call`; its wait status.  A fatal signal kills it outright: no
    handler may run (one would ask the filter for tgkill, with no supervisor
    to answer)."""
    import faulthandler

    from watcher.replay import sandbox

    pid = os.fork()
    if pid == 0:
        try:
            faulthandler.disable()
            for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGSYS):
                signal.signal(sig, signal.SIG_DFL)
            prepared = call()
            if filtered:
                sandbox.install({int(fd) for fd in os.listdir("/proc/self/fd")} | {99})
            prepared()
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def test_the_filter_kills_calls_through_another_abi():
    """The filter reads syscall numbers of the x86_64 table only: a call made
    through the 32-bit table (int 0x80) or with the x32 bit would dodge every
    rule, so either kills the process (SIGSYS) before it runs."""

    def int80():
        code = bytes([0xB8, 20, 0, 0, 0,  # mov eax, 20: getpid in the i386 table
                      0xCD, 0x80,          # int 0x80
                      0xC3])               # ret
        buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        buf.write(code)
        return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))

    def x32():
        libc = ctypes.CDLL(None)
        return lambda: libc.syscall(0x40000000 | 39)  # getpid with the x32 bit

    for make in (int80, x32):
        plain = _status_of(make, filtered=False)
        status = _status_of(make)
        if make is int80 and os.WIFSIGNALED(plain) and os.WTERMSIG(plain) == signal.SIGSEGV:
            # A kernel without 32-bit emulation has no such entry to dodge through.
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
            continue
        assert os.WIFEXITED(plain) and os.WEXITSTATUS(plain) == 0  # the call itself works unfiltered
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS, (make.__name__, status)
    # And an ordinary call goes through.
    status = _status_of(lambda: os.getpid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
