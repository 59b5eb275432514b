"""`watcher export --perfetto`: a recording as Perfetto's native protobuf trace.

The file is a `Trace` message (perfetto/protos/perfetto/trace/trace.proto):
a run of `TracePacket`s on one packet sequence.  Layout, as in the JSON
export (trace_export.py):

- a process track per recorded process (upid), named `rank R (pid P)` for
  ranks; under it a track per thread with its system calls, and one with its
  futex waits (a futex wait is also a `futex` system call: on one track they
  would not nest);
- per rank, under its first process: `steps` (one slice per optimizer
  step), the collectives on as many lanes as overlap (DDP issues one per
  bucket before the first completes), and `loss` and `grad norm` counters.

Written as it is read, in bounded memory: system calls and futex waits (the
bulk) are read a time window at a time and encoded with numpy, every packet
of them the same size: varints are written in a fixed width (a longer
varint than needed is still a valid one), so a window of N calls is two
(N, width) byte arrays.  Event names are interned once.  Timestamps are the
recorded CLOCK_MONOTONIC nanoseconds.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np

from .store import Recordings

WINDOW_ROWS = 1_000_000        # calls read and encoded at a time
SEQ = 1                        # the one packet sequence
SEQ_CLEARED, SEQ_NEEDS_STATE = 1, 2
SLICE_BEGIN, SLICE_END, COUNTER = 1, 2, 4
# Track uuids, by kind (each below 2**28: they are written as 4-byte varints).
PROCESS, SYSCALLS, FUTEX, STEPS, COLLECTIVES, COUNTERS = (k << 24 for k in range(1, 7))
FUTEX_NAME_BASE = 1 << 12      # interned ids: syscalls by number + 1, futex ops above this


# -- protobuf wire format ---------------------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _int(field: int, n: int) -> bytes:
    return _varint(field << 3) + _varint(n)


def _msg(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(body)) + body


def _str(field: int, s: str) -> bytes:
    return _msg(field, s.encode())


def _double(field: int, x: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack("<d", x)


def _fixed_varints(values: np.ndarray, width: int) -> np.ndarray:
    """(N, width) bytes: each value as a varint of exactly `width` bytes."""
    v = values.astype(np.uint64)
    cols = [((v >> np.uint64(7 * i)) & np.uint64(0x7F)).astype(np.uint8) for i in range(width)]
    out = np.stack(cols, axis=1)
    out[:, :-1] |= 0x80
    return out


# -- packets ----------------------------------------------------------------------------------

class _TraceWriter:
    def __init__(self, f):
        self.f = f
        self.packets = 0
        self.f.write(self._packet(_int(13, SEQ_CLEARED)))  # incremental state starts here

    def _packet(self, body: bytes) -> bytes:
        self.packets += 1
        return _msg(1, body + _int(10, SEQ))

    def track(self, uuid: int, name: str, parent: int | None = None, pid: int | None = None,
              counter: bool = False) -> None:
        body = _int(1, uuid) + _str(2, name)
        if parent is not None:
            body += _int(5, parent)
        if pid is not None:  # a process track: ProcessDescriptor{pid, process_name}
            body += _msg(3, _int(1, pid) + _str(6, name))
        if counter:
            body += _msg(8, b"")
        self.f.write(self._packet(_msg(60, body)))

    def names(self, names: dict[int, str]) -> None:
        """Intern event names (InternedData.event_names)."""
        body = b"".join(_msg(2, _int(1, iid) + _str(2, name)) for iid, name in names.items())
        self.f.write(self._packet(_msg(12, body) + _int(13, SEQ_NEEDS_STATE)))

    def slice(self, track: int, ts: int, dur: int, name: str, args: dict | None = None) -> None:
        ann = b"".join(_msg(4, _str(10, k) + (_double(5, v) if isinstance(v, float) else
                                              _int(4, v) if isinstance(v, int) else _str(6, str(v))))
                       for k, v in (args or {}).items() if v is not None)
        begin = _int(9, SLICE_BEGIN) + _int(11, track) + _str(23, name) + ann
        self.f.write(self._packet(_int(8, ts) + _msg(11, begin)))
        self.f.write(self._packet(_int(8, ts + max(dur, 0)) + _msg(11, _int(9, SLICE_END) + _int(11, track))))

    def counter(self, track: int, ts: int, value: float) -> None:
        self.f.write(self._packet(_int(8, ts) + _msg(11, _int(9, COUNTER) + _int(11, track) + _double(44, value))))

    def calls(self, tracks: np.ndarray, ts: np.ndarray, dur: np.ndarray, iids: np.ndarray) -> None:
        """A window of calls as fixed-size begin and end packets (numpy)."""
        n = len(ts)
        if n == 0:
            return
        # TracePacket{timestamp(8): 9-byte varint, seq id(10), flags(13), track_event(11){type(9),
        # track_uuid(11): 4 bytes, name_iid(10): 3 bytes}} inside Trace.packet(1).
        def block(stamp: np.ndarray, kind: int, with_name: bool) -> np.ndarray:
            event = [np.full((n, 1), 0x48, np.uint8), np.full((n, 1), kind, np.uint8),
                     np.full((n, 1), 0x58, np.uint8), _fixed_varints(tracks, 4)]
            if with_name:
                event += [np.full((n, 1), 0x50, np.uint8), _fixed_varints(iids, 3)]
            event = np.concatenate(event, axis=1)
            packet = np.concatenate([np.full((n, 1), 0x40, np.uint8), _fixed_varints(stamp, 9),
                                     np.tile(np.array([0x50, SEQ, 0x68, SEQ_NEEDS_STATE], np.uint8), (n, 1)),
                                     np.full((n, 1), 0x5A, np.uint8), np.full((n, 1), event.shape[1], np.uint8),
                                     event], axis=1)
            return np.concatenate([np.full((n, 1), 0x0A, np.uint8), np.full((n, 1), packet.shape[1], np.uint8),
                                   packet], axis=1)
        self.f.write(block(ts, SLICE_BEGIN, True).tobytes())
        self.f.write(block(ts + np.maximum(dur, 0), SLICE_END, False).tobytes())
        self.packets += 2 * n


# -- the trace --------------------------------------------------------------------------------

def write(recs: Recordings, f) -> dict:
    w = _TraceWriter(f)
    _, procs = recs.query("SELECT upid, pid, rank, name FROM process ORDER BY start_ts NULLS FIRST, upid")
    rank_proc: dict[int, int] = {}
    for n, (upid, pid, rank, comm) in enumerate(procs, start=1):
        if rank is not None and rank not in rank_proc:
            rank_proc[rank] = PROCESS + n
            name = f"rank {rank} (pid {pid})"
        else:
            name = f"{comm or 'process'} (pid {pid})"
        w.track(PROCESS + n, name, pid=n)
    proc_track = {upid: PROCESS + n for n, (upid, *_) in enumerate(procs, start=1)}
    _, threads = recs.query("SELECT utid, tid, upid, name FROM thread ORDER BY utid")
    utids = np.array([t[0] for t in threads], dtype=np.int64)
    for k, (utid, tid, upid, comm) in enumerate(threads):
        parent = proc_track.get(upid)
        w.track(SYSCALLS + k, f"{comm or 'thread'} {tid}", parent=parent)
        w.track(FUTEX + k, f"{comm or 'thread'} {tid} futex waits", parent=parent)

    _, sys_names = recs.query("SELECT DISTINCT nr, name FROM syscall WHERE nr IS NOT NULL")
    _, futex_ops = recs.query("SELECT DISTINCT op_name FROM futex WHERE op_name IS NOT NULL ORDER BY 1")
    futex_iid = {op: FUTEX_NAME_BASE + i for i, (op,) in enumerate(futex_ops)}
    w.names({nr + 1: name or f"syscall {nr}" for nr, name in sys_names} | {i: op for op, i in futex_iid.items()})

    calls = _stream_calls(recs, w, utids, "syscall", "nr + 1", SYSCALLS)
    futex_case = " ".join(f"WHEN '{op}' THEN {i}" for op, i in futex_iid.items())
    waits = _stream_calls(recs, w, utids, "futex", f"CASE op_name {futex_case} ELSE 0 END" if futex_iid else "0",
                          FUTEX)

    # Per rank: steps, collectives on lanes, loss and grad norm.
    def rank_track(rank: int) -> int:
        if rank not in rank_proc:  # a rank the recorder missed still gets a process
            rank_proc[rank] = PROCESS + (1 << 20) + rank
            w.track(rank_proc[rank], f"rank {rank}", pid=(1 << 20) + rank)
        return rank_proc[rank]

    _, steps = recs.query("SELECT rank, step, ts, dur, loss, grad_norm FROM step WHERE dur IS NOT NULL "
                          "ORDER BY rank, step")
    made = set()
    for rank, step, ts, dur, loss, gn in steps:
        if rank not in made:
            made.add(rank)
            parent = rank_track(rank)
            w.track(STEPS + rank, "steps", parent=parent)
            w.track(COUNTERS + 2 * rank, "loss", parent=parent, counter=True)
            w.track(COUNTERS + 2 * rank + 1, "grad norm", parent=parent, counter=True)
        w.slice(STEPS + rank, ts - dur, dur, f"step {step}", {"step": step, "loss": loss, "grad_norm": gn})
        # A non-finite value is on the step's slice; a counter track plots numbers only.
        if loss is not None and math.isfinite(loss):
            w.counter(COUNTERS + 2 * rank, ts, float(loss))
        if gn is not None and math.isfinite(gn):
            w.counter(COUNTERS + 2 * rank + 1, ts, float(gn))
    _, colls = recs.query("SELECT rank, group_name, seq, op, step, ts, dur, numel, dtype FROM collective_io "
                          "WHERE ts IS NOT NULL ORDER BY rank, ts")
    lanes: dict[int, list[int]] = {}  # rank -> end time of each lane's last collective
    for rank, group, seq, op, step, ts, dur, numel, dtype in colls:
        ends = lanes.setdefault(rank, [])
        lane = next((i for i, end in enumerate(ends) if end <= ts), None)
        if lane is None:
            lane = len(ends)
            ends.append(0)
            w.track(COLLECTIVES + 64 * rank + lane, "collectives" + (f" {lane + 1}" if lane else ""),
                    parent=rank_track(rank))
        ends[lane] = ts + (dur or 0)
        w.slice(COLLECTIVES + 64 * rank + lane, ts, dur or 0, f"{op} #{seq}",
                {"group": group, "seq": seq, "step": step, "numel": numel, "dtype": dtype})
    return {"packets": w.packets, "syscalls": calls, "futex_waits": waits, "steps": len(steps),
            "collectives": len(colls)}


def _stream_calls(recs: Recordings, w: _TraceWriter, utids: np.ndarray, table: str, iid_sql: str,
                  base: int) -> int:
    """Every row of `table` as a slice on its thread's track, a time window at a time."""
    _, [(lo, hi, total)] = recs.query(f"SELECT min(ts), max(ts), count(*) FROM {table}")
    if not total:
        return 0
    windows = max(1, -(-total // WINDOW_ROWS))
    step = (hi - lo) // windows + 1
    done = 0
    for k in range(windows):
        a, b = lo + k * step, lo + (k + 1) * step
        cur = recs.con.execute(f"SELECT utid, ts, coalesce(dur, 0) AS dur, {iid_sql} AS iid FROM {table} "
                               f"WHERE ts >= {a} AND ts < {b} AND utid IS NOT NULL")
        cols = cur.fetchnumpy()
        where = np.searchsorted(utids, cols["utid"])
        known = (where < len(utids)) & (utids[np.minimum(where, len(utids) - 1)] == cols["utid"])
        w.calls(base + where[known], cols["ts"][known], cols["dur"][known], cols["iid"][known])
        done += int(known.sum())
    return done


def export(paths: list[str], out: Path) -> dict:
    tmp = out.with_name(out.name + ".tmp")
    with Recordings(paths) as recs, open(tmp, "wb") as f:
        got = write(recs, f)
    tmp.replace(out)
    return got
