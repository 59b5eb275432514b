"""Stalls: a rank that holds its peers up, reported within seconds, never halted.

A hang (no step end past the hang limit, minutes by default) halts the job
and replays the window.  Long before that, a rank that has made no progress
(no step end, no collective completed)
for `stall_seconds` or `stall_factor` times the job's median step, whichever
is longer, while no collective of its own is waiting on its peers (so it is
the one they wait for, not one of the waiters), says so:
a `stall` incident naming the rank, the step and where its training thread
is (Python frames, and the system call it is blocked in, from
/proc/self/task/<tid>/syscall).  The incident is closed as it opens: nothing
halts, the job goes on, and when the rank ends the step the incident gets
how long the stall lasted.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from ..incident import Incident, load_incident, save_incident
from ..syscall_names import syscall_name

# Frames here are Watcher's machinery and the framework's, not the training code's line.
_RUNTIME_DIR = str(Path(__file__).resolve().parent) + os.sep
_REPLAY_DIR = str(Path(__file__).resolve().parents[2] / "replay") + os.sep


def where_waiting(thread: threading.Thread) -> dict:
    """Where a thread is: its innermost Python frames, the first of them in
    the training code, and the system call it is blocked in (if any)."""
    out: dict = {"python": [], "training_line": None, "syscall": None}
    frame = sys._current_frames().get(thread.ident)
    while frame is not None and len(out["python"]) < 64:
        code = frame.f_code
        line = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        if len(out["python"]) < 4:
            out["python"].append(line)
        if out["training_line"] is None and not _machinery(code.co_filename):
            out["training_line"] = line
        frame = frame.f_back
    # A forked process's main thread keeps its parent's native_id in Python
    # 3.11 (a rank split from its supervisor, a snapshot taken over); a
    # main thread's tid is always its process's pid.
    tid = os.getpid() if thread is threading.main_thread() else thread.native_id
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            first = f.read().split()[0]
        out["syscall"] = "running" if first == "running" else syscall_name(int(first))
    except (OSError, ValueError, IndexError):
        pass
    return out


def _machinery(filename: str) -> bool:
    f = filename.replace(os.sep, "/")
    return ("/torch/" in f or "/site-packages/" in f or "/dist-packages/" in f or filename.startswith("<")
            or filename.startswith(_RUNTIME_DIR) or filename.startswith(_REPLAY_DIR))


class StallWatch:
    """One rank's stall reports (its watchdog asks `check` every period)."""

    def __init__(self, rt):
        self.rt = rt
        self.reported_step: int | None = None   # the step the open report is about
        self.incident_id: str | None = None
        self.since_ns = 0

    def check(self, now_ns: int, median_step_s: float) -> None:
        rt = self.rt
        det = rt.detectors
        if not det.stall or rt.last_end_ns is None:
            return
        limit = det.stall_limit_s(median_step_s)
        if limit >= det.hang_limit_s(median_step_s):
            return  # the hang detector is the sooner: it halts and replays
        # Progress is a step end or a collective completing: a rank that just
        # came out of a long wait on its peers (a stuck collective aborted and
        # retried) has not stalled, it was held up.
        since = max(rt.last_end_ns, rt.last_coll_done_ns)
        quiet = (now_ns - since) / 1e9
        step = rt.step + 1
        if quiet <= limit or self.reported_step == step:
            return
        # One of the waiters: a collective of ours is still open, waiting on a
        # peer (the stalled rank's earlier collectives all completed: every
        # peer was there).
        if rt.in_flight > 0:
            return
        where = where_waiting(threading.main_thread())
        detail = {"no_progress_s": round(quiet, 3), "limit_s": round(limit, 3),
                  "median_step_s": round(median_step_s, 4), "times_median": round(quiet / median_step_s, 1)
                  if median_step_s > 0 else None, "where": where}
        seq = rt.ctl.open_incident({"kind": "stall", "rank": rt.rank, "failing_step": step, "halt_step": None,
                                    "resolved": True, "detected_ts": now_ns, "detected_unix": time.time()})
        self.reported_step = step  # once per step, opened or not (another incident may be open)
        if seq is None:
            return
        self.incident_id, self.since_ns = f"inc-{seq:04d}", since
        doc = Incident.opened(self.incident_id, "stall", step, rt.rank, now_ns, detail, None, None)
        doc.replay = {"reproduced": None, "first_divergence": None,
                      "reason": "a stall is reported, not replayed: the job was not halted"}
        save_incident(rt.rundir, doc)
        rt.ctl.verdict_seq = max(rt.ctl.verdict_seq, seq)  # closed as it opens: the next incident may open
        line = where["training_line"] or (where["python"][0] if where["python"] else "?")
        print(f"watcher: {self.incident_id}: rank {rt.rank} stalled in step {step}: no progress for {quiet:.1f} s "
              f"({detail['times_median']}x the median step), at {line}"
              + (f", in {where['syscall']}" if where["syscall"] else ""), file=sys.stderr, flush=True)

    def step_ended(self, end_ns: int) -> None:
        """The stalled step ended: the report gets how long the stall lasted."""
        if self.incident_id is None:
            return
        iid, self.incident_id = self.incident_id, None
        try:
            doc = load_incident(self.rt.rundir, iid)
            doc.detail["stalled_s"] = round((end_ns - self.since_ns) / 1e9, 3)
            doc.detail["resumed"] = True
            save_incident(self.rt.rundir, doc)
        except Exception:
            pass  # the report stands without its end
