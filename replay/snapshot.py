"""Verified-state snapshots by fork, and the replays they serve.

`ForkSnapshot.take` forks the rank at a step boundary.  The child (the
snapshot) is a frozen copy-on-write image of the whole rank, the user's loop
state included; it waits on a pipe.  Asked to replay, it forks a replay child
that installs the sandbox, loads the window recorded since the snapshot, and
returns into the training loop in replay mode; the snapshot supervises the
sandbox and reports how the child ended.  One snapshot serves any number of
replays.

Two conditions make the replay bit-exact (measured): libgomp's threads are
paused (omp_pause_resource_all) before the fork, or the child hangs at its
first OpenMP region; and the child keeps the parent's intra-op thread count.

A snapshot is an object with `replay()`, not a pid, so a GPU snapshot (device
tensors copied to host, or cuda-checkpoint) can take its place later.
"""

from __future__ import annotations

import ctypes
import faulthandler
import glob
import json
import math
import os
import select
import signal
import stat
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

# Everything a snapshot and its replays run is imported here, when the rank
# loads this module, never after a fork: importing after a fork loads
# libraries (ctypes.CDLL), and a lock another thread of the rank held at the
# fork (the dynamic loader's, during a C++ unwind in a gloo thread) would be
# held forever in the child.
from ..rundir import ReplayDir
from ..runtime import crashsite, supervisor
from ..runtime.checksum import params_sum
from ..runtime.control import AGREE_EVERY
from ..runtime.seam import Rank
from ..runtime.window import Window, segment_paths
from . import sandbox, variants
from .exchange import Exchange, end_for, exchange_path
from .plan import full_param_sum
from .state import ReplayState
from .state_copy import CopyUnusable

PR_SET_PDEATHSIG = 1
ORPHAN_WAIT_S = float(os.environ.get("WATCHER_ORPHAN_WAIT", "20"))
# Asks a snapshot for its Python stacks (faulthandler), when it does not answer an order.
STACK_SIGNAL = signal.SIGRTMIN + 3
_gomp = None
_stack_file = None  # in a snapshot: where faulthandler writes its stacks


def pause_openmp() -> None:
    global _gomp
    if _gomp is None:
        libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
        _gomp = ctypes.CDLL(libs[0]) if libs else False
    if _gomp:
        _gomp.omp_pause_resource_all(2)  # omp_pause_hard


