"""A rank's stand-in before its launcher: the process torchrun started stays
alive while Watcher replaces the rank under it.

A launcher (torchrun, Lightning's, srun) watches the processes it started:
the moment one dies it tears the whole job down.  Under `watcher run`
(unless --no-rescue, or policy observe) each rank splits in two
as it starts importing torch (so this process never holds torch): the
process the launcher knows becomes this supervisor, and its child goes on as
the rank.  When the rank dies of itself (a signal, an error exit), the
supervisor reports the death (DIR/runtime/rescue/) and waits for the
launcher side's word (watcher/rescue.py): either a replacement, a process
that now names itself rank r in DIR/runtime/rank<r>.process.json (a snapshot
of the rank taken over, replay/snapshot.py), which it then watches instead;
or "let go", and it ends exactly as the rank did (the same signal, or the
same exit code), so the launcher sees what it would have seen without it.

The supervisor is the nearest subreaper of everything below it: the rank's
snapshots, orphaned by the rank's death, become its children, so a
replacement taken from one is a process it can wait for.  Signals the
launcher sends (SIGTERM at teardown) are passed on to the live rank; a death
after one is the launcher's doing and never rescued.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from ..rundir import STOP_EXIT_CODE, RunDir, read_json_or_none, write_json
from .control import parent_pid

ENV = "WATCHER_RESCUE"
PID_ENV = "WATCHER_SUPERVISOR_PID"
# Who the split process went on as (its RANK/LOCAL_RANK): a process that
# inherits it unchanged (a DataLoader worker) is not a new rank; one started
# with another LOCAL_RANK (Lightning's rank 1, started by rank 0) is.
AS_ENV = "WATCHER_SUPERVISED_AS"
PR_SET_CHILD_SUBREAPER = 36
COMM = "w-supervisor"    # its process name: the recorder labels its live child, not it, as the rank
FATE_WAIT_S = 30.0       # the launcher side answers a death report within a second; this is its outer bound
REPLACE_WAIT_S = 120.0   # from "replace" to the replacement naming itself
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
TEARDOWN = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def wanted() -> bool:
    """A process of a rescued `watcher run` job that is, or may become, a
    rank and is not supervised yet: one a launcher started as a rank (RANK
    or LOCAL_RANK set), or the job's first process to import torch when it is
    not a launcher (a script that becomes rank 0 itself, as under Lightning)."""
    if os.environ.get(ENV) != "1" or os.environ.get(AS_ENV) == _identity():
        return False
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return True
    return AS_ENV not in os.environ and not _is_launcher()


def rescuable(rt) -> bool:
    """Can this rank be replaced if it dies: it is supervised, and the policy acts."""
    return bool(os.environ.get(PID_ENV)) and rt.policy in ("recover", "apply")


def _identity() -> str:
    return f"{os.environ.get('RANK', '')}/{os.environ.get('LOCAL_RANK', '')}"


def _is_launcher() -> bool:
    # The interpreter's own command line: under -m, sys.argv[0] is still "-m"
    # while the package (torch) is imported.
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] in ("torch.distributed.run", "torch.distributed.launch"):
        return True
    return any(os.path.basename(a) == "torchrun" or a.replace(os.sep, "/").endswith(
        ("torch/distributed/run.py", "torch/distributed/launch.py")) for a in argv[:2])


def split(run_dir: RunDir) -> None:
    """Fork: the child returns and goes on as the rank; this process becomes
    its supervisor and never returns."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except OSError:
        return  # without it a replacement could not be waited for: no split, no rescue
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    child = os.fork()
    if child == 0:
        os.environ[PID_ENV] = str(me)
        os.environ[AS_ENV] = _identity()
        return
    try:
        Supervisor(run_dir, child).run()
    finally:
        os._exit(70)  # never back into the user's program


class Supervisor:
    def __init__(self, run_dir: RunDir, child: int):
        self.run_dir, self.live = run_dir, child
        self.rank: int | None = None  # learned from the rank's own word (rank<r>.process.json)
        self.teardown = False

    def run(self) -> None:
        try:
            with open("/proc/self/comm", "w") as f:
                f.write(COMM)
        except OSError:
            pass
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(70)  # nothing left to wait for: cannot happen while the rank lives
            if pid != self.live:
                continue  # a snapshot or replay of the rank, adopted when the rank died
            nxt = self._replacement(status)
            if nxt is None:
                _end_like(status)
            self.live = nxt

    def _forward(self, sig, _frame) -> None:
        if sig in TEARDOWN:
            self.teardown = True
        if sig in (signal.SIGINT, signal.SIGQUIT) and terminal_sent_it():
            return  # a Ctrl-C at the terminal reached the rank too (the same process group): not twice
        try:
            os.kill(self.live, sig)
        except OSError:
            pass

    def _replacement(self, status: int) -> int | None:
        """The process now standing in for the rank, or None: let it go."""
        code = os.waitstatus_to_exitcode(status)
        if code in (0, STOP_EXIT_CODE) or self.teardown:
            return None
        dead = self.live
        self.rank = next((r for r, path in self.run_dir.rank_process_files()
                          if (read_json_or_none(path) or {}).get("pid") == dead), None)
        if self.rank is None:
            return None  # it never became a rank: nothing to replace it with
        self.run_dir.rescue.mkdir(parents=True, exist_ok=True)
        write_json(self.run_dir.rescue_death(self.rank, dead),
                   {"rank": self.rank, "pid": dead, "exit_code": code if code >= 0 else None,
                    "signal": -code if code < 0 else None, "unix": time.time()})
        fate = wait_for(lambda: read_json_or_none(self.run_dir.rescue_fate(self.rank, dead)), FATE_WAIT_S)
        if not fate or fate.get("fate") != "replace" or self.teardown:
            return None

        def named():
            p = read_json_or_none(self.run_dir.rank_process(self.rank))
            return p["pid"] if p and p.get("pid") not in (None, dead) and _is_child(p["pid"]) else None

        def given_up():  # the rescue failed: the launcher side took its word back
            return self.teardown or (read_json_or_none(self.run_dir.rescue_fate(self.rank, dead)) or {}).get("fate") != "replace"

        return wait_for(named, REPLACE_WAIT_S, stop=given_up)


def terminal_sent_it() -> bool:
    """Is this process in its terminal's foreground group (so a Ctrl-C there
    went to the whole group, its children included)?"""
    try:
        return os.tcgetpgrp(0) == os.getpgrp()  # fd 0: the terminal, whatever sys.stdin became
    except (OSError, ValueError):
        return False


def wait_for(get, timeout: float, stop=lambda: False):
    """get()'s first true value within `timeout` seconds (polled every 50 ms), or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop():
        v = get()
        if v:
            return v
        time.sleep(0.05)
    return None


def _is_child(pid: int) -> bool:
    return parent_pid(pid) == os.getpid()


def _end_like(status: int) -> None:
    """End as the rank ended: the launcher reads the same death."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset (it raises)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(1)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 70)
