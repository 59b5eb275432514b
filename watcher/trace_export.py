"""`watcher export --perfetto F --format json`: a recording as Chrome Trace Event JSON.

Perfetto UI (and chrome://tracing) open this format directly; it is built in
memory and capped at MAX_SYSCALLS calls.  The default export is Perfetto's
protobuf trace (perfetto_trace.py): every call, streamed.  Layout:

- every recorded process (upid) is a trace process, named `rank R (pid P)` for
  ranks, so a reused pid, or the same pid on two nodes, stays two processes;
- each rank has a `steps` track (one slice per optimizer step) and its
  collectives as async slices (issue to completion; they may overlap);
- every thread gets its system calls and futex waits as slices on its own
  track (a thread is in one call at a time, so they never overlap).

Timestamps are CLOCK_MONOTONIC microseconds, as recorded.  Complete slices
on one track must nest; where clock rounding makes one outlast its parent,
it is cut at the parent's end.
"""

from __future__ import annotations

import json
from pathlib import Path

from .store import Recordings

MAX_SYSCALLS = 500_000   # keeps the file openable in a browser; the rest is counted in the metadata
STEP_TID_BASE = 1 << 30  # synthetic track ids, far above any kernel tid


def _us(ns) -> float:
    return ns / 1000.0


def build(recs: Recordings) -> dict:
    events: list[dict] = []
    _, procs = recs.query("SELECT upid, pid, rank, name FROM process ORDER BY start_ts NULLS FIRST, upid")
    # A trace process per recorded process (upid), numbered here: a pid the
    # kernel reused, or the same pid on two nodes, is two processes.
    pid_of, rank_pid = {}, {}
    for n, (upid, pid, rank, comm) in enumerate(procs, start=1):
        pid_of[upid] = n
        # Snapshot and replay children inherit RANK: the rank is its first process.
        if rank is not None and rank not in rank_pid:
            rank_pid[rank] = n
            name = f"rank {rank} (pid {pid})"
        elif rank is not None:
            name = f"rank {rank} snapshot/replay (pid {pid})"
        else:
            name = f"{comm} (pid {pid})"
        events.append({"name": "process_name", "ph": "M", "pid": n, "tid": 0, "ts": 0, "args": {"name": name}})
        if rank is not None and rank_pid[rank] == n:
            events.append({"name": "process_sort_index", "ph": "M", "pid": n, "tid": 0, "ts": 0,
                           "args": {"sort_index": rank}})
    _, threads = recs.query("SELECT utid, tid, upid, name FROM thread")
    tid_of = {}
    for utid, tid, upid, comm in threads:
        trace_pid = pid_of.get(upid, 2_000_000 + upid)
        tid_of[utid] = (trace_pid, tid)
        events.append({"name": "thread_name", "ph": "M", "pid": trace_pid, "tid": tid, "ts": 0,
                       "args": {"name": comm or str(tid)}})

    def track(rank: int, which: int, name: str) -> tuple[int, int]:
        pid = rank_pid.get(rank, 1_000_000 + rank)  # a rank the recorder missed still gets a process
        tid = STEP_TID_BASE + which
        key = (pid, tid)
        if key not in named:
            named.add(key)
            if pid not in rank_pid.values():
                events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "ts": 0,
                               "args": {"name": f"rank {rank}"}})
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}})
        return key

    named: set = set()
    slices: dict[tuple, list[dict]] = {}
    _, steps = recs.query("SELECT rank, step, ts, dur, loss, grad_norm FROM step WHERE dur IS NOT NULL ORDER BY rank, step")
    for rank, step, ts, dur, loss, gn in steps:
        key = track(rank, 0, "steps")
        slices.setdefault(key, []).append({"name": f"step {step}", "cat": "step", "ts": ts - dur, "dur": dur,
                                           "args": {"step": step, "loss": loss, "grad_norm": gn}})
    _, colls = recs.query("SELECT rank, group_name, seq, op, step, ts, dur, numel, dtype FROM collective_io "
                          "WHERE ts IS NOT NULL ORDER BY rank, ts")
    for n, (rank, group, seq, op, step, ts, dur, numel, dtype) in enumerate(colls):
        # Collectives overlap (DDP issues one per bucket before the first
        # completes), so they are async slices, which may.
        pid, _ = track(rank, 1, "collectives")
        common = {"name": f"{op} #{seq}", "cat": "collective", "id": n, "pid": pid, "tid": STEP_TID_BASE + 1}
        events.append(dict(common, ph="b", ts=_us(ts), args={"group": group, "seq": seq, "step": step,
                                                              "numel": numel, "dtype": dtype}))
        events.append(dict(common, ph="e", ts=_us(ts + (dur or 0))))
    _, sc = recs.query(f"SELECT utid, ts, dur, name FROM syscall "
                       f"UNION ALL SELECT utid, ts, dur, op_name FROM futex ORDER BY ts LIMIT {MAX_SYSCALLS + 1}")
    dropped = 0
    if len(sc) > MAX_SYSCALLS:
        _, [(total,)] = recs.query("SELECT (SELECT count(*) FROM syscall) + (SELECT count(*) FROM futex)")
        dropped = total - MAX_SYSCALLS
    for utid, ts, dur, name in sc[:MAX_SYSCALLS]:
        key = tid_of.get(utid, (0, utid))
        slices.setdefault(key, []).append({"name": name, "cat": "syscall", "ts": ts, "dur": dur or 0, "args": {}})
    for (pid, tid), evs in slices.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        ends: list[int] = []  # end times of the slices still open
        for e in evs:
            while ends and ends[-1] <= e["ts"]:
                ends.pop()
            if ends and e["ts"] + e["dur"] > ends[-1]:
                e["dur"] = ends[-1] - e["ts"]  # clock rounding: keep it inside its parent
            ends.append(e["ts"] + e["dur"])
            events.append(dict(e, ph="X", pid=pid, tid=tid, ts=_us(e["ts"]), dur=_us(e["dur"])))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"source": "watcher", "syscalls_left_out": dropped}}


def export(paths: list[str], out: Path) -> dict:
    with Recordings(paths) as recs:
        trace = build(recs)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(trace, f)
    tmp.replace(out)
    n = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    return {"events": n, "syscalls_left_out": trace["metadata"]["syscalls_left_out"]}