class SnapshotPolicy:
    """Choose the snapshot interval so fork + copy-on-write cost stays within
    `budget` (a fraction of step time).  Intervals are powers of two, so ranks
    that measure slightly different costs still share snapshot steps."""

    keep = 2

    def __init__(self, budget: float):
        self.budget = max(budget, 1e-4)
        forced = os.environ.get("WATCHER_SNAPSHOT_INTERVAL")
        self.forced = int(forced) if forced else None
        self.interval = self.forced or 1
        self.want: int | None = None  # the interval this rank's own costs call for
        self.cost_ns: float | None = None
        self.last_snap: int | None = None
        self.fork_ns: list[int] = []
        self.cow_ns: list[int] = []

    def due(self, k: int, rt) -> bool:
        steps = rt.step_ns
        if self.last_snap is not None and self.last_snap == k - 1 and len(steps) >= 3:
            med = sorted(steps[:-1])[len(steps[:-1]) // 2]
            self.cow_ns.append(max(0, steps[-1] - med))
            self._adapt(med)
            self._agree(rt)
        elif k % AGREE_EVERY == 0:
            self._agree(rt)  # a peer's wish may have grown since
        if k < 1 or len(steps) < 1:
            return False
        if k % self.interval:
            return False
        self.last_snap = k
        return True

    def _adapt(self, median_step_ns: int) -> None:
        if self.forced:
            return
        cost = (self.fork_ns[-1] if self.fork_ns else 0) + (self.cow_ns[-1] if self.cow_ns else 0)
        self.cost_ns = cost if self.cost_ns is None else 0.5 * self.cost_ns + 0.5 * cost
        want = self.cost_ns / max(self.budget * median_step_ns, 1)
        self.want = 1 << max(0, math.ceil(math.log2(max(want, 1))))

    def _agree(self, rt) -> None:
        """Every rank forks at the interval the most expensive rank wants
        (each measures its own fork cost: 16 against 32 was seen), or the
        newest snapshot common to all ranks is an old one."""
        if self.forced or self.want is None:
            return
        ctl = getattr(rt, "ctl", None)
        self.interval = (ctl.agree_interval(rt.rank, rt.world, self.want, word=ctl.FORK_WANT)
                         if ctl is not None else self.want)


class ForkSnapshot:
    def __init__(self, pid: int, step: int, cmd_w: int, resp_r: int, fork_ns: int, run_dir: Path, rank: int,
                 window_dir: Path | None = None):
        self.pid, self.step = pid, step
        self.stack_path = _stack_path(window_dir or run_dir, pid)  # where it dumps its stacks (stack())
        self.cmd_w, self.resp_r = cmd_w, resp_r
        self.fork_ns = fork_ns
        self.run_dir, self.rank = run_dir, rank
        self.released = False
        # One order at a time: an audit's thread and the training thread's
        # incident may both ask this snapshot; each waits for its own reply.
        self.lock = threading.Lock()
        self.incident_id = None  # set when a persistent incident keeps it for diagnosis

    @classmethod
    def take(cls, rt: Rank, k: int):
        """Fork the rank at step k.  Returns the snapshot in the rank, None in
        a replay child woken from it (which goes back into the training loop)."""
        pause_openmp()
        cmd_r, cmd_w = os.pipe()
        resp_r, resp_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.perf_counter_ns()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(cmd_w)
                os.close(resp_r)
                _name_process(f"w-snap-{rt.rank}")
                _arm_stack_dump(rt)
                _drop_shared_endpoints(keep={cmd_r, resp_w})
                order, listener_w = _serve(rt, k, cmd_r, resp_w)
                if order.get("op") == "resume":
                    rt.resume_live(order)  # taken over as the live rank (watcher/rescue.py)
                else:
                    _enter_replay(rt, order, listener_w)
            except BaseException:
                # A snapshot or a replay child that cannot do its job must
                # never fall back into the training loop unsandboxed.
                try:
                    traceback.print_exc()
                finally:
                    os._exit(70)
            return None
        os.close(cmd_r)
        os.close(resp_w)
        fork_ns = time.perf_counter_ns() - t0
        rt.snap_policy.fork_ns.append(fork_ns)
        return cls(pid, k, cmd_w, resp_r, fork_ns, rt.run_dir, rt.rank, rt.window_dir)

    def replay(self, to_step: int, out_dir: ReplayDir, timeout: float = 300.0,
               exchange: Path | None = None, variant: dict | None = None, state_copy: int | None = None,
               audit: bool = False) -> dict:
        """Re-execute steps step+1..to_step in a sandboxed child; returns how it ended.
        With `exchange` (a directory shared by every rank's replay of this
        window) the replay is coordinated: collectives are computed from the
        replayed inputs of all ranks instead of answered from the record.
        `variant` makes it a counterfactual replay (variants.py).  With
        `state_copy` (a step) the replay starts from that step's state copy
        (state_copy.py) instead of the snapshot's own state.  An `audit`
        replay (runtime/audit.py) runs at the lowest CPU priority."""
        with self.lock:
            return self._replay(to_step, out_dir, timeout, exchange, variant, state_copy, audit)

    def _replay(self, to_step, out_dir, timeout, exchange, variant, state_copy, audit) -> dict:
        out_dir.make()
        order = replay_order(self.rank, to_step, out_dir, exchange, timeout, variant)
        order["state_copy"] = state_copy
        order["nice"] = 19 if audit else 0
        t0 = time.monotonic()
        os.write(self.cmd_w, (json.dumps(order) + "\n").encode())
        reply = _read_reply(self.resp_r, timeout)
        reply["wall_s"] = round(time.monotonic() - t0, 3)
        if reply.get("timeout") and not reply.get("pid"):
            # The snapshot never started the replay: say where it is stuck.
            reply["snapshot_stack"] = self.stack()
            print(f"watcher: rank {self.rank}: snapshot {self.step} (pid {self.pid}) did not answer a replay "
                  f"order in {timeout:.0f} s; its stacks:\n{reply['snapshot_stack']}", file=sys.stderr, flush=True)
        if reply.get("timeout") and reply.get("pid"):
            try:
                os.kill(reply["pid"], signal.SIGKILL)
            except OSError:
                pass
            reply.update(_read_reply(self.resp_r, 10.0))
            reply["timed_out"] = True
        return reply

    def retain(self, until: float, window_dir: Path, orders: Path) -> bool:
        """Keep the snapshot after this rank exits, until wall time `until`,
        serving replay orders written as files into `orders` (`watcher
        diagnose`) from the window copied to `window_dir`.  It exits at
        `until`, on an exit order (`watcher release`), or when killed."""
        order = {"op": "retain", "until": until, "window_dir": str(window_dir), "orders": str(orders)}
        try:
            os.write(self.cmd_w, (json.dumps(order) + "\n").encode())
            ok = _read_reply(self.resp_r, 10.0).get("status") == "retained"
        except OSError:
            ok = False
        if not ok:
            self.release()
            return False
        self.released = True
        for fd in (self.cmd_w, self.resp_r):  # the snapshot sees EOF and becomes an orphan
            try:
                os.close(fd)
            except OSError:
                pass
        return True

    def stack(self) -> str | None:
        """The snapshot's Python stacks, every thread, dumped by faulthandler on request."""
        try:
            os.kill(self.pid, STACK_SIGNAL)
        except OSError:
            return None
        time.sleep(0.5)
        try:
            return self.stack_path.read_text()[-8000:] or None
        except OSError:
            return None

    def release(self) -> None:
        """Let the snapshot go; it is reaped in the background."""
        if self.released:
            return
        self.released = True
        try:
            self.stack_path.unlink()
        except OSError:
            pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        for fd in (self.cmd_w, self.resp_r):
            try:
                os.close(fd)
            except OSError:
                pass
        threading.Thread(target=_reap, args=(self.pid,), daemon=True).start()


def replay_order(rank: int, to_step: int, out_dir: ReplayDir, exchange: Path | None = None, timeout: float = 300.0,
                 variant: dict | None = None, reply: Path | None = None) -> dict:
    """The order a snapshot replays by: where the rank's result, log and
    sandbox log go, the exchange directory of a coordinated replay, and
    `reply` (a file the snapshot writes its exit status to) for an orphan."""
    return {"op": "replay", "to_step": to_step,
            "result": str(out_dir.result(rank)), "log": str(out_dir.replay_log(rank)),
            "sandbox_log": str(out_dir.sandbox_log(rank)),
            "exchange": str(exchange) if exchange else None, "exchange_timeout_s": timeout, "variant": variant,
            "reply": str(reply) if reply else None, "crash_site": str(out_dir.crash_site(rank))}


def _stack_path(window_dir: Path, pid: int) -> Path:
    return Path(window_dir) / f"snapshot-{pid}.stack"


def _arm_stack_dump(rt: Rank) -> None:
    """In the snapshot: dump every thread's Python stack to a file in the
    window directory on STACK_SIGNAL (a real-time signal, which no launcher
    sends), so a snapshot that never answers can say where it is stuck."""
    global _stack_file
    try:
        _stack_file = open(_stack_path(rt.window_dir, os.getpid()), "w")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
    except Exception:
        pass  # a snapshot without this still serves replays


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _read_reply(fd: int, timeout: float) -> dict:
    """Replies are JSON lines: first {"pid"}, then {"status"...}."""
    buf = b""
    out = {}
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            out["timeout"] = True
            return out
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            out["snapshot_gone"] = True
            return out
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            out.update(msg)
            if "status" in msg:
                return out


# -- inside the snapshot process ---------------------------------------------------------------

def _serve(rt: Rank, k: int, cmd_r: int, resp_w: int):
    """The frozen snapshot: wait for orders; return only inside a replay child.

    Orders come over the pipe from the rank.  Once the rank is gone (EOF) the
    snapshot is an orphan: it drops every copy of the rank's descriptors at
    once, so its peers see it close, and takes orders from files instead: a
    crash replay from `watcher run` within a short wait, or, if the rank asked
    to retain it, `watcher diagnose` orders until the retention deadline."""
    rt.go_quiet()  # no hook runs here
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    f = os.fdopen(cmd_r, "rb", buffering=0)
    pending = b""
    retained = None
    orphan = None
    while True:
        if orphan is None:
            chunk = f.read(4096)
            if not chunk:
                orphan = _Orphan(rt, k, retained)
                resp_w = os.open(os.devnull, os.O_WRONLY)
                continue
            pending += chunk
            if b"\n" not in pending:
                continue
            line, pending = pending.split(b"\n", 1)
            order = json.loads(line)
        else:
            order = orphan.next_order()
            if order is None:
                orphan.leave()
                os._exit(0)
        if order.get("op") == "exit":
            if orphan:
                orphan.leave()
            os._exit(0)
        if order.get("op") == "retain":
            retained = order
            _reply(resp_w, {"status": "retained"})
            continue
        if order.get("op") == "resume":
            if orphan:
                orphan.leave()
            return order, None
        if retained and not order.get("window_dir"):
            order["window_dir"] = retained["window_dir"]
        listener_r, listener_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(listener_r)
            return order, listener_w
        os.close(listener_w)
        _reply(resp_w, {"pid": pid})
        status = _supervise(pid, listener_r, order)
        os.close(listener_r)
        code = os.waitstatus_to_exitcode(status) if status is not None else None
        if order.get("exchange"):
            # A replay killed by a signal said nothing to its peers: say it
            # for it, so no peer waits out its timeout for inputs never coming.
            end_for(order["exchange"], rt.rank, f"exit {code}")
        _reply(resp_w, {"status": status, "exit_code": code})
        if order.get("reply"):  # an orphan's order: nobody reads the pipe any more
            with open(order["reply"] + ".tmp", "w") as out:
                json.dump({"pid": pid, "status": status, "exit_code": code}, out)
            os.replace(order["reply"] + ".tmp", order["reply"])
        if orphan and not retained:
            orphan.leave()
            os._exit(0)  # the crash replay was the one thing to wait for


def _drop_shared_endpoints(keep: set) -> None:
    """Let go of the rank's sockets and pipes, keeping their numbers taken.

    A snapshot holding a copy of a socket or pipe keeps it open: the peer
    never sees the rank close it, and a reader waiting for EOF waits forever.
    Each one is replaced by /dev/null under the same number, so code replayed
    from this snapshot still finds its descriptors where it left them (and the
    sandbox still traps every use of them)."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or fd == null:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode):
            cloexec = not os.get_inheritable(fd)
            os.dup2(null, fd, inheritable=not cloexec)
    os.close(null)


def _reply(fd: int, msg: dict) -> None:
    try:
        os.write(fd, (json.dumps(msg) + "\n").encode())
    except OSError:
        pass


def _supervise(pid: int, listener_r: int, order: dict):
    raw = b""
    while not raw.endswith(b"\n"):
        chunk = os.read(listener_r, 64)
        if not chunk:
            break
        raw += chunk
    try:
        hello = json.loads(raw)
    except ValueError:  # the child died before its sandbox was up
        _, status = os.waitpid(pid, 0)
        return status
    listener = sandbox.grab_listener(pid, hello["listener"])
    try:
        return sandbox.supervise(listener, pid, order["sandbox_log"], hello["inherited"])
    finally:
        os.close(listener)


class _Orphan:
    """A snapshot whose rank is gone, taking orders from files."""

    def __init__(self, rt: Rank, k: int, retained: dict | None):
        self.rt, self.k, self.retained = rt, k, retained
        self.crash_order = rt.rundir.crash_order(rt.rank, k)
        # Under a rescue (runtime/supervisor.py) this snapshot may become the
        # live rank: it keeps the files the training code has open (its
        # sockets and pipes were dropped at the fork) and says it is here.
        self.rescuable = bool(os.environ.get(supervisor.PID_ENV)) and not retained
        if self.rescuable:
            try:
                rt.rundir.rescue.mkdir(parents=True, exist_ok=True)
                rt.rundir.rescue_orphan(rt.rank, k).touch()
            except OSError:
                self.rescuable = False
        if not self.rescuable:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd > 2:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        # Without retention only a crash replay can come, and soon.
        # On many nodes the crash order comes once every node's launcher has
        # seen its job end and heard from the others (watcher/launcher_link.py).
        wait = ORPHAN_WAIT_S * (3 if len(rt.local_ranks) < rt.world else 1)
        if retained:
            wait = retained["until"] - time.time()
        self.deadline = time.monotonic() + wait

    def next_order(self) -> dict | None:
        """The next order, or None once the deadline has passed."""
        orders = Path(self.retained["orders"]) if self.retained else None
        while time.monotonic() < self.deadline:
            for path in ([self.crash_order] + (sorted(orders.glob("*.json")) if orders else [])):
                # Taken by renaming it away: served once, even when an audit's
                # fork at the same step reads the same path.
                mine = Path(f"{path}.taken{os.getpid()}")
                try:
                    os.rename(path, mine)
                except OSError:
                    continue
                try:
                    with open(mine) as f:
                        order = json.load(f)
                    os.unlink(mine)
                    return order
                except (OSError, ValueError):
                    continue
            time.sleep(0.05)
        return None

    def leave(self) -> None:
        """The window copy served only this snapshot: remove it on the way out."""
        if self.rescuable:
            try:
                os.unlink(self.rt.rundir.rescue_orphan(self.rt.rank, self.k))
            except OSError:
                pass
        if not self.retained:
            return
        for p in segment_paths(Path(self.retained["window_dir"]), self.rt.rank, self.k):
            try:
                os.unlink(p)
            except OSError:
                pass


# -- inside the replay child ------------------------------------------------------------------------

def _name_process(name: str) -> None:
    """Named for `ps`, the recording and `watcher info`: a snapshot or a replay
    is not a rank (the name is 15 bytes at most)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _enter_replay(rt: Rank, order: dict, listener_w: int) -> None:
    t_fork = time.monotonic_ns()
    _name_process(f"w-replay-{rt.rank}")
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if order.get("nice"):
        os.nice(order["nice"])  # an audit: the live ranks' training always runs first
    window = Window.load(segment_paths(Path(order.get("window_dir") or rt.window_dir), rt.rank, rt.step))
    t_window = time.monotonic_ns()
    result = open(order["result"], "wb")
    log_fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    state = ReplayState(rt, window, order, result)
    allowed = {result.fileno(), 1, 2, log_fd, listener_w}
    if order.get("crash_site"):  # a replay that dies says where, as the rank did
        site_fd = crashsite.arm(Path(order["crash_site"]))
        if site_fd is not None:
            allowed.add(site_fd)
    if order.get("exchange"):
        xfd = os.open(exchange_path(order["exchange"], rt.rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        state.exchange = Exchange(Path(order["exchange"]), rt.rank, rt.world, xfd)
        allowed.add(xfd)
    if order.get("state_copy") is not None:
        _load_copy(rt, state, window, order["state_copy"])
    state.extra["sandbox"] = sandbox.harden()
    listener, inherited = sandbox.install(allowed)
    os.write(listener_w, (json.dumps({"listener": listener, "inherited": inherited}) + "\n").encode())
    os.close(listener_w)
    state.inherited_fds = inherited
    state.setup_ms.update(window_load=round((t_window - t_fork) / 1e6, 1),
                          sandbox=round((time.monotonic_ns() - t_window) / 1e6, 1))
    if state.variant:
        variants.setup(rt, state, state.variant)
    rt.enter_replay(state)
    sys.excepthook = state.on_exception
    threading.excepthook = lambda a: state.on_exception(a.exc_type, a.exc_value, a.exc_traceback)


def _load_copy(rt: Rank, state, window, step: int) -> None:
    """Move this replay child from the snapshot's step to a later state copy,
    and check the copy against the parameter checksum recorded at that step."""
    t0 = time.monotonic_ns()
    try:
        if rt.copies is None:
            raise CopyUnusable("this snapshot has no state copies")
        rt.copies.load(rt, step)
    except CopyUnusable as e:
        state.finish("copy_unusable", str(e))
    want = full_param_sum(window.steps.get(step) or {})
    got = params_sum(rt.params())
    if want is None or got != want:
        state.finish("copy_unusable", f"the copy of step {step} has parameter checksum {got}, the record {want}")
    state.from_step = rt.step
    state.setup_ms["state_copy"] = round((time.monotonic_ns() - t0) / 1e6, 1)
