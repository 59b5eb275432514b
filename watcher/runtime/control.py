"""The ranks' shared control block and incident files, in the run directory.

Hot path (every step): each rank writes its step and parameter checksum into
its own slot of a small shared mmap, and reads one word to learn whether an
incident is open.  Cold path (an incident): small JSON files written with an
atomic rename, so a reader never sees half a file.

    header  magic | incident_seq | plan_seq | verdict_seq | paused (a measurement: PAUSE_RUNTIME | PAUSE_RECORDER)
            | audit_seq | audit_from | audit_to (the SDC audit rank 0 ordered last: audit.py)
    slot r  arrived_seq | arrived_step | copy interval wanted | fork interval wanted | ring of RING (step, param_sum)
            | pace (step, median own ns per step: straggler.py)

One control file per node.  On a multi-node job a NodeLink (nodes.py) keeps
it a replica of the job's: the header words are the job's, and the other
nodes' ranks' slots are copied in, so every rank reads the same view.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from pathlib import Path

from ..rundir import control_file, opened_incident_file, read_json, write_json

MAGIC = 0x57415443_48455231  # "WATCHER1"
MAX_RANKS = 1024
AGREE_EVERY = 16  # steps between readings of the other ranks' wanted copy and fork intervals
RING = 8
HEADER = 64
RING_AT = 32
PACE_AT = RING_AT + RING * 16
SLOT = PACE_AT + 16
PAUSE_RUNTIME, PAUSE_RECORDER, PAUSE_AUDIT = 1, 2, 4  # bits of the `paused` word
SIZE = HEADER + MAX_RANKS * SLOT
GONE = -2  # a slot's arrived word when its rank failed open
_Q = struct.Struct("<q")
_QQ = struct.Struct("<qq")
_opening = threading.Lock()
CHAIN_BIT = 1 << 62


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/PID/stat; a pid
    plus its start time names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent's pid, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class Control:
    def __init__(self, runtime_dir: Path):
        self.dir = Path(runtime_dir)
        self.path = control_file(self.dir)
        self.link = None  # nodes.NodeLink on a multi-node job
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < SIZE:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_size < SIZE:
                    os.ftruncate(fd, SIZE)
                fcntl.flock(fd, fcntl.LOCK_UN)
            self.mm = mmap.mmap(fd, SIZE)
        finally:
            self.fd = fd
        if _Q.unpack_from(self.mm, 0)[0] != MAGIC:
            _Q.pack_into(self.mm, 0, MAGIC)
            for r in range(MAX_RANKS):
                _QQ.pack_into(self.mm, HEADER + r * SLOT, 0, -1)
                _QQ.pack_into(self.mm, HEADER + r * SLOT + 16, 0, 0)
                for i in range(RING):
                    _QQ.pack_into(self.mm, HEADER + r * SLOT + RING_AT + i * 16, -1, 0)
                _QQ.pack_into(self.mm, HEADER + r * SLOT + PACE_AT, -1, 0)

    # -- header words --------------------------------------------------------------
    def _get(self, i: int) -> int:
        return _Q.unpack_from(self.mm, 8 * i)[0]

    def _set(self, i: int, v: int) -> None:
        _Q.pack_into(self.mm, 8 * i, v)

    def _set_global(self, i: int, name: str, v: int) -> None:
        self._set(i, v)
        if self.link is not None:
            self.link.set_word(name, v)

    incident_seq = property(lambda self: self._get(1))
    plan_seq = property(lambda self: self._get(2), lambda self, v: self._set_global(2, "plan_seq", v))
    verdict_seq = property(lambda self: self._get(3), lambda self, v: self._set_global(3, "verdict_seq", v))
    # Measurement switch for `just bench run`, a bit mask: with PAUSE_RUNTIME
    # the runtime does nothing but count steps (and the run can no longer be
    # replayed); with PAUSE_RECORDER the job leaves the recorder's traced set;
    # with PAUSE_AUDIT no audit is ordered, nor does its budget accrue (`just bench audit`).
    paused = property(lambda self: self._get(4), lambda self, v: self._set(4, v))
    audit_seq = property(lambda self: self._get(5))

    def order_audit(self, from_step: int, to_step: int, chain: bool) -> None:
        """Rank 0 orders an audit of steps from_step+1..to_step (audit.py),
        `chain` (a fork at to_step for the next window) in the last word's top
        bit: the window first, the number last, so whoever sees the number sees its window."""
        self._set(6, from_step)
        self._set(7, to_step | (CHAIN_BIT if chain else 0))
        self._set(5, self.audit_seq + 1)

    def audit_window(self) -> tuple[int, int, bool]:
        to = self._get(7)
        return self._get(6), to & ~CHAIN_BIT, bool(to & CHAIN_BIT)

    # -- per-rank beacons ------------------------------------------------------------
    def beacon(self, rank: int, step: int, param_sum: int) -> None:
        # Checksum first, step last: a peer that sees the new step sees its checksum.
        at = HEADER + rank * SLOT + RING_AT + (step % RING) * 16
        _Q.pack_into(self.mm, at, -1)
        _Q.pack_into(self.mm, at + 8, param_sum)
        _Q.pack_into(self.mm, at, step)

    def beacon_at(self, rank: int, step: int) -> int | None:
        s, v = _QQ.unpack_from(self.mm, HEADER + rank * SLOT + RING_AT + (step % RING) * 16)
        return v if s == step else None

    def latest_step(self, rank: int) -> int:
        base = HEADER + rank * SLOT + RING_AT
        return max(_QQ.unpack_from(self.mm, base + i * 16)[0] for i in range(RING))

    def set_pace(self, rank: int, step: int, own_ns: int) -> None:
        # Value first, step last (a reader pairing a new step with an old
        # value would misjudge one check in two; the next check repairs it).
        _Q.pack_into(self.mm, HEADER + rank * SLOT + PACE_AT + 8, own_ns)
        _Q.pack_into(self.mm, HEADER + rank * SLOT + PACE_AT, step)

    def pace(self, rank: int) -> tuple[int, int] | None:
        """(step, median own ns per step) as `rank` last published it, or None."""
        step, own = _QQ.unpack_from(self.mm, HEADER + rank * SLOT + PACE_AT)
        return (step, own) if step >= 0 else None

    def arrive(self, rank: int, seq: int, step: int) -> None:
        _QQ.pack_into(self.mm, HEADER + rank * SLOT, seq, step)

    def arrived(self, rank: int) -> tuple[int, int]:
        return _QQ.unpack_from(self.mm, HEADER + rank * SLOT)

    def mark_gone(self, rank: int) -> None:
        """This rank's runtime failed open: it will arrive at no incident."""
        _Q.pack_into(self.mm, HEADER + rank * SLOT, GONE)

    def gone(self, rank: int) -> bool:
        return _Q.unpack_from(self.mm, HEADER + rank * SLOT)[0] == GONE

    COPY_WANT, FORK_WANT = 16, 24  # where in its slot a rank publishes the interval it wants

    def agree_interval(self, rank: int, world: int, want: int, word: int = COPY_WANT) -> int:
        """Publish the copy (or fork) interval this rank wants; the one every
        rank uses is the largest wanted, so all of them copy (fork) at the
        same steps: an incident can use only a copy or snapshot every rank holds."""
        _Q.pack_into(self.mm, HEADER + rank * SLOT + word, want)
        return max([want] + [_Q.unpack_from(self.mm, HEADER + r * SLOT + word)[0] for r in range(min(world, MAX_RANKS))])

    # -- incidents ----------------------------------------------------------------------
    def mirror(self, incident: int | None = None, plan: int | None = None, verdict: int | None = None) -> None:
        """Raise the header words to the job's (they only grow; under the
        block's lock, so a slower writer never lowers one)."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            for i, v in ((2, plan), (3, verdict), (1, incident)):  # the incident last: its file is already there
                if v is not None and v > self._get(i):
                    self._set(i, v)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def incident_path(self, seq: int) -> Path:
        return opened_incident_file(self.dir, seq)

    def open_incident(self, info: dict) -> int | None:
        """Open an incident unless one is already open.  Returns its seq, or None."""
        if self.link is not None:
            return self.link.open_incident(info)
        with _opening:  # flock does not exclude another thread of this process (one open file)
            return self._open_incident(info)

    def _open_incident(self, info: dict) -> int | None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            seq = self.incident_seq
            if seq > self.verdict_seq:
                return None  # one incident at a time; this one is already being handled
            seq += 1
            info = dict(info, seq=seq, incident_id=f"inc-{seq:04d}")
            write_json(opened_incident_file(self.dir, seq), info)
            self._set(1, seq)
            return seq
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def incident(self, seq: int) -> dict:
        return read_json(opened_incident_file(self.dir, seq))

    def wait(self, cond, timeout: float, what: str, poll: float = 0.002) -> None:
        if self.link is not None:
            poll = max(poll, 0.01)  # the condition may ask the job's store: no busier than that
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(poll)
