"""Futex handoffs, the process tree and signals, against ground truth the test creates."""

import json
import textwrap

from .conftest import needs_bpf, query, record

pytestmark = needs_bpf

# N waiter threads each block K times on their own futex word; the main thread
# wakes each one only once it is seen blocked in futex(2) on that word, so
# every wait really blocks and is ended by exactly one known wake.
FUTEX_HANDOFF = textwrap.dedent("""
    import ctypes, json, sys, threading, time
    N, K = 4, 10
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    SYS_futex, FUTEX_WAIT, FUTEX_WAKE = 202, 0, 1
    words = (ctypes.c_int * N)()
    addr = [ctypes.addressof(words) + 4 * i for i in range(N)]
    tids = [0] * N

    def futex(i, op, val):
        return libc.syscall(ctypes.c_long(SYS_futex), ctypes.c_void_p(addr[i]), ctypes.c_int(op),
                            ctypes.c_int(val), None, None, ctypes.c_int(0))

    def waiter(i):
        tids[i] = threading.get_native_id()
        for k in range(K):
            while words[i] == k:          # word counts completed handoffs
                futex(i, FUTEX_WAIT, k)

    def blocked_on(i):
        # In futex(2) on this word, and asleep in the kernel (wchan is set only
        # once the thread has been queued and scheduled out): a wake now must
        # find it, so the handoff is deterministic.
        try:
            with open(f"/proc/self/task/{tids[i]}/syscall") as f:
                fields = f.read().split()
            with open(f"/proc/self/task/{tids[i]}/wchan") as f:
                wchan = f.read()
        except OSError:
            return False
        return fields[0] == "202" and int(fields[1], 16) == addr[i] and "futex" in wchan

    threads = [threading.Thread(target=waiter, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    for k in range(K):
        for i in range(N):
            while not blocked_on(i):
                time.sleep(0.0005)
            words[i] = k + 1
            assert futex(i, FUTEX_WAKE, 1) == 1
    for t in threads:
        t.join()
    print(json.dumps({"main": threading.get_native_id(), "tids": tids, "addr": addr}))
""")


def test_futex_waits_are_paired_with_the_wakes_that_ended_them(tmp_path, py):
    out = tmp_path / "rec.duckdb"
    proc = record(out, py, "-c", FUTEX_HANDOFF)
    assert proc.returncode == 0, proc.stderr
    truth = json.loads(proc.stdout)
    addrs = ",".join(str(a) for a in truth["addr"])
    waits = query(out, f"""
        SELECT t.tid, w.uaddr, w.ret, wk.tid, w.wake_ts, w.dur
        FROM futex w JOIN thread t ON t.utid = w.utid LEFT JOIN thread wk ON wk.utid = w.waker_utid
        WHERE w.kind = 'wait' AND w.uaddr IN ({addrs})""")
    assert len(waits) == 40
    for tid, uaddr, ret, waker_tid, wake_ts, dur in waits:
        assert ret == 0
        assert waker_tid == truth["main"]
        assert truth["addr"][truth["tids"].index(tid)] == uaddr
        assert dur > 0
    wakes = query(out, f"""SELECT count(*), sum(ret) FROM futex f JOIN thread t USING (utid)
                          WHERE kind = 'wake' AND uaddr IN ({addrs}) AND t.tid = {truth['main']}""")
    assert wakes == [(40, 40)]
    # every wait joins to its wake row through the view
    [(paired,)] = query(out, f"""SELECT count(*) FROM futex_handoff
                                 WHERE uaddr IN ({addrs}) AND wake_futex_id IS NOT NULL""")
    assert paired == 40


PROCESS_TREE = textwrap.dedent("""
    import json, os, signal, time
    kids = {}
    for code in (3, 5):
        pid = os.fork()
        if pid == 0:
            os.execv("/bin/sh", ["/bin/sh", "-c", f"exit {code}"])
        kids[pid] = code
    victim = os.fork()
    if victim == 0:
        time.sleep(60)
        os._exit(0)
    os.kill(victim, signal.SIGKILL)
    grand = os.fork()
    if grand == 0:       # a child that forks a grandchild
        g = os.fork()
        if g == 0:
            os._exit(11)
        os.waitpid(g, 0)
        os._exit(12)
    statuses = {pid: os.waitpid(pid, 0)[1] for pid in [*kids, victim, grand]}
    print(json.dumps({"me": os.getpid(), "kids": kids, "victim": victim, "grand": grand}))
""")


def test_fork_exec_exit_tree_with_exit_codes_and_signals(tmp_path, py):
    out = tmp_path / "rec.duckdb"
    proc = record(out, py, "-c", PROCESS_TREE)
    assert proc.returncode == 0, proc.stderr
    truth = json.loads(proc.stdout)
    rows = {pid: (ppid, code, sig, exe, cmd) for pid, ppid, code, sig, exe, cmd in query(
        out, "SELECT c.pid, p.pid, c.exit_code, c.exit_signal, c.exe, c.cmdline "
             "FROM process c LEFT JOIN process p ON p.upid = c.parent_upid")}
    assert rows[truth["me"]][1:3] == (0, None)
    for pid, code in truth["kids"].items():
        ppid, ecode, sig, exe, cmd = rows[int(pid)]
        assert (ppid, ecode, sig) == (truth["me"], code, None)
        assert exe == "/bin/sh" and cmd == f"/bin/sh -c exit {code}"
    assert rows[truth["victim"]][:3] == (truth["me"], None, 9)
    assert rows[truth["grand"]][:3] == (truth["me"], 12, None)
    grandchildren = [pid for pid, r in rows.items() if r[0] == truth["grand"]]
    assert len(grandchildren) == 1 and rows[grandchildren[0]][1:3] == (11, None)
    assert len(rows) == 6
    tree = query(out, "SELECT depth, count(*) FROM process_tree GROUP BY depth ORDER BY depth")
    assert tree == [(0, 1), (1, 4), (2, 1)]


SIGNALS = textwrap.dedent("""
    import json, os, signal
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert got == [signal.SIGUSR1]
    print(json.dumps({"me": os.getpid()}))
""")


def test_signal_generated_and_delivered(tmp_path, py):
    out = tmp_path / "rec.duckdb"
    proc = record(out, py, "-c", SIGNALS)
    assert proc.returncode == 0, proc.stderr
    me = json.loads(proc.stdout)["me"]
    rows = query(out, "SELECT kind, name, sender_pid, target_tid, code, result FROM signal "
                      "WHERE signo = 10 ORDER BY ts")
    assert rows == [("generate", "SIGUSR1", me, me, 0, 0), ("deliver", "SIGUSR1", me, me, 0, None)]
