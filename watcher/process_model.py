"""Surrogate ids for processes and threads.

Pids and tids are recycled, so every row refers to a `upid`/`utid` instead.
A fork or clone event always opens a new id; an unknown pid or tid seen in an
event (a thread that existed before attach) gets one on first sight, named
from /proc while it is still there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .bpf.events import PROC_EXEC, PROC_EXIT, PROC_FORK, PROC_REAP, PROC_THREAD
from .runtime.control import parent_pid
from .runtime.supervisor import COMM as SUPERVISOR


@dataclass
class ProcessRow:
    upid: int
    pid: int
    ppid: int | None
    parent_upid: int | None
    start_ts: int | None
    name: str = ""
    cmdline: str = ""
    exe: str = ""
    end_ts: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    threads: list[int] = field(default_factory=list)
    execd: bool = False  # ran exec since the fork (else it is a copy of its parent)
    stood_for: tuple | None = None  # a supervisor's: the (rank, local rank, world) it split from


@dataclass
class ThreadRow:
    utid: int
    tid: int
    upid: int
    start_ts: int | None
    name: str = ""
    end_ts: int | None = None


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _cstr(raw: bytes) -> str:
    """A fixed-size C char array: text up to the first NUL (the rest is stale)."""
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def read_ranks(pid: int) -> tuple[int | None, int | None, int | None]:
    """(RANK, LOCAL_RANK, WORLD_SIZE) from a live process's environment, as
    torchrun and most launchers set them."""
    found: dict[str, int | None] = {}
    for item in _read(f"/proc/{pid}/environ").split("\0"):
        key, _, value = item.partition("=")
        if key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            try:
                found[key] = int(value)
            except ValueError:
                found[key] = None
    return found.get("RANK"), found.get("LOCAL_RANK"), found.get("WORLD_SIZE")


def _set_ranks(p: "ProcessRow") -> bool:
    rank, local, world = read_ranks(p.pid)
    if rank is None:
        return False
    p.rank, p.local_rank, p.world_size = rank, local, world
    return True


def decode_wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit_code, exit_signal) from a wait(2) status."""
    if status < 0:
        return None, None
    sig = status & 0x7F
    if sig == 0:
        return (status >> 8) & 0xFF, None
    return None, sig


