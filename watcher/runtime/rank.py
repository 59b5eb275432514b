"""The per-rank runtime: step capture, snapshots, detectors, incident handling.

A step is delimited by the main optimizer's `step()` (the optimizer with the
most parameters, the first one stepped on a tie); its loss is the root of the
last scalar `backward()`.  At each step end the runtime writes a fingerprint
(loss, grad norm, parameter checksum [one part of the parameters a step, see
checksum.PARTS], batch digest, RNG digest), keeps what a
replay needs in the current window segment, maybe forks a snapshot, runs the
detectors, and joins an open incident when it reaches the incident's halt step.

In a replay child the same hooks run in `replay` mode: batches and collective
outputs come from the window, and every fingerprint and collective input is
compared with the record.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import json
import os
import shutil
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import dataloader

from ..analysis.detectors import Detectors
from ..health import cpu_now
from ..replay.protocol import handle_incident
from ..replay.snapshot import ForkSnapshot, SnapshotPolicy
from ..replay.state_copy import CopyPolicy, StateCopies
from ..rundir import STOP_EXIT_CODE, RunDir, write_json
from . import collectives, crashsite, inject, relink, remedies, supervisor, transport
from .audit import Audit
from .checksum import PARTS, ParamChecksum, ReducedGradNorm, object_sum, rng_digest, tensors_sum
from .collectives import computed_in_replay
from .control import PAUSE_RUNTIME, Control, process_state
from .nodes import NodeLayout, NodeLink
from .preflight_probe import PreflightProbe
from .samples import row_digests, without_rows
from .stall import StallWatch, where_waiting
from .straggler import StragglerWatch
from .training import optimizer_params, scan_training_objects
from .window import END_OF_DATA, SegmentWriter, segment_paths, segment_step

HOST = os.uname().nodename

# A hang whose halt step no rank reaches is handled by the watchdog after this
# long without progress past seeing it (the hang limit, within these bounds).
STUCK_GRACE_MIN_S, STUCK_GRACE_MAX_S = 5.0, 60.0

RUNTIME: "RankRuntime | None" = None


# How long a rank's exit waits for the audits of the windows it recorded last (audit.py).
AUDIT_EXIT_WAIT_S = 60.0
# How long a resumed rank waits for its peers to rebuild each group (resume_live).
RESCUE_JOIN_S = 60.0
# Transports replaced by a rescue: never destroyed (their threads died with the old process).
_FORSAKEN: list = []


def _comm() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python"


def _reopen_stdio(supervisor_pid: int) -> None:
    """A snapshot's standard streams that were pipes are /dev/null (dropped
    at its fork): open them again where the supervisor's still point."""
    if not supervisor_pid:
        return
    for fd, mode in ((0, os.O_RDONLY), (1, os.O_WRONLY | os.O_APPEND), (2, os.O_WRONLY | os.O_APPEND)):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != os.devnull:
                continue
            new = os.open(f"/proc/{supervisor_pid}/fd/{fd}", mode)
        except OSError:
            continue
        os.dup2(new, fd)
        os.close(new)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class RankRuntime:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.rundir = RunDir(self.run_dir)
        self.dir = self.rundir.runtime
        # The window's segments: on tmpfs when `watcher run` provides it.
        # Writing ~1 MB a step to a disk-backed file cost the reference job
        # ~18% in writeback; tmpfs is a memcpy, and still outlives a crashed rank.
        self.window_dir = Path(os.environ.get("WATCHER_WINDOW_DIR") or self.dir)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.policy = os.environ.get("WATCHER_POLICY", "recover")
        self.mode = "live"
        self.disabled = False
        self.active = False
        self.step = -1                # last completed step
        self.main_opt = None
        self.fetch_idx = 0
        self.groups: list = []
        self.last_loss = None
        self.batch_sums: list = []
        self.done_colls: list = []    # completed this step (meta with out_sum)
        self.pending: list = []       # (meta, outs, work) with no completion callback
        self.snapshots: list = []
        self.retained: list = []      # a persistent incident's snapshot, kept out of rotation for diagnosis
        self.last_end_ns = None
        self.last_coll_done_ns = 0    # a collective completing is progress too (stall.py)
        self.store = None             # the job's store after a rescue (resume_live); else c10d's
        self.resumed_by = None        # the rescue that resumed this process, until its first step is logged
        self.resumed = False          # set in a snapshot taken over as the live rank, until it leaves step_end
        self.snapshot_next = False    # take a snapshot at the next step end, whatever the interval
        self.comm = _comm()
        # Time the rank spent in Watcher's own code since the last step was
        # logged (hooks, checksums, captures, snapshots): `watcher_us` per step,
        # what Watcher costs the job, measured where it is spent.
        self.own_ns = 0
        self.hook_t0 = self.fp_perf = 0
        self.step_ns: list[int] = []
        self.handled_seq = 0
        # The incident one thread has taken to handle: the training thread at
        # the halt step, or the watchdog when no rank can reach it (stuck).
        self.claimed_seq = 0
        self.claim_lock = threading.Lock()
        self.seen_incident = (0, 0)   # (seq, monotonic ns) when this rank first saw an open hang
        self.stuck_seq = 0            # the incident handled while the training thread was stuck
        self.hang_for_end = None      # the step end after which the last hang was opened: once per stall
        self.replicated = None        # do all ranks hold identical parameters (DDP)?
        self.replica_votes = 0        # steps so far on which they did (check_replicas)
        self.sdc_checked = -1
        self.replay = None            # replay.state.ReplayState in a replay child
        self.unsupported = None       # why this rank cannot be replayed, if it cannot
        self.in_flight = 0            # collectives issued and not completed
        self.waiting: dict = {}       # (group, seq) -> (meta, group) of those with a completion callback
        self.callbacks_held: set = set()  # weak refs to completion callbacks gloo's threads still hold
        self.retries: list = []       # threads retrying a failed collective (relink.py), joined at exit
        self.skip_digests: set = set()  # samples a skip_batch prescription keeps out (replay/diagnose.py)
        self.skip_reason = None
        self.exiting = False
        self.window_gap = -1          # the last step run paused (is_paused): no replay crosses it
        self.resnapshot = False
        self.abnormal_exit = False    # an uncaught exception is ending the process
        self.modules = None           # id -> module owning the main optimizer's parameters (for a merge)
        self.schedulers = None        # the LR schedulers of the main optimizer (for a state copy)
        self.param_sum = ParamChecksum()
        self.grad_norm = ReducedGradNorm()
        self.snapshot_mb: float | None = None  # private MB of the last snapshot measured (step_end)
        # `watcher run --replay-check STEP`: replay a healthy window on purpose.
        self.replay_check_step = int(os.environ.get("WATCHER_REPLAY_CHECK", "-1"))
        self.fault_hooks: list = []   # drills only: (stage, fn); see watcher.runtime.inject
        self.link = None              # nodes.NodeLink on a multi-node job
        self.audit = None             # audit.Audit: the background SDC audit (live ranks only)
        self.preflight = None         # preflight_probe.PreflightProbe under `watcher preflight`
        self.local_ranks = list(range(self.world))  # the global ranks on this node
        self.halt_margin = 1          # steps from detection to the halt
        self._forking_snapshot = False  # between ForkSnapshot.take's fork and its return (see _child_is_not_a_rank)
        self.detectors = Detectors.from_env()
        self.stalls = StallWatch(self)  # read by the watchdog thread (stall.py)
        self.stragglers = StragglerWatch(self)
        budget = _env_float("WATCHER_SNAPSHOT_BUDGET", 1.0) / 100.0
        # State copies between forks (replay/state_copy.py) share the budget
        # with the forks, two thirds to the copies: the copy interval sets
        # the replay window of a transient, the fork interval only that of a
        # persistent failure (or of a copy that does not stand).
        # WATCHER_COPY_INTERVAL=0 turns copies off.
        self.copy_off = os.environ.get("WATCHER_COPY_INTERVAL") == "0"
        self.copies = None            # replay.state_copy.StateCopies, made before the first fork
        self.snap_policy = SnapshotPolicy(budget if self.copy_off else budget / 3)
        if not self.copy_off:
            self.copy_policy = CopyPolicy(budget * 2 / 3)
        self._lock = threading.Lock()

    # -- fail open -----------------------------------------------------------------------
    def fail(self, e: BaseException) -> None:
        """A Watcher bug: record it and get out of the way for good."""
        if self.disabled:
            return
        self.disabled = True
        if self.mode == "replay":  # stderr is the replay log here
            traceback.print_exception(e)
            sys.stderr.flush()
            os._exit(70)
        try:
            self.close()  # snapshots and the window serve nothing any more
        except Exception:
            pass
        try:  # the peers must not wait for this rank at an incident, nor for its checksums
            if self.active:
                self.ctl.mark_gone(self.rank)
        except Exception:
            pass
        try:
            with open(self.rundir.error_log(self.rank), "a") as f:
                f.write("".join(traceback.format_exception(e)))
            print(f"watcher: runtime disabled on rank {self.rank} after an internal error: {e}",
                  file=sys.stderr, flush=True)
        except Exception:
            pass

    def activate(self) -> None:
        if self.active or self.disabled:
            return
        self.active = True
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ctl = Control(self.dir)
        # One log of JSON lines per rank: each step's collectives (lines with
        # "seq"), then the step's fingerprint; one write a step reaches the file.
        self.steps_log = open(self.rundir.steps_log(self.rank), "a", buffering=1 << 16)
        # No segment before the first snapshot: nothing could replay it.
        # Capped, and never more than a quarter of the free space shared by this node's ranks.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world)) or 1
        cap = min(float(os.environ.get("WATCHER_WINDOW_MAX_MB", "4096")) * (1 << 20),
                  shutil.disk_usage(self.window_dir).free / 4 / local)
        self.seg = SegmentWriter(self.window_dir, self.rank, max_bytes=int(cap))
        self._link_nodes()
        try:
            job = {"world": self.world, "local_ranks": self.local_ranks}
            if self.link is not None:  # where the launchers find each other after the job (launcher_link.py)
                lay = self.link.layout
                job.update(node=lay.node, nodes=lay.nodes, master_addr=lay.master_addr,
                           master_port=lay.master_port, run_id=lay.run_id)
            write_json(self.rundir.job, job)
            me = process_state(os.getpid())
            write_json(self.rundir.rank_process(self.rank), {"pid": os.getpid(), "start_ticks": me and me[1]})
        except OSError:
            pass
        crashsite.arm(self.rundir.crash_site(self.rank))  # where this rank dies, if it dies of a signal
        self.handled_seq = self.ctl.incident_seq
        if self.mode == "live":
            self.audit = Audit.from_env(self)
            if os.environ.get("WATCHER_PREFLIGHT_STEPS"):
                self.preflight = PreflightProbe(self, int(os.environ["WATCHER_PREFLIGHT_STEPS"]))
        self.watchdog = threading.Thread(target=self._watchdog, name="watcher-watchdog", daemon=True)
        self.watchdog.start()
        # A normal exit lets the snapshots go at once; after a crash they
        # outlive the rank briefly, for a crash replay.
        atexit.register(self.at_exit)

    def _link_nodes(self) -> None:
        """On a multi-node job, link this node's control block and run
        directory to the job's through its c10d store (nodes.py)."""
        layout = NodeLayout.from_env()
        if layout is None:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world) or self.world)
            if local_world < self.world:
                self.refuse(f"multi-node job ({self.world} ranks, {local_world} on this node) with no store address "
                            "(MASTER_ADDR, MASTER_PORT): capture and detection go on, snapshots and replay are off")
            return
        try:
            self.link = NodeLink(self.ctl, layout)
        except Exception as e:
            self.refuse(f"multi-node job ({self.world} ranks, {layout.local_world} on this node): the job's store "
                        f"at {layout.master_addr}:{layout.master_port} is unreachable ({e}); capture and detection "
                        "go on, snapshots and replay are off")
            return
        if layout.leader:
            try:
                self.link.start_relay()
            except Exception as e:
                self.link = None
                self.refuse(f"multi-node job: cannot start this node's relay to the job's store ({e}); capture "
                            "and detection go on, snapshots and replay are off")
                return
        self.ctl.link = self.link
        self.rundir.shared = self.link.store
        self.local_ranks = layout.local_ranks()
        self.halt_margin = 2  # see nodes.py: the leader learns of an incident one step later

    def refuse(self, reason: str, whole: bool = True, say: bool = True) -> None:
        """Protection is off for this rank (whole: snapshots and replay; else
        the part `reason` names): say so once, on the job's stderr (unless
        another rank says it for the node) and in the run directory."""
        if self.unsupported is not None:
            return
        if whole:
            self.unsupported = reason
        if say:
            print(f"watcher: rank {self.rank}: {reason}", file=sys.stderr, flush=True)
        try:
            write_json(self.rundir.refusal(self.rank), {"rank": self.rank, "reason": reason, "ts": time.time()})
        except OSError:
            pass

    def is_paused(self) -> bool:
        """Watcher paused for an overhead measurement (the control block's
        `paused` word, set by `just bench run`): every hook passes straight
        through.  Snapshots, copies and the window stay as they are, so the
        "on" time after a pause costs what it does in a long run; a snapshot
        older than the last paused step is not offered for a replay (its
        window misses the paused steps)."""
        return self.active and self.ctl.paused & PAUSE_RUNTIME != 0

    # -- hooks (called from patched torch entry points) -------------------------------------
    def on_backward(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 1:
            self.last_loss = tensor.detach()

    def next_batch(self, it, orig):
        """Called instead of DataLoader's __next__.  The user's iterator runs
        unguarded (its errors are the user's); Watcher's parts are guarded."""
        if self.disabled:
            return orig(it)
        try:
            self.activate()
            idx = self.fetch_idx
            self.fetch_idx += 1
            replaying = self.mode == "replay"
            paused = self.is_paused()
        except Exception as e:
            self.fail(e)
            return orig(it)
        if paused:
            return orig(it)
        if replaying:
            batch = self.replay.batch(idx, it, orig)
        else:
            try:
                batch = orig(it)
            except StopIteration:
                _guard(lambda rt: rt.seg.put(("batch", idx, END_OF_DATA)))()
                raise
        t0 = time.perf_counter_ns()
        try:
            for stage, fn in self.fault_hooks:
                if stage == "batch":
                    batch = fn(self, batch)
            if self.skip_digests and self.mode == "live":
                batch = self._skip_known_bad(batch)
            self.batch_sums.append(object_sum(batch))
            if self.mode == "live":
                self.seg.put(("batch", idx, batch), copy=True)  # the user may modify it in place
                if idx == 0 and self.preflight is not None:
                    self.preflight.first_batch(it, batch)
        except Exception as e:
            self.fail(e)
        self.own_ns += time.perf_counter_ns() - t0
        return batch

    def _skip_known_bad(self, batch):
        """Remove the samples an applied skip_batch prescription named, as
        they arrive (before the window records the batch, so a replay trains
        on what the live rank did).  A batch made only of them is kept
        whole: every rank must still take the same number of steps."""
        digests = row_digests(batch)
        rows = [i for i, d in enumerate(digests) if d in self.skip_digests]
        if not rows or len(rows) == len(digests):
            return batch
        with open(self.rundir.skipped_log(self.rank), "a") as f:
            f.write(json.dumps({"step": self.step + 1, "rank": self.rank, "rows": rows,
                                "digests": [str(digests[i]) for i in rows], "incident_id": self.skip_reason}) + "\n")
        print(f"watcher: rank {self.rank} step {self.step + 1}: skipped sample(s) {rows} "
              f"(prescribed by {self.skip_reason})", file=sys.stderr, flush=True)
        return without_rows(batch, rows)

    def before_collective(self, meta: dict) -> None:
        self.activate()
        for stage, fn in self.fault_hooks:
            if stage == "before_collective":
                fn(self, meta)
                meta["ts"] = time.monotonic_ns()  # the rank reaches the collective only now

    def track_collective(self, meta: dict, outs: list, work, retry=None, group=None, release=None) -> None:
        """Record the collective when it completes.  `retry(error)` (for groups
        whose transport Watcher can rebuild) runs the collective again after
        a failure and returns its result, or raises.  `release()` runs once
        the collective is recorded (its retry copy is free again)."""
        def capture(fut=None):
            t0 = time.perf_counter_ns()
            if release is not None:
                release()
            try:
                for stage, fn in self.fault_hooks:
                    if stage == "collective_output":
                        fn(self, meta, outs)
                now = time.monotonic_ns()
                meta["dur"] = now - meta["ts"]
                self.last_coll_done_ns = now
                self.in_flight -= 1
                self.waiting.pop((meta["group"], meta["seq"]), None)
                # The window gets the step's collectives with its step record
                # (step_end): one write a step, none here, where the waiting
                # training thread pays for every microsecond.
                if computed_in_replay(meta):
                    # A replay computes these outputs from every rank's replayed
                    # inputs: the record keeps only their checksum, taken before
                    # anyone can read (or overwrite) them.
                    meta["out_sum"] = self.grad_norm.out_sum(meta, outs)  # DDP's buckets: the norm's pass too
                    self.done_colls.append((meta, None))
                    return
                # Outputs a replay must be served: copy them now (nothing may
                # overwrite them first); the checksum waits for the step end.
                self.done_colls.append((meta, [o.detach().clone() for o in outs]))
            except Exception as e:
                self.fail(e)
            finally:
                self.own_ns += time.perf_counter_ns() - t0

        if work is None:
            capture()
            return None
        try:
            fut = work.get_future()
        except Exception:
            self.pending.append((meta, outs, work, capture))
            return work

        # Whoever waits on the work (DDP's reducer, the user's wait()) waits on
        # `done`, which completes only after the outputs were recorded: nothing
        # can overwrite them first.  A failure goes to the waiter as it is, or,
        # where the transport can be rebuilt, is retried first.
        done = torch.futures.Future()
        self.waiting[(meta["group"], meta["seq"])] = (meta, group)

        def finished(f):
            if threading.get_ident() not in _KEPT_STATES:
                _keep_thread_state()
            try:
                value = f.value()
            except Exception as e:
                if retry is None:
                    self.waiting.pop((meta["group"], meta["seq"]), None)
                    done.set_exception(e)
                else:  # rebuild and retry off gloo's thread
                    t = threading.Thread(target=self._retry, args=(retry, e, capture, done), daemon=True,
                                         name="watcher-relink")
                    self.retries = [r for r in self.retries if r.is_alive()] + [t]
                    t.start()
                return
            capture()
            done.set_result(value)

        # add_done_callback, not then(): then() leaves a child future holding
        # a Python object for gloo's thread to free.  The weak reference says
        # when gloo's thread has let go of `finished` (see quiesce()).
        self.callbacks_held.add(weakref.ref(finished, self.callbacks_held.discard))
        fut.add_done_callback(finished)
        return _done_later(done)

    def _retry(self, retry, error, capture, done) -> None:
        try:
            value = retry(error)
        except BaseException:
            done.set_exception(error)  # whatever happened in Watcher, training sees the real failure
            return
        capture()
        done.set_result(value)

    def on_optimizer_step(self, opt) -> None:
        self.hook_t0 = time.perf_counter_ns()
        if self.main_opt is None or (opt is not self.main_opt and _n_params(opt) > _n_params(self.main_opt)):
            self.main_opt = opt
        if opt is not self.main_opt:
            return
        self.activate()
        if self.is_paused():
            self.step += 1
            self.window_gap = self.step
            self.last_end_ns = None
            self.done_colls.clear()
            self.batch_sums.clear()
            return
        if self.mode == "replay":
            with self.replay.untraced():
                fp = self.fingerprint()
            self.replay.step_end(self, fp)
            return
        self.step_end()

    # -- step end (live) --------------------------------------------------------------------
    def params(self) -> list:
        return optimizer_params(self.main_opt)

    def fingerprint(self) -> dict:
        self.step += 1
        k = self.step
        now = time.monotonic_ns()
        self.fp_perf = time.perf_counter_ns()  # the step's end: what follows is the next step's time
        for item in list(self.pending):
            meta, outs, work, capture = item
            if work.is_completed():
                capture()
                self.pending.remove(item)
        params = self.params()
        grads = [p.grad for p in params if p.grad is not None]
        gn = self.grad_norm(k, grads)
        loss = float(self.last_loss) if self.last_loss is not None else None
        colls, self.done_colls = self.done_colls, []
        bsums, self.batch_sums = self.batch_sums, []
        return {"step": k, "rank": self.rank, "ts": now,
                "dur": now - self.last_end_ns if self.last_end_ns else None,
                "loss": loss, "grad_norm": gn, "param_sum": self.param_sum(params, k % PARTS),
                "batch_sum": _combine(bsums), "rng": rng_digest(), "n_coll": len(colls),
                # The core the step ended on: the device a failure of this step is pinned on (health.py).
                "cpu": cpu_now(), "_colls": colls}

    def step_end(self) -> None:
        fp = self.fingerprint()
        k = fp["step"]
        colls = fp.pop("_colls")
        if self.link is not None:
            fp["host"] = HOST  # the ledger names a core with its host (health.py)
        if self.last_end_ns is not None:
            self.step_ns.append(fp["ts"] - self.last_end_ns)
            if len(self.step_ns) > 64:
                del self.step_ns[:32]
        self.last_end_ns = fp["ts"]
        self.stalls.step_ended(fp["ts"])
        if self.mode == "live":
            self.stragglers.step_ended(k, fp["dur"], [meta for meta, _ in colls])
        coll_lines = self._log_colls(colls)
        fp["snapshot"] = False
        self.ctl.beacon(self.rank, k, fp["param_sum"])
        incident = self.detect(fp)
        if incident:
            incident.update(rank=self.rank, halt_step=k + self.halt_margin, detected_ts=fp["ts"],
                            detected_unix=time.time(), unsupported=self.unsupported)
            self.ctl.open_incident(incident)
        if self.link is not None and self.link.layout.leader:
            try:
                self.link.sync()  # the job's incidents reach this node before its ranks end the next step
            except Exception:
                self.link.errors += 1
        open_incident = self.ctl.incident_seq > self.handled_seq
        fork_due = not open_incident and self.unsupported is None and (self.snap_policy.due(k, self)
                                                                       or self.snapshot_next)
        self.snapshot_next = False
        if (not fork_due and not open_incident and self.copies is not None and self.snapshots
                and self.copies.off_reason is None and self.copy_policy.due(k, self, self.copies)):
            if self.copies.take(self, k):
                fp["state_copy_us"] = self.copies.last_ns // 1000
                fp["param_sum_full"] = self.param_sum(self.params())  # the copy is verified whole
        if fork_due:
            fp["param_sum_full"] = self.param_sum(self.params())  # so is the snapshot
            self.take_snapshot(k)
            if self.mode != "live" or self.resumed:
                self.resumed = False
                return  # a replay child, or the rank resumed, woken from this snapshot: back to the training loop
            fp["snapshot"] = True
            snap = self.snapshots[-1]
            fp["fork_ms"] = round(snap.fork_ns / 1e6, 3)
            fp["snapshot_interval"] = self.snap_policy.interval
            if len(self.snapshots) > 1:
                # What the previous snapshot cost in memory over one interval:
                # the pages the rank rewrote since, now private to the snapshot.
                # Walking its page tables takes milliseconds: off the step, the
                # figure rides on a later step's line.
                threading.Thread(target=self._measure_snapshot, args=(self.snapshots[-2].pid,), daemon=True,
                                 name="watcher-snapmem").start()
        if self.audit is not None and self.mode == "live" and not open_incident and self.audit.fork_due(k):
            if "param_sum_full" not in fp:
                fp["param_sum_full"] = self.param_sum(self.params())  # an audit's fork is verified whole too
            snap = self.take_fork(k)
            if snap is None:
                self.resumed = False
                return  # a replay child (or the rank resumed), woken from this fork: back to the training loop
            self.audit.add_fork(k, snap)
            fp["audit_fork"] = True
        if self.snapshot_mb is not None:
            fp["prev_snapshot_private_mb"], self.snapshot_mb = self.snapshot_mb, None
        fp["watcher_us"] = (self.own_ns + self.fp_perf - self.hook_t0) // 1000
        self.own_ns = 0
        if self.resumed_by is not None:  # the first step of a resumed timeline: older snapshots are gone
            fp["resumed"], self.resumed_by = self.resumed_by, None
        line = json.dumps(fp)
        # The window's step record is the logged line and the step's
        # collectives (their lines and any outputs kept to be served): one
        # record a step, each value serialized once.
        self.seg.put(("step", line, coll_lines, [copies for _, copies in colls]))
        self.steps_log.write(line + "\n")
        # Every step reaches the file at once: a rank killed by a signal
        # flushes nothing, and its last steps are what a crash report needs.
        self.flush_logs()
        if self.audit is not None and self.mode == "live":
            self.audit.step_ended(k)  # after this step's record: an audit's window may end here
        if self.preflight is not None and self.mode == "live":
            self.preflight.step_ended(k)  # after its last step, the rank exits here
        # This hook's work after the step's end timestamp (checksums, detection,
        # a snapshot's fork, logging) falls in the next step's duration.
        self.own_ns += time.perf_counter_ns() - self.fp_perf
        if open_incident:
            seq = self.ctl.incident_seq
            info = self.ctl.incident(seq)
            if info.get("resolved"):
                self.handled_seq = seq  # recovered where it happened (relink.py): nothing to halt for
            elif self.unsupported or info.get("unsupported"):
                self.handled_seq = seq  # recorded, not replayed: `watcher run` writes it up
                if self.rank == 0:
                    self.ctl.verdict_seq = max(self.ctl.verdict_seq, seq)  # the next incident may open
            elif k >= info["halt_step"] and not self.claim_incident(seq):
                # The watchdog handled it while this thread was stuck (out of
                # band): wait for its end, then go on from here.
                while self.handled_seq < seq:
                    time.sleep(0.01)
            elif k >= info["halt_step"]:
                # The halt and the replay are not training time: no stall, no
                # hang (the watchdog skips while this is None), no step-time sample.
                self.last_end_ns = None
                handle_incident(self, seq, info)
                self.last_end_ns = None
                if self.resnapshot:  # recovered: the next replay starts from the recovered state
                    self.resnapshot = False
                    self.take_snapshot(k)

    def _measure_snapshot(self, pid: int) -> None:
        self.snapshot_mb = _private_mb(pid)

    def _log_colls(self, colls: list) -> list[str]:
        """Log the collectives; their lines, for the window's step record."""
        lines = []
        for meta, copies in colls:
            if copies is not None:
                meta["out_sum"] = tensors_sum(copies)
            line = json.dumps(meta)
            self.steps_log.write(line + "\n")
            lines.append(line)
        return lines

    def _log_last_colls(self) -> None:
        """Collectives after the last optimizer step (a final barrier, an
        evaluation's all_reduce) belong to a step that never ends: at exit
        they are logged under its number."""
        if self.mode != "live":
            return
        colls, self.done_colls = self.done_colls, []
        try:
            lines = self._log_colls(colls)
            if lines:  # a crash replay may run up to them
                self.seg.put(("colls", lines, [copies for _, copies in colls]))
        except Exception as e:
            self.fail(e)

    def flush_logs(self) -> None:
        self.steps_log.flush()

    def detect(self, fp: dict) -> dict | None:
        if fp["step"] == self.replay_check_step and self.rank == 0:
            return {"kind": "replay_check", "failing_step": fp["step"], "detail": None}
        hit = self.detectors.check_step(fp)
        if hit:
            return hit
        return self.check_replicas(fp["step"])

    def check_replicas(self, k: int) -> dict | None:
        """SDC: under DDP every rank holds the same parameters after each step."""
        if self.world < 2:
            return None
        here = range(self.world)
        for s in range(max(self.sdc_checked + 1, k - 7), k + 1):
            sums = [self.ctl.beacon_at(r, s) for r in here]
            if None in sums and len(here) == self.world:
                # Only now (not every step) look for ranks that failed open: they report nothing.
                here = [r for r in range(self.world) if not self.ctl.gone(r)]
                sums = [v for r, v in enumerate(sums) if r in here]
            if None in sums:
                break
            self.sdc_checked = s
            same = len(set(sums)) == 1
            if self.replicated is None:
                # Decided over the first PARTS steps every rank reported (each
                # covers one part of the parameters): replicas agree on all of them.
                if not same:
                    self.replicated = False
                else:
                    self.replica_votes += 1
                    if self.replica_votes >= PARTS:
                        self.replicated = True
                continue
            if self.replicated and not same and self.detectors.sdc:
                return {"kind": "sdc", "failing_step": s,
                        "detail": {"param_sums": dict(zip(here, sums))}}
        return None

    # -- snapshots ----------------------------------------------------------------------------
    def take_fork(self, k: int):
        """Fork the rank at step k, and start a window segment there.  Returns
        the fork in the rank, None in a replay child woken from it."""
        self.flush_logs()
        if self.modules is None and self.main_opt is not None:
            self.modules, self.schedulers = scan_training_objects(self.params(), self.main_opt)
        if self.copies is None and not self.copy_off and self.main_opt is not None:
            self.copies = StateCopies(self)  # before the fork: every snapshot shares the slots
        self._forking_snapshot = True
        try:
            snap = ForkSnapshot.take(self, k)
        finally:
            self._forking_snapshot = False
        if snap is not None and not (self.seg.segments and self.seg.segments[-1][0] == k):
            self.seg.start(k)  # (a snapshot and an audit's fork at one step share a segment)
        return snap

    def take_snapshot(self, k: int) -> None:
        snap = self.take_fork(k)
        if snap is None:
            return  # we are a replay child, returning into the training loop
        self.snapshots.append(snap)
        while len(self.snapshots) > self.snap_policy.keep:
            old = self.snapshots.pop(0)
            old.release()
        self.drop_window()

    def drop_window(self) -> None:
        """Forget the window before the oldest fork held (a snapshot's or an audit's)."""
        floors = [self.snapshots[0].step] if self.snapshots else []
        if self.audit is not None and self.audit.floor() is not None:
            floors.append(self.audit.floor())
        if floors:
            self.seg.drop_before(min(floors))

    def snapshot_at(self, step: int):
        for s in self.snapshots:
            if s.step == step:
                return s
        if self.audit is not None:
            return self.audit.forks.get(step)
        return None

    # -- the seam: what replay may read and ask (seam.Rank) ------------------------------------
    def usable_snapshots(self) -> list[int]:
        """Steps of the snapshots a replay may start from: none from before a measurement's pause."""
        audited = self.audit.held_steps() if self.audit is not None else []
        return sorted({s.step for s in self.snapshots if s.step > self.window_gap}
                      | {s for s in audited if s > self.window_gap})

    def counters(self) -> dict:
        return {"step": self.step, "fetch_idx": self.fetch_idx, "seqs": [g.seq for g in self.groups]}

    def restore_counters(self, counters: dict) -> None:
        self.step, self.fetch_idx = counters["step"], counters["fetch_idx"]
        for g, seq in zip(self.groups, counters["seqs"]):
            g.seq = seq

    def flush(self) -> None:
        self.seg.flush()
        self.flush_logs()

    def incident_handled(self, seq: int) -> None:
        self.handled_seq = seq
        if self.audit is not None:
            self.audit.incident_handled()

    def open_incident(self, info: dict) -> int | None:
        """Open an incident from any thread (an audit's, the watchdog's); its seq, or None if one is open."""
        return self.ctl.open_incident(info)

    def claim_incident(self, seq: int) -> bool:
        """Take incident `seq` to handle; False if another thread of this rank has."""
        with self.claim_lock:
            if seq <= max(self.claimed_seq, self.handled_seq):
                return False
            self.claimed_seq = seq
            return True

    def retain_snapshot(self, step: int, incident_id: str) -> None:
        snap = self.snapshot_at(step)
        if snap is None:
            return
        snap.incident_id = incident_id
        if snap in self.snapshots:
            self.snapshots.remove(snap)
        elif self.audit is not None:
            self.audit.detach(snap)
        # One retained snapshot at a time: each is a copy-on-write image of the rank.
        for old in self.retained:
            old.release()
        self.retained = [snap]

    def restart_history(self) -> None:
        for snap in self.snapshots:
            snap.release()
        self.snapshots = []
        if self.audit is not None:
            self.audit.release_all()
        if self.copies is not None:
            self.copies.forget()
        self.resnapshot = True  # the next replay starts from the recovered state

    def adopt_recovered_steps(self, fingerprints: list[dict], last_step: int, param_sum: int) -> None:
        """The replayed fingerprints become the record of the recovered steps
        (the steps log keeps the last line per step), and the beacon carries
        the recovered parameters for the replica check."""
        for fp in fingerprints:
            self.steps_log.write(json.dumps(dict(fp, recovered=True)) + "\n")
        self.flush_logs()
        self.ctl.beacon(self.rank, last_step, param_sum)

    def apply_prescription(self, prescription: dict, incident_id: str) -> None:
        remedies.apply(self, prescription, incident_id)

    def stop_after_incident(self, incident_id: str) -> None:
        self.flush()
        self.close()
        os._exit(STOP_EXIT_CODE)

    def go_quiet(self) -> None:
        self.disabled = True

    def enter_replay(self, state) -> None:
        self.replay = state
        self.mode = "replay"
        self.disabled = False

    def resume_live(self, order: dict) -> None:
        """This process, a snapshot of the rank at `self.step`, becomes the
        live rank (watcher/rescue.py: every rank of the job does the same from
        its snapshot at that step, the dead one's included).  What the fork did
        not carry is rebuilt: the threads (the watchdog, the window's writer),
        the locks they might have held, the job's store connection and every
        watched group's transport (a fresh gloo group under the rescue's own
        store prefix).  The old transports are kept, never destroyed: their
        threads exist only in the dead process."""
        _reopen_stdio(int(os.environ.get(supervisor.PID_ENV) or 0))
        try:
            with open("/proc/self/comm", "w") as f:
                f.write(self.comm)
        except OSError:
            pass
        self._lock, self.claim_lock = threading.Lock(), threading.Lock()
        self.seg.after_fork()
        self.waiting, self.pending, self.retries, self.in_flight = {}, [], [], 0
        self.callbacks_held = set()
        self.done_colls, self.batch_sums = [], []
        self.last_end_ns, self.last_coll_done_ns = None, 0
        self.stalls, self.stragglers = StallWatch(self), StragglerWatch(self)
        self.restart_history()  # the snapshots held were the dead timeline's
        self.resnapshot = False
        self.snapshot_next = True  # a snapshot of the new timeline at its first step end
        self.audit = Audit.from_env(self)
        host, port = order["store"]  # hosted by `watcher run` (rescue.py): the job's may have died with a rank
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=RESCUE_JOIN_S))
        self.store = store
        if self.link is not None:
            # The link's store connections were the dead process's (shared by
            # the fork, perhaps mid-request), and its relay thread is not here.
            _FORSAKEN.append(self.link)
            self.link = NodeLink(self.ctl, self.link.layout)
            if self.link.layout.leader:
                self.link.start_relay()
            self.ctl.link = self.link
            self.rundir.shared = self.link.store
        for g in self.groups:
            before = transport.socket_inodes()
            new = dist.ProcessGroupGloo(dist.PrefixStore(f"{order['prefix']}{g.gid}/", store), g.inner.rank(),
                                        g.inner.size(), datetime.timedelta(seconds=RESCUE_JOIN_S))
            # Never destroyed, not even at exit: its destructor would join
            # threads that exist only in the dead process.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(g.inner))
            _FORSAKEN.append(g.inner)
            g.replace_inner(new)
            g.sockets = transport.opened_since(before)
        self.handled_seq = self.claimed_seq = self.ctl.incident_seq
        self.ctl.arrive(self.rank, 0, self.step)  # no longer gone
        me = process_state(os.getpid())
        write_json(self.rundir.rank_process(self.rank), {"pid": os.getpid(), "start_ticks": me and me[1],
                                                          "rescue": order.get("attempt")})
        self.mode, self.disabled, self.resumed = "live", False, True
        self.resumed_by = order.get("attempt") or 0
        self.watchdog = threading.Thread(target=self._watchdog, name="watcher-watchdog", daemon=True)
        self.watchdog.start()
        print(f"watcher: rank {self.rank} resumed from its step-{self.step} snapshot (pid {os.getpid()}, "
              f"rescue {order.get('attempt')})", file=sys.stderr, flush=True)

    def job_store(self):
        """The job's store: the one c10d made, or the rescue's connection once it replaced it."""
        return self.store if self.store is not None else c10d._get_default_store()

    # -- hang watchdog ----------------------------------------------------------------------------
    def _watchdog(self) -> None:
        while not self.disabled and self.mode == "live":
            time.sleep(0.25)
            try:
                last_end = self.last_end_ns  # read once: the training thread resets it after a recovery
                if last_end is None or not self.step_ns:
                    continue
                seq = self.ctl.incident_seq
                if seq > self.handled_seq and self.ctl.incident(seq).get("resolved"):
                    self.handled_seq = seq  # a report (a stall) or a recovered collective: nothing to wait for
                median_s = sorted(self.step_ns)[len(self.step_ns) // 2] / 1e9
                limit = self.detectors.hang_limit_s(median_s)
                now = time.monotonic_ns()
                stalled = (now - last_end) / 1e9
                if not self.exiting and self.ctl.incident_seq == self.handled_seq:
                    self.stalls.check(now, median_s)
                # A long evaluation or checkpoint between steps is not a hang;
                # a rank waiting inside a collective is.
                waiting = self.in_flight > 0 or not self.groups
                # Once per stall: a stuck hang handled out of band leaves the
                # training thread where it was, and the same silence is not a
                # second hang (under the rescue the stuck rank is being replaced).
                if stalled > limit and waiting and not self.exiting and self.ctl.incident_seq == self.handled_seq \
                        and last_end != self.hang_for_end:
                    self.hang_for_end = last_end
                    ends = [self.ctl.latest_step(r) for r in range(self.world)]
                    self.ctl.open_incident({
                        "kind": "hang", "rank": self.rank, "failing_step": max(ends) + 1,
                        "halt_step": max(ends) + 1 + self.halt_margin, "detected_ts": time.monotonic_ns(),
                        "detected_unix": time.time(),
                        "detail": {"no_progress_s": round(stalled, 3), "limit_s": round(limit, 3),
                                   "last_step_by_rank": ends}})
                if self.waiting:
                    self._abort_stuck_collectives()
                self._handle_if_stuck(limit)
            except Exception as e:
                self.fail(e)
                return

    def _handle_if_stuck(self, limit: float) -> None:
        """A hang whose halt step no rank will reach: one rank is stuck outside
        any collective (a read that never returns, a lock never released) and
        its peers wait for it inside one.  Once this rank has made no progress
        for a grace period after seeing the hang, this thread handles the
        incident itself, the training thread left where it is: the same
        protocol, every rank's watchdog arriving in place of its training
        thread (replay/protocol.py, `stuck`).  The replays start from the
        snapshots, which are separate processes, so nothing here needs the
        stuck thread."""
        seq = self.ctl.incident_seq
        if seq <= self.handled_seq or self.exiting or self.ctl.incident_seq != seq:
            return
        info = self.ctl.incident(seq)
        if info.get("kind") != "hang" or info.get("resolved") or self.unsupported or info.get("unsupported"):
            return
        now = time.monotonic_ns()
        if self.seen_incident[0] != seq:
            self.seen_incident = (seq, now)
            return
        grace = max(STUCK_GRACE_MIN_S, min(limit, STUCK_GRACE_MAX_S))
        end = self.last_end_ns
        if end is None or end > self.seen_incident[1] or (now - self.seen_incident[1]) / 1e9 < grace:
            return  # moving (or halted at the step already): the halt step will come
        if not self.claim_incident(seq):
            return
        self.stuck_seq = seq
        self.hang_for_end = end  # whichever rank opened it, this silence is handled: no second hang for it
        # Where this rank is stuck: outside any collective (the one its peers
        # wait for) or inside one (a waiter), and its training thread's frames.
        stuck = {"step": self.step + 1, "in_flight": self.in_flight, "where": where_waiting(threading.main_thread())}
        handle_incident(self, seq, info, stuck=stuck)

    def _abort_stuck_collectives(self) -> None:
        """Per-operation timeout: a collective that every member of its group
        is inside, with no progress for `collective_timeout` seconds, is a
        network fault (traffic lost, connection not reset): abort it by
        shutting down the group's sockets (transport.py), so it fails and is
        issued again on a rebuilt transport (relink.py).  A collective that a
        member has not reached is left to the hang detector: a slow or stuck
        rank is not cured by a new connection."""
        limit = self.detectors.collective_timeout
        now = time.monotonic_ns()
        for meta, group in list(self.waiting.values()):
            waited = (now - meta["ts"]) / 1e9
            if not limit or waited < limit or meta.get("aborted") or group is None or not group.sockets:
                continue
            if not relink.can_relink(self, group):
                continue
            store = self.job_store()
            prefix = f"watcher/stuck/{group.gid}/{meta['seq']}/"
            if not meta.get("said_stuck"):
                store.set(prefix + str(group.inner.rank()), "1")
                meta["said_stuck"] = True
            if not store.check([prefix + str(r) for r in range(group.inner.size())]):
                continue
            meta["aborted"], meta["stalled_s"] = True, round(waited, 3)
            n = transport.abort(group.sockets)
            print(f"watcher: rank {self.rank}: {meta['op']} #{meta['seq']} at step {meta['step']}: no progress for "
                  f"{waited:.1f} s with every member inside it; aborted ({n} connections), retrying on a new "
                  f"transport", file=sys.stderr, flush=True)

    def at_exit(self) -> None:
        """The training loop is over.  An incident opened in its last steps,
        whose halt step never came, is handled now, at this final boundary."""
        self.exiting = True  # from here no stall, hang or straggler is a finding
        if self.audit is not None and self.mode == "live" and not self.disabled:
            try:
                self.audit.drain(AUDIT_EXIT_WAIT_S)
            except Exception as e:
                self.fail(e)
        try:
            self._at_exit()
        finally:
            self.quiesce()

    def quiesce(self, timeout: float = 2.0) -> None:
        """Wait until gloo's threads have let go of every completion callback.

        Each callback's last reference is dropped on gloo's thread, which
        takes the GIL for it.  A thread taking the GIL once the interpreter
        is finalizing is ended by pthread_exit, which unwinds through C++
        destructors and aborts the process ("terminate called without an
        active exception").  A rank that exits right after its last
        collective would die of SIGABRT one time in a few without this wait.
        It lasts microseconds at a normal exit; a collective still in flight
        (a peer died) is given `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.callbacks_held and time.monotonic() < deadline:
            time.sleep(0.001)
        # A retry thread waits inside gloo's C++ as well: the same applies,
        # and to the node relay inside the store's client.
        for t in self.retries:
            t.join(max(deadline - time.monotonic(), 0))
        if self.link is not None:
            self.link.stop(max(deadline - time.monotonic(), 0.5))

    def _at_exit(self) -> None:
        if self.abnormal_exit and self.mode == "live" and self.active and not self.disabled:
            # Dying of an exception (a peer crashed, the job is failing): the
            # snapshots and the window stay, orphaned for a short while, so
            # `watcher run` can replay every rank up to the crash together.
            self._log_last_colls()
            self.flush_logs()
            self.seg.flush()
            return
        if self.disabled or self.mode != "live":
            if self.mode == "live":
                self.close()
            return
        try:
            seq = self.ctl.incident_seq
            if seq > self.handled_seq and not self.ctl.incident(seq).get("resolved") and self.claim_incident(seq):
                handle_incident(self, seq, self.ctl.incident(seq), final=True)
        except Exception as e:
            self.fail(e)
        finally:
            self.close()

    def close(self) -> None:
        if self.active:
            try:
                self._log_last_colls()
                self.flush_logs()
            except (OSError, ValueError):
                pass
        for s in self.retained:
            if not self._hand_off(s):
                s.release()
        self.retained = []
        for s in self.snapshots:
            s.release()
        self.snapshots = []
        if self.audit is not None:
            self.audit.release_all()
        if self.active:  # without snapshots the window serves nothing: free the tmpfs
            self.seg.close()
            self.seg.drop_before(1 << 62, recycle=False)
            if os.environ.get("WATCHER_WINDOW_DIR"):
                try:  # the last rank out removes the directory, if `watcher run` cannot any more
                    os.rmdir(self.window_dir)
                except OSError:
                    pass

    def _hand_off(self, snap) -> bool:
        """Keep a persistent incident's snapshot after this rank exits, for
        `watcher diagnose`, for at most `watcher run --retain` seconds.  Its
        window is copied into DIR/retained/window (tmpfs is freed at the end
        of the run); DIR/retained/rank<r>.json says where it is."""
        retain_s = _env_float("WATCHER_RETAIN_S", 0.0)
        if retain_s <= 0 or not self.active or self.mode != "live":
            return False
        try:
            self.seg.flush()
            segs = segment_paths(self.window_dir, self.rank, snap.step)
            if not segs or segment_step(segs[0]) != snap.step:
                return False  # the window since the snapshot is no longer whole
            window, orders = self.rundir.retained_window, self.rundir.retained_orders(self.rank)
            window.mkdir(parents=True, exist_ok=True)
            orders.mkdir(parents=True, exist_ok=True)
            for p in segs:
                shutil.copyfile(p, window / p.name)
            until = time.time() + retain_s
            if not snap.retain(until, window, orders):
                return False
            write_json(self.rundir.retained_info(self.rank),
                       {"rank": self.rank, "world": self.world, "pid": snap.pid, "step": snap.step,
                        "start_ticks": (process_state(snap.pid) or (None, None))[1], "until": until, "incident_id": snap.incident_id,
                        "detect": os.environ.get("WATCHER_DETECT"), "replicated": self.replicated,
                        "policy": self.policy})
            return True
        except Exception as e:  # retention is a convenience; the run's end must not fail on it
            print(f"watcher: rank {self.rank}: cannot retain snapshot {snap.step}: {e}", file=sys.stderr)
            return False


# gloo's threads enter Python for every completion callback through a thread
# state made for the call and dropped after it (a gettid, an mmap and a
# munmap of its frame stack, each traced by the recorder).  One extra
# PyGILState_Ensure, never released, keeps a thread's state for the next
# callbacks.  Such a state is deleted with the interpreter at exit; no
# callback may come after that anyway (see RankRuntime.quiesce).
_KEPT_STATES: set[int] = set()
os.register_at_fork(after_in_child=_KEPT_STATES.clear)


def _keep_thread_state() -> None:
    _KEPT_STATES.add(threading.get_ident())
    ctypes.pythonapi.PyGILState_Ensure()


def _private_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kb = sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean", "Private_Dirty")))
        return round(kb / 1024, 1)
    except (OSError, ValueError, IndexError):
        return None


def _done_later(fut):
    return collectives.HandedWork(fut)


def _n_params(opt) -> int:
    return sum(len(g["params"]) for g in opt.param_groups)


def _combine(sums: list) -> int | None:
    vals = [s for s in sums if s is not None]
    if not vals:
        return None
    acc = 0
    for v in vals:
        acc = (acc * 1000003 + v) & ((1 << 63) - 1)
    return acc


# -- installation -------------------------------------------------------------------------------

def _guard(fn):
    """Run a hook body; any exception disables Watcher, never the training."""
    def guarded(*args, **kwargs):
        rt = RUNTIME
        if rt is None or rt.disabled:
            return None
        try:
            return fn(rt, *args, **kwargs)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            rt.fail(e)
            return None
    return guarded


def install() -> None:
    global RUNTIME
    if RUNTIME is not None:
        return
    if supervisor.wanted():
        # Not split as torch's import began (bootstrap.py): torch was imported
        # before Watcher was armed.  The launcher's process stays a supervisor;
        # this one goes on as the rank.
        supervisor.split(RunDir(Path(os.environ["WATCHER_RUN_DIR"])))
    RUNTIME = RankRuntime(Path(os.environ["WATCHER_RUN_DIR"]))
    register_optimizer_step_post_hook(_guard(lambda rt, opt, args, kwargs: rt.on_optimizer_step(opt)))

    orig_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        _guard(lambda rt: rt.on_backward(self))()
        return orig_backward(self, *args, **kwargs)

    torch.Tensor.backward = backward

    orig_next = dataloader._BaseDataLoaderIter.__next__

    def __next__(self):
        rt = RUNTIME
        if rt is None or rt.disabled:
            return orig_next(self)
        return rt.next_batch(self, orig_next)

    dataloader._BaseDataLoaderIter.__next__ = __next__

    orig_init = c10d.init_process_group

    def init_process_group(*args, **kwargs):
        before = transport.socket_inodes()
        result = orig_init(*args, **kwargs)
        _guard(lambda rt: rt.wrap_default_group(before))()
        return result

    orig_new_group = c10d.new_group

    def new_group(*args, **kwargs):
        before = transport.socket_inodes()
        group = orig_new_group(*args, **kwargs)
        wrapped = _guard(lambda rt: rt.wrap_group(group, before))()
        return wrapped if wrapped is not None else group

    for mod in (c10d, dist):
        mod.init_process_group = init_process_group
        mod.new_group = new_group
    _refuse_functional_collectives()
    inject.arm(RUNTIME)
    # DataLoader workers and other forks of a rank are not ranks.
    os.register_at_fork(after_in_child=_child_is_not_a_rank)
    orig_excepthook = sys.excepthook

    def excepthook(*exc):
        rt = RUNTIME
        if rt is not None and rt.mode == "live":
            rt.abnormal_exit = True
        return orig_excepthook(*exc)

    sys.excepthook = excepthook


FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
              "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
              "permute_tensor")


def _refuse_functional_collectives() -> None:
    """Functional collectives (FSDP2, DTensor, torch.compile) look their group
    up by name in C++, past the wrapper, so a replay could not answer them.
    Say so once and turn replay off for the rank, rather than replay wrongly."""
    try:
        import torch.distributed._functional_collectives as funcol
    except Exception:
        return
    for name in FUNCTIONAL:
        real = getattr(funcol, name, None)
        if real is None:
            continue

        def refused(*args, _real=real, _name=name, **kwargs):
            rt = RUNTIME
            if rt is not None and not rt.disabled and rt.unsupported is None:
                rt.refuse(f"functional collectives ({_name}) bypass Watcher's process-group wrapper; "
                          "recording goes on, snapshots and replay are off for this run")
                rt.close()
            return _real(*args, **kwargs)
        setattr(funcol, name, refused)


def _child_is_not_a_rank() -> None:
    rt = RUNTIME
    if rt is not None and not rt._forking_snapshot:
        rt.disabled = True


def _wrap_default(rt: RankRuntime, sockets_before: set | None = None) -> None:
    real = c10d._world.default_pg
    if real is None or isinstance(real, collectives.WatchedGroup):
        return
    if not rt.active:  # launchers that set RANK only in the children (Lightning's rank 0)
        rt.rank, rt.world = dist.get_rank(), dist.get_world_size()
    w = collectives.wrap(real, rt)
    if sockets_before is not None:
        w.sockets = transport.opened_since(sockets_before)
    rt.groups.append(w)
    c10d._world.default_pg = w
    rt.activate()


def _wrap_group(rt: RankRuntime, group, sockets_before: set | None = None):
    if not isinstance(group, dist.ProcessGroup) or isinstance(group, collectives.WatchedGroup):
        return group
    w = collectives.wrap(group, rt)
    if sockets_before is not None:
        w.sockets = transport.opened_since(sockets_before)
    rt.groups.append(w)
    return w


RankRuntime.wrap_default_group = _wrap_default
RankRuntime.wrap_group = _wrap_group
