"""The background SDC audit: re-execute recent windows off the training path
and compare them with the record.

Silent corruption (a bit flipped in a gradient before its allreduce) is
averaged into every replica: they still agree, the loss hardly moves, and no
detector fires.  But the record holds every step's fingerprint and every
collective input's checksum, and a fork of the rank holds the state to
re-execute from.  So rank 0 orders, now and then, an audit of a window (a, b]:
every rank forks itself at step a (an audit fork, outside the snapshots'
rotation), and once step b is
recorded replays a+1..b from that fork, in the sandbox, at the lowest CPU
priority (nice 19: training always runs first), the ranks' replays trading
collective inputs as an incident's replays do.  The live ranks never wait for
it: a background thread of each rank waits on its fork's replay.  A replay
that departs from the record opens an `sdc` incident at the divergence's step,
which then goes through the usual protocol (replay from the fork before it,
verdict, Track A merge of the re-executed state, or Track B if it repeats).

Budget: a window of 16 steps is ordered once the budget has earned what it will
cost (CPU of the audit replays, per audited step as measured so far, and the
forks' time on the training path), against the job's wall time since its
first step (less any time the audit was paused): at the default (0.5%) a short
window every so often, so coverage (the share of steps audited) grows with the
budget.  When the budget also covers the next window, the order says "chain":
every rank forks again at b, and the next window starts there, with no gap.

The order is three words of the control block (runtime/control.py).  Each
rank logs its audits to DIR/runtime/rank<r>.audits.jsonl; `watcher run` sums
them up (run.audit_summary: coverage, cost, findings).  Audits need a
single-node job: on many nodes the replays' inputs would have to cross nodes
through live ranks (relay.py), which only halted ranks do; there the audit
says it is off.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time

import torch

from ..health import step_device
from ..replay.exchange import end_for
from ..rundir import exchange_dir
from .control import PAUSE_AUDIT
from .seam import Rank

DEFAULT_BUDGET = 0.005
# What one audited step costs before any audit has measured it: a 4-step
# window of the reference job measured 0.12-0.14 CPU-s, setup included.
PRIOR_CPU_S_PER_STEP = 0.05
STEPS = 16  # a window's length: setup amortised, detection not too late
LEAD = 2  # an order's fork is this many steps ahead: every rank has read it before reaching the step
MAX_QUEUED = 4  # windows recorded and not yet replayed (each holds a fork): beyond, a gap


class Audit:
    def __init__(self, rt: Rank, budget: float):
        self.rt = rt
        self.budget = budget
        self.seen = rt.ctl.audit_seq       # the last order this rank took
        self.cpu_s = 0.0                   # this rank's audit replays' CPU so far, and its audit forks' time
        self.steps_audited = 0
        self.earned_s = 0.0                # job time the budget accrues over (not while paused)
        self.last_seen = time.monotonic()
        self.forks: dict[int, object] = {}  # step -> an audit fork this rank holds
        self.order: tuple | None = None    # (seq, a, b, chain) being recorded: fork at a, replay at b
        self.ready: queue.Queue = queue.Queue()  # windows recorded, to replay one after the other
        self.pending = 0                   # windows queued or replaying
        self.judged: list[int] = []        # fork steps of the last windows replayed (kept for an incident)
        self.found: int | None = None      # the fork before a corruption found (its incident replays from it)
        self.queued: set[int] = set()      # fork steps of the windows queued or replaying
        self.off_said = False
        self.draining = False              # the job's end: the last windows are replayed (drain)
        self.worker = threading.Thread(target=self._work, daemon=True, name="watcher-audit")
        self.worker.start()

    @classmethod
    def from_env(cls, rt: Rank) -> "Audit | None":
        try:
            budget = float(os.environ.get("WATCHER_AUDIT_BUDGET", DEFAULT_BUDGET))
        except ValueError:
            budget = DEFAULT_BUDGET
        return cls(rt, budget) if budget > 0 else None

    # -- what the rank asks ---------------------------------------------------------------
    def fork_due(self, k: int) -> bool:
        """Is step k the start of an ordered window (or a chain's next) with no snapshot of its own here?"""
        if self.order is None:
            return False
        _, a, b, chain = self.order
        # Its own fork even where a snapshot was taken at the same step: the
        # snapshots' rotation could let that one go before the window ends.
        return (k == a or (chain and k == b)) and k not in self.forks

    def add_fork(self, k: int, snap) -> None:
        self.forks[k] = snap
        self.cpu_s += snap.fork_ns / 1e9  # the fork is time the training path spends on the audit

    def held_steps(self) -> list[int]:
        return sorted(self.forks)

    def floor(self) -> int | None:
        """The oldest step a held audit fork's window starts at (no segment before it may go)."""
        return min(self.forks) if self.forks else None

    def detach(self, snap) -> None:
        """A fork the rank keeps for itself now (retained for diagnosis)."""
        for k, s in list(self.forks.items()):
            if s is snap:
                del self.forks[k]

    def drain(self, timeout: float) -> None:
        """At the job's end: let the windows already recorded be replayed
        (bounded), so its last steps are audited too.  Training is over; only
        the exit waits.  A finding opens an incident that the rank's exit
        handles (judged, not recovered: there is no next step)."""
        self.draining = True
        if self.order is not None:
            # The window being recorded ends with the job: audit what there is of it.
            seq, a, b, _ = self.order
            self.order = None
            last = self.rt.step
            if last > a:
                self._queue(seq, a, last)
            else:
                self._abandon(seq, "the job ended before the window began")
        deadline = time.monotonic() + timeout
        while self.pending > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.found is not None:
            time.sleep(0.5)  # a peer's finding of the same window reaches the control block

    def release_all(self) -> None:
        for s in self.forks.values():
            s.release()
        self.forks = {}

    def incident_handled(self) -> None:
        """The incident is over: recovered (every earlier state is stale) or not;
        the forks kept for it go, and so does the window being recorded."""
        self.found = None
        self.judged = []
        if self.order is not None:
            self._abandon(self.order[0], "an incident was handled meanwhile")
            self.order = None
        in_use = self._in_use()
        for k in [k for k in self.forks if k not in in_use]:
            self.forks.pop(k).release()

    # -- at each step end (training thread) ---------------------------------------------------
    def step_ended(self, k: int) -> None:
        """After step k's record: take a new order, queue a window whose last step this is, order the next (rank 0)."""
        rt = self.rt
        # The window that ends here first: rank 0 may already have ordered
        # the next one (it can end this step before this rank does).
        if self.order is not None and k >= self.order[2]:
            seq, a, b, _ = self.order
            self.order = None
            self._queue(seq, a, b)
        seq = rt.ctl.audit_seq
        if seq > self.seen:
            self.seen = seq
            a, b, chain = rt.ctl.audit_window()
            if self.order is not None:
                self._abandon(self.order[0], "a newer order came")
            self.order = (seq, a, b, chain)
            if a <= k and a not in self.forks:
                self._abandon(seq, f"no fork at step {a} here (the order came at step {k})")
                self.order = None
        self._drop_unused(k)
        if rt.rank == 0:
            self._maybe_order(k)

    def _maybe_order(self, k: int) -> None:
        rt = self.rt
        if rt.link is not None:
            if not self.off_said:
                self.off_said = True
                print("watcher: the background SDC audit is off on a multi-node job", file=sys.stderr, flush=True)
            return
        now, paused = time.monotonic(), rt.ctl.paused & PAUSE_AUDIT
        if not paused:
            self.earned_s += now - self.last_seen
        self.last_seen = now
        if (paused or self.order is not None or self.pending >= MAX_QUEUED or rt.ctl.incident_seq > rt.handled_seq
                or rt.exiting):
            return
        # Whole windows only: a replay's setup (fork, window load, sandbox)
        # costs about four steps' replay, so short windows buy less coverage.
        credit = self.budget * self.earned_s - self.cpu_s
        per_step = self.cpu_s / self.steps_audited if self.steps_audited else PRIOR_CPU_S_PER_STEP
        w = STEPS
        if credit < w * per_step:
            return
        # The last window's chain fork, if taken here at k, starts the window
        # now; else a fork LEAD steps ahead.
        a = k if k in self.forks else k + LEAD
        chain = credit - w * per_step >= w * per_step
        rt.ctl.order_audit(a, a + w, chain)

    def _queue(self, seq: int, a: int, b: int) -> None:
        """Hand window (a, b] to the replay thread, or say why it cannot be audited."""
        snap = self.forks.get(a)
        if snap is None:
            self._abandon(seq, f"no fork at step {a}")
        elif self.rt.window_gap >= a:
            # Steps run paused (an overhead measurement) were not recorded:
            # a replay of them would compare against nothing and "differ".
            self._abandon(seq, f"step {self.rt.window_gap} ran paused")
        else:
            self.rt.flush()  # the window up to b is on disk before the replay reads it
            self.pending += 1
            self.queued.add(a)
            self.ready.put((seq, snap, a, b))

    def _drop_unused(self, k: int) -> None:
        in_use = self._in_use()
        for s in [s for s in self.forks if s not in in_use and s < k]:
            self.forks.pop(s).release()

    def _in_use(self) -> set[int]:
        """Fork steps still needed: the window being recorded (and its chain's
        next start), the windows queued or replaying, the last ones judged
        (a peer's finding may open an incident that replays from them)."""
        keep = set(self.judged) | self.queued
        if self.order is not None:
            keep |= {self.order[1], self.order[2]}
        if self.found is not None:
            keep.add(self.found)
        return keep

    def _abandon(self, seq: int, why: str) -> None:
        """This rank will not replay window `seq`: said in its log and to its
        peers' replays (which would otherwise wait for its inputs)."""
        self._log(seq, None, None, {"status": "skipped", "error": why})
        try:
            d = exchange_dir(self.rt.window_dir, f"audit-{seq}")
            d.mkdir(exist_ok=True)
            end_for(d, self.rt.rank, why)
        except OSError:
            pass

    # -- the replays (background thread) ------------------------------------------------------
    def _work(self) -> None:
        while True:
            seq, snap, a, b = self.ready.get()
            try:
                self._audit(seq, snap, a, b)
            except Exception as e:  # an audit that cannot run is counted, never the job's problem
                if self._closing():  # its fork went with the rank's exit
                    self._log(seq, a, b, {"status": "skipped", "error": "the rank is exiting"})
                else:
                    self._log(seq, a, b, {"status": "failed", "error": str(e)[:300]})
            finally:
                self.queued.discard(a)
                self.pending -= 1

    def _audit(self, seq: int, snap, a: int, b: int) -> None:
        rt = self.rt
        out = rt.rundir.audit_dir(seq)
        exchange = exchange_dir(rt.window_dir, f"audit-{seq}")
        if rt.ctl.incident_seq > rt.handled_seq or self._closing():
            self._abandon(seq, "the rank is exiting" if self._closing() else "an incident is being handled")
            return
        exchange.mkdir(exist_ok=True)
        reply = snap.replay(b, out, timeout=max(60.0, 40 * self._median_step_s() * (b - a)),
                            exchange=exchange, audit=True)
        res = torch.load(out.result(rt.rank), weights_only=False) if out.result(rt.rank).exists() else {}
        self.cpu_s += float(res.get("cpu_s") or 0)
        entry = self._judge(res, reply)
        if entry["status"] != "failed":
            self.steps_audited += b - a
        self._log(seq, a, b, entry)
        self.judged = (self.judged + [a])[-2:]
        if entry["status"] == "mismatch" and rt.mode == "live" and not self._closing():
            self.found = a
            self._report(seq, a, b, entry)
        else:
            # What a clean audit leaves is its log line; its end state and
            # its inputs in the exchange are large and of no further use.
            for p in (out.result(rt.rank), exchange / f"rank{rt.rank}"):
                try:
                    os.unlink(p)
                except OSError:
                    pass

    def _judge(self, res: dict, reply: dict) -> dict:
        status = res.get("status")
        if status != "done":
            return {"status": "failed", "error": f"replay {status or 'gave no result'}"
                                                 + (" (timed out)" if reply.get("timed_out") else ""),
                    "cpu_s": res.get("cpu_s")}
        steps = res.get("steps", {})
        colls = res.get("colls", [])
        bad_steps = sorted(k for k, s in steps.items() if not s["match"])
        bad_colls = [c for c in colls if not c["match"]]
        entry = {"steps": len(steps), "collectives": len(colls), "cpu_s": round(res.get("cpu_s") or 0, 3),
                 "wall_s": round((res.get("wall_ns") or 0) / 1e9, 3)}
        if not bad_steps and not bad_colls:
            return dict(entry, status="clean")
        return dict(entry, status="mismatch", mismatched_steps=bad_steps,
                    mismatched_collectives=len(bad_colls), first_divergence=res.get("first_divergence"))

    def _report(self, seq: int, a: int, b: int, entry: dict) -> None:
        """The replay departed from the record: an `sdc` incident at the
        first step that differs (the verified state before it is the fork at
        a, kept until the incident is handled)."""
        rt = self.rt
        div = entry.get("first_divergence") or {}
        # The first step whose fingerprint differs, not this rank's first
        # differing collective: a peer's corrupted input shows here one
        # collective later, but in the same step's fingerprint.  The
        # incident replays from a verified state before it.
        failing = min(entry.get("mismatched_steps") or [div.get("step", b)])
        last = max(rt.ctl.latest_step(r) for r in range(rt.world))
        now = time.monotonic_ns()
        try:  # when the corrupted step ended (for the time to detection), and on which core
            steps = rt.rundir.read_steps(rt.rank, since=failing)
        except OSError:
            steps = {}
        ended = steps.get(failing, {}).get("ts")
        opened = rt.open_incident({
            "kind": "sdc", "rank": rt.rank, "failing_step": failing,
            # Two steps past the furthest rank: every rank sees it before finishing the halt step.
            "halt_step": last + 1 + rt.halt_margin, "detected_ts": now, "detected_unix": time.time(),
            "detail": {"found_by": "audit", "audit": seq, "window": [a + 1, b], "rank": rt.rank,
                       "first_divergence": div or None, "mismatched_steps": entry.get("mismatched_steps"),
                       "detected_after_steps": last - failing,
                       "detected_after_s": round((now - ended) / 1e9, 3) if ended else None,
                       "device": this_device(), "device_id": step_device(steps, failing)}})
        if opened is None:
            self.found = None  # another incident is open; this audit's finding stays in its log

    def _closing(self) -> bool:
        """The rank is going away without waiting for its audits (not draining them)."""
        return self.rt.exiting and not self.draining

    def _median_step_s(self) -> float:
        ns = sorted(self.rt.step_ns)
        return ns[len(ns) // 2] / 1e9 if ns else 0.1

    def _log(self, seq: int, a: int | None, b: int | None, entry: dict) -> None:
        line = dict(entry, audit=seq, rank=self.rt.rank, from_step=a, to_step=b, ts=time.time())
        try:
            with open(self.rt.rundir.audit_log(self.rt.rank), "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass


def this_device() -> dict:
    """Where this rank computes (the device an sdc finding points at): on a
    CPU job the host, the CPUs it may run on and the one it ran on last."""
    try:
        with open("/proc/self/stat") as f:
            last_cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        last_cpu = None
    return {"kind": "cpu", "host": os.uname().nodename, "cpus": sorted(os.sched_getaffinity(0)),
            "last_cpu": last_cpu}