class ProcessModel:
    def __init__(self):
        self.processes: list[ProcessRow] = []
        self.threads: list[ThreadRow] = []
        self.pid_to_upid: dict[int, int] = {}
        self.tid_to_utid: dict[int, int] = {}
        self.dirty = True

    # -- creation ---------------------------------------------------------
    def new_process(self, pid: int, ppid: int | None, ts: int | None) -> ProcessRow:
        parent_upid = self.pid_to_upid.get(ppid) if ppid else None
        row = ProcessRow(len(self.processes), pid, ppid, parent_upid, ts)
        parent = self.processes[parent_upid] if parent_upid is not None else None
        if parent is not None:
            row.name, row.cmdline, row.exe = parent.name, parent.cmdline, parent.exe
        self.processes.append(row)
        self.pid_to_upid[pid] = row.upid
        self.dirty = True
        return row

    def new_thread(self, pid: int, tid: int, ts: int | None, name: str = "") -> ThreadRow:
        upid = self.upid(pid)
        row = ThreadRow(len(self.threads), tid, upid, ts, name)
        self.threads.append(row)
        self.tid_to_utid[tid] = row.utid
        self.processes[upid].threads.append(row.utid)
        self.dirty = True
        return row

    def adopt_live(self, pid: int, ppid: int | None, ts: int) -> ProcessRow:
        """A process that already existed when recording started."""
        row = self.new_process(pid, ppid, ts)
        row.name = _read(f"/proc/{pid}/comm").strip()
        row.cmdline = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
        try:
            row.exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            pass
        _set_ranks(row)
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            tids = [pid]
        for tid in tids:
            self.new_thread(pid, tid, ts, _read(f"/proc/{pid}/task/{tid}/comm").strip())
        return row

    # -- lookup -----------------------------------------------------------
    def upid(self, pid: int) -> int:
        u = self.pid_to_upid.get(pid)
        if u is None:
            u = self.new_process(pid, None, None).upid
            self.processes[u].name = _read(f"/proc/{pid}/comm").strip()
        return u

    def utid(self, pid: int, tid: int) -> int:
        u = self.tid_to_utid.get(tid)
        if u is None:
            u = self.new_thread(pid, tid, None, _read(f"/proc/{pid}/task/{tid}/comm").strip()).utid
        return u

    def utids(self, pids: np.ndarray, tids: np.ndarray) -> np.ndarray:
        """Vectorised utid lookup: one dict lookup per distinct tid."""
        if len(tids) == 0:
            return np.empty(0, dtype=np.int32)
        uniq, first, inverse = np.unique(tids, return_index=True, return_inverse=True)
        table = np.array([self.utid(int(pids[i]), int(t)) for t, i in zip(uniq, first)], dtype=np.int32)
        return table[inverse]

    def upids(self, pids: np.ndarray) -> np.ndarray:
        if len(pids) == 0:
            return np.empty(0, dtype=np.int32)
        uniq, inverse = np.unique(pids, return_inverse=True)
        table = np.array([self.upid(int(p)) for p in uniq], dtype=np.int32)
        return table[inverse]

    def utids_if_known(self, tids: np.ndarray) -> np.ndarray:
        """utid or -1, without creating rows (signal targets, wakers)."""
        if len(tids) == 0:
            return np.empty(0, dtype=np.int32)
        uniq, inverse = np.unique(tids, return_inverse=True)
        table = np.array([self.tid_to_utid.get(int(t), -1) for t in uniq], dtype=np.int32)
        return table[inverse]

    # -- lifecycle events ---------------------------------------------------
    def apply_proc_events(self, ev: np.ndarray) -> None:
        for e in ev[np.argsort(ev["ts"], kind="stable")]:
            kind, pid, tid, ts = int(e["kind"]), int(e["pid"]), int(e["tid"]), int(e["ts"])
            if kind == PROC_FORK:
                known = self.pid_to_upid.get(pid)
                if known is not None and self.processes[known].end_ts is None:
                    # Already adopted from /proc while attaching (it was born
                    # during the scan): a live pid cannot be a second process.
                    p = self.processes[known]
                    p.ppid, p.start_ts = int(e["ppid"]), ts
                    p.parent_upid = self.pid_to_upid.get(p.ppid)
                    self.dirty = True
                else:
                    self.new_process(pid, int(e["ppid"]), ts)
                    self.new_thread(pid, pid, ts, _cstr(e["comm"]))
            elif kind == PROC_THREAD:
                known = self.tid_to_utid.get(tid)
                if known is not None and self.threads[known].end_ts is None \
                        and self.processes[self.threads[known].upid].pid == pid:
                    self.threads[known].start_ts = ts  # adopted during the scan, same thread
                    self.dirty = True
                else:
                    self.new_thread(pid, tid, ts, _cstr(e["comm"]))
            elif kind == PROC_EXEC:
                p = self.processes[self.upid(pid)]
                p.name = _cstr(e["comm"])
                p.exe = _cstr(e["filename"])
                argv = [_cstr(a) for a in e["argv"]]
                argv = [a for a in argv if a]
                if argv:
                    p.cmdline = " ".join(argv)
                p.execd = True
                if p.rank is None:
                    _set_ranks(p)
                self.dirty = True
            elif kind == PROC_EXIT:
                utid = self.tid_to_utid.get(tid)
                if utid is not None:
                    self.threads[utid].end_ts = ts
                    # The name a thread dies with is the one it chose (a
                    # snapshot or replay names itself after the fork).
                    name = _cstr(e["comm"])
                    if name:
                        self.threads[utid].name = name
                        if tid == pid:
                            self.processes[self.threads[utid].upid].name = name
                            self.settle_rank(self.processes[self.threads[utid].upid])
                if int(e["flags"]) & 1:
                    p = self.processes[self.upid(pid)]
                    p.end_ts = ts
                    code, sig = decode_wait_status(int(e["code"]))
                    if p.exit_code is None and p.exit_signal is None:
                        p.exit_code, p.exit_signal = code, sig
                self.dirty = True
            elif kind == PROC_REAP:
                # The parent's wait status is authoritative (stop/continue reports are not exits).
                code = int(e["code"])
                child = self.pid_to_upid.get(tid)
                if child is not None and (code & 0xFF) != 0x7F and code != 0xFFFF:
                    p = self.processes[child]
                    p.exit_code, p.exit_signal = decode_wait_status(int(e["code"]))
                    self.dirty = True

    def refresh_names(self) -> None:
        """Thread names change after clone (prctl); reread those still alive."""
        for t in self.threads:
            if t.end_ts is None:
                pid = self.processes[t.upid].pid
                name = _read(f"/proc/{pid}/task/{t.tid}/comm").strip()
                if name and name != t.name:
                    t.name = name
                    if t.tid == pid:  # the main thread's name is the process's (a snapshot names itself)
                        self.processes[t.upid].name = name
                    self.dirty = True
        for p in self.processes:
            if (p.end_ts is None or p.name == SUPERVISOR) and self.settle_rank(p):
                self.dirty = True

    def settle_rank(self, p: ProcessRow) -> bool:
        """Which process is the rank when Watcher splits it (`watcher run`'s
        rescue, runtime/supervisor.py): the supervisor, the process the
        launcher started, is not; its live child is, and after a rescue so is
        the snapshot that took the rank over (a fork of the dead rank, now
        the supervisor's child, named as a rank again).  True if changed."""
        if p.name == SUPERVISOR:
            if p.rank is None:
                return False
            p.stood_for = (p.rank, p.local_rank, p.world_size)
            p.rank = p.local_rank = p.world_size = None
            # The child it split off is the rank, live or not: a short job's
            # rank may be gone before the supervisor's new name was read.
            for c in self.processes:
                if c.parent_upid == p.upid and not c.execd and c.rank is None and not c.name.startswith("w-"):
                    c.rank, c.local_rank, c.world_size = p.stood_for
            return True
        if p.rank is not None or p.end_ts is not None or p.start_ts is None or p.name.startswith("w-"):
            return False
        if self.forked_from_rank(p) and not self._under_supervisor(p):
            return False
        return _set_ranks(p)

    def _under_supervisor(self, p: ProcessRow) -> bool:
        parent = self.pid_to_upid.get(parent_pid(p.pid))
        return parent is not None and self.processes[parent].name == SUPERVISOR \
            and self.processes[parent].end_ts is None

    def forked_from_rank(self, p: ProcessRow) -> bool:
        """A fork of a rank that did not exec (DataLoader worker, Watcher
        snapshot, or a replay forked from that snapshot: a fork of a fork)
        shares the rank's environment but is not a rank."""
        while not p.execd and p.parent_upid is not None:
            p = self.processes[p.parent_upid]
            if p.rank is not None:
                return True
        return False
