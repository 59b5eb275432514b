"""The background SDC audit: re-execute a recent verified window off the
training path and compare it with the record.

Silent corruption (a bit flipped in a gradient before its allreduce) is
averaged into every replica: they still agree, the loss hardly moves, and no
detector fires.  But the record holds every step's fingerprint and every
collective input's checksum, and the snapshots hold the state to re-execute
from.  So rank 0 orders, now and then, an audit of the window between the two
newest snapshots (v, t]: every rank replays it from its snapshot v, in the
sandbox, at the lowest CPU priority (nice 19: training always runs first),
the replays trading collective inputs as an incident's replays do.  The live
ranks never wait for it: a background thread of each rank waits on its
snapshot's replay.  A replay that departs from the record where no detector
saw anything opens an `sdc` incident at the divergence's step, which then
goes through the usual protocol (replay from a snapshot before it, verdict,
Track A merge of the re-executed state, or Track B if it repeats).

Budget: an audit is ordered only while the CPU the audits have used (rank
0's replays, each rank's alike) is within `budget` of the job's wall time
since its first step (less any time the audit was paused), so at the default (0.5%) a window is audited every so
often, and coverage (the share of steps audited) grows with the budget.

Each rank logs its audits to DIR/runtime/rank<r>.audits.jsonl; `watcher run`
sums them up (run.audit_summary: coverage, cost, mismatches).  Audits need a single-node job:
on many nodes the replays' inputs would have to cross nodes through live
ranks (relay.py), which only halted ranks do; there the audit says it is off.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

from ..replay.exchange import end_for
from ..rundir import ReplayDir, exchange_dir
from .control import PAUSE_AUDIT
from .seam import Rank

DEFAULT_BUDGET = 0.005
# What one audited step costs before any audit has measured it: a 4-step
# window of the reference job measured 0.12-0.14 CPU-s, setup included.
PRIOR_CPU_S_PER_STEP = 0.05


class Audit:
    def __init__(self, rt: Rank, budget: float):
        self.rt = rt
        self.budget = budget
        self.seen = rt.ctl.audit_seq       # the last order this rank started (or skipped)
        self.thread: threading.Thread | None = None
        self.cpu_s = 0.0                   # this rank's audit replays' CPU so far
        self.steps_audited = 0
        self.earned_s = 0.0                # job time the budget accrues over (not while paused)
        self.last_seen = time.monotonic()
        # Snapshot steps kept out of rotation (take_snapshot): where the next
        # audit may start (the end of the last window ordered, so that windows
        # can follow each other with no gap), the one an audit is replaying
        # from, and the one before a corruption an audit found (its incident
        # replays from it).
        self.next_from: int | None = None
        self.in_use: int | None = None
        self.found: int | None = None
        self.off_said = False

    @property
    def pinned(self) -> set[int]:
        return {s for s in (self.next_from, self.in_use, self.found) if s is not None}

    @classmethod
    def from_env(cls, rt: Rank) -> "Audit | None":
        try:
            budget = float(os.environ.get("WATCHER_AUDIT_BUDGET", DEFAULT_BUDGET))
        except ValueError:
            budget = DEFAULT_BUDGET
        return cls(rt, budget) if budget > 0 else None

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    # -- rank 0: order ----------------------------------------------------------------------
    def maybe_order(self, t: int) -> None:
        """Just after the snapshot at step t (rank 0): order an audit of the
        window since the previous snapshot if the budget allows it."""
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
        if paused or self.busy or rt.ctl.incident_seq > rt.handled_seq or rt.ctl.audit_seq > self.seen:
            return
        held = [s.step for s in rt.snapshots if s.step < t and s.step > rt.window_gap]
        if not held:
            return
        # An audit is ordered once the budget has earned what it will cost:
        # the CPU per audited step measured so far (setup included), or a
        # prior before the first.  Go on from where the last window ended when
        # the credit covers the steps since; else audit the newest window and
        # leave a gap.
        credit = self.budget * self.earned_s - self.cpu_s
        per_step = self.cpu_s / self.steps_audited if self.steps_audited else PRIOR_CPU_S_PER_STEP
        start = max(held)
        if credit < per_step * (t - start):
            return
        if self.next_from in held and per_step * (t - self.next_from) <= credit:
            start = self.next_from
        rt.ctl.order_audit(start, t)

    # -- every rank: start the replay ----------------------------------------------------------
    def poll(self) -> None:
        """At a step end (training thread): start the audit rank 0 ordered."""
        rt = self.rt
        seq = rt.ctl.audit_seq
        if seq <= self.seen or self.busy:
            return
        self.seen = seq
        v, t = rt.ctl.audit_window()
        self.next_from = t
        out = rt.rundir.audit_dir(seq)
        exchange = exchange_dir(rt.window_dir, f"audit-{seq}")
        snap = rt.snapshot_at(v)
        why = (f"snapshot {v} is gone" if snap is None else
               "an incident is being handled" if rt.ctl.incident_seq > rt.handled_seq else None)
        if why:
            self._log(seq, v, t, {"status": "skipped" if snap else "failed", "error": why})
            exchange.mkdir(exist_ok=True)
            end_for(exchange, rt.rank, why)  # no peer waits for this rank's inputs
            return
        self.in_use = v
        rt.flush()  # the window up to t is on disk before the replay reads it
        self.thread = threading.Thread(target=self._run, args=(seq, snap, v, t, out, exchange), daemon=True,
                                       name="watcher-audit")
        self.thread.start()

    def _run(self, seq: int, snap, v: int, t: int, out: ReplayDir, exchange) -> None:
        rt = self.rt
        entry = {"status": "failed"}
        try:
            exchange.mkdir(exist_ok=True)
            reply = snap.replay(t, out, timeout=max(60.0, 40 * self._median_step_s() * (t - v)),
                                exchange=exchange, audit=True)
            res = torch.load(out.result(rt.rank), weights_only=False) if out.result(rt.rank).exists() else {}
            self.cpu_s += float(res.get("cpu_s") or 0)
            entry = self._judge(res, reply)
            if entry["status"] != "failed":
                self.steps_audited += t - v
        except Exception as e:  # an audit that cannot run is counted, never the job's problem
            entry = {"status": "failed", "error": str(e)[:300]}
        self._log(seq, v, t, entry)
        if entry["status"] == "mismatch" and rt.mode == "live" and not rt.exiting:
            self.found = v
            self._report(seq, v, t, entry)
        self.in_use = None
        if entry["status"] != "mismatch":
            # What a clean audit leaves is its summary line; its end state and
            # the exchange's inputs are large and of no further use.
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

    def _report(self, seq: int, v: int, t: int, entry: dict) -> None:
        """The replay departed from the record: an `sdc` incident at the
        first step that differs (the verified state before it is snapshot v,
        kept pinned until the incident is handled)."""
        rt = self.rt
        div = entry.get("first_divergence") or {}
        failing = div.get("step", min(entry.get("mismatched_steps") or [t]))
        last = max(rt.ctl.latest_step(r) for r in range(rt.world))
        now = time.monotonic_ns()
        try:  # when the corrupted step ended, for the time to detection
            ended = rt.rundir.read_steps(rt.rank, since=failing).get(failing, {}).get("ts")
        except OSError:
            ended = None
        opened = rt.open_incident({
            "kind": "sdc", "rank": rt.rank, "failing_step": failing,
            # Two steps past the furthest rank: every rank sees it before finishing the halt step.
            "halt_step": last + 1 + rt.halt_margin, "detected_ts": now, "detected_unix": time.time(),
            "detail": {"found_by": "audit", "audit": seq, "window": [v + 1, t], "rank": rt.rank,
                       "first_divergence": div or None, "mismatched_steps": entry.get("mismatched_steps"),
                       "detected_after_steps": last - failing,
                       "detected_after_s": round((now - ended) / 1e9, 3) if ended else None,
                       "device": this_device()}})
        if opened is None:
            self.found = None  # another incident is open; this audit's finding stays in its log

    def incident_handled(self) -> None:
        """The incident is over (recovered: every snapshot is new; or not): nothing is kept for it."""
        self.found = None
        self.next_from = None

    def _median_step_s(self) -> float:
        ns = sorted(self.rt.step_ns)
        return ns[len(ns) // 2] / 1e9 if ns else 0.1

    def _log(self, seq: int, v: int, t: int, entry: dict) -> None:
        line = dict(entry, audit=seq, rank=self.rt.rank, from_step=v, to_step=t, ts=time.time())
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
