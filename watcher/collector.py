"""The collector: drains the BPF rings in bulk and appends columnar batches
to the recording.

Loop: every `poll_interval` read every ring (one numpy copy per ring); every
`flush_interval` (at most 1 s) decode what was read into columns, map pids and
tids to surrogate ids, and commit it in one transaction together with the
exact counters, drop counts and process/thread tables.  A SIGKILL therefore
loses at most one flush interval.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import __version__, schema
from .bpf.events import PROC_DLOPEN, PROC_EXEC, RING_NAMES
from .library_calls import LibraryCallWriter
from .process_model import ProcessModel
from .store import RecordingWriter
from .syscall_names import syscall_name


def monotonic_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass
class CollectorStats:
    events: dict[str, int] = field(default_factory=lambda: {r: 0 for r in RING_NAMES})
    drops: dict[str, int] = field(default_factory=lambda: {r: 0 for r in RING_NAMES})
    flushes: int = 0
    pruned_rows: int = 0
    started_ns: int = 0

    @property
    def total_events(self) -> int:
        return sum(self.events.values())

    @property
    def total_drops(self) -> int:
        return sum(self.drops.values())


class Collector:
    # Exact counters, in-flight calls and drops are rewritten every this many
    # flushes (and at the end); events every flush.
    COUNTERS_EVERY = 5
    # Library loads are reported by the loader probe as they happen; a full
    # rescan of every process's maps is only the fallback.
    RESCAN_EVERY = 10

    def __init__(self, recorder, writer: RecordingWriter, *, flush_interval: float = 1.0,
                 poll_interval: float = 0.1, max_size: int | None = None,
                 ring_window_ns: int | None = None, on_flush=None):
        if flush_interval > 1.0:
            flush_interval = 1.0  # the bounded-loss promise
        self.recorder = recorder
        self.writer = writer
        self.model = ProcessModel()
        self.flush_interval = flush_interval
        self.poll_interval = poll_interval
        self.max_size = max_size
        self.ring_window_ns = ring_window_ns
        self.on_flush = on_flush
        self.stats = CollectorStats(started_ns=monotonic_ns())
        self._cpu0 = _cpu_s()
        self._pending: dict[str, list[np.ndarray]] = {r: [] for r in RING_NAMES}
        self._pending_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self.drain_error: BaseException | None = None
        self._loaded_in: set[int] = set()     # pids whose loader reported a new library
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_stats: np.ndarray | None = None
        self.warnings: list[str] = []
        self.on_warning = None
        self.library_calls = None
        if getattr(recorder, "prober", None) is not None:
            self.library_calls = LibraryCallWriter(recorder.prober, self.model, writer)

    # -- meta ----------------------------------------------------------------
    def write_start_meta(self, *, target_pid: int | None, cmdline: str, mode: str, probes) -> None:
        self.writer.set_meta(
            schema_version=schema.SCHEMA_VERSION, watcher_version=__version__,
            host=socket.gethostname(), kernel=os.uname().release, mode=mode,
            target_pid=target_pid, target_cmdline=cmdline, probes=",".join(probes),
            start_ts=self.stats.started_ns,
            start_wall=time.strftime("%Y-%m-%dT%H:%M:%S%z"), complete="false",
        )

    # -- loop ----------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def poll(self) -> int:
        """Move every committed record out of the rings (cheap: one copy per ring).
        Called from the drain thread and the main thread: one reader at a time,
        and the records reach `_pending` before another poll or a take."""
        with self._poll_lock:
            return self._poll_locked()

    def _poll_locked(self) -> int:
        got = self.recorder.read()
        stacks = got.get("pystack")
        if stacks is not None and len(stacks) and self.library_calls is not None:
            # Name the stacks' code objects now, while their processes live
            # (a crashing rank's last calls are the ones that matter).
            self.library_calls.frames.learn(stacks)
        proc = got.get("proc")
        if proc is not None and len(proc):
            # A new image (exec) or a dlopen: its libraries may need probes now.
            loads = proc["pid"][(proc["kind"] == PROC_DLOPEN) | (proc["kind"] == PROC_EXEC)]
            if len(loads):
                with self._pending_lock:
                    self._loaded_in.update(int(p) for p in loads)
                self._wake.set()
        n = 0
        with self._pending_lock:
            for ring, arr in got.items():
                if len(arr):
                    self._pending[ring].append(arr)
                    self.stats.events[ring] += len(arr)
                    n += len(arr)
        return n

    def _drain(self, done: threading.Event) -> None:
        """Keep the rings empty while the main thread decodes and writes (DuckDB
        releases the GIL while it works), so a long flush never overflows them."""
        while not done.is_set():
            try:
                self.poll()
            except Exception as e:  # surfaced on the main thread, never silent
                self.drain_error = e
                self._wake.set()
                return
            # Poll faster when a ring is filling up, so bursts do not drop.
            busy = self.recorder.pending_fraction() >= 0.1
            done.wait(0.001 if busy else self.poll_interval)

    def run(self, should_stop=lambda: False) -> None:
        self._cpu0 = _cpu_s()  # steady-state CPU: set-up and the first attach are not counted
        done = threading.Event()
        drainer = threading.Thread(target=self._drain, args=(done,), name="watcher-drain", daemon=True)
        drainer.start()
        try:
            next_flush = time.monotonic() + self.flush_interval
            while not self._stop.is_set():
                if self.drain_error is not None:
                    raise self.drain_error
                if should_stop():
                    break
                now = time.monotonic()
                if now >= next_flush:
                    self.flush()
                    next_flush = now + self.flush_interval
                elif self._loaded_in:
                    self._scan_loaded()
                self._wake.wait(min(0.25, max(0.0, next_flush - time.monotonic())))
                self._wake.clear()
        finally:
            done.set()
            drainer.join()
        self.poll()

    # -- flush ---------------------------------------------------------------
    def _take_all(self) -> dict[str, np.ndarray | None]:
        """Everything drained so far, from every ring at once: a fork event
        and the child's first syscalls always land in the same flush."""
        with self._poll_lock, self._pending_lock:
            taken = self._pending
            self._pending = {r: [] for r in RING_NAMES}
        return {ring: None if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)
                for ring, parts in taken.items()}

    def flush(self, final: bool = False) -> None:
        m = self.model
        w = self.writer
        counters = final or self.stats.flushes % self.COUNTERS_EVERY == 0
        if counters:
            # Read the kernel's counters first, then drain: every thread they
            # mention then has its fork/clone event among what is drained.
            snapshot = (self.recorder.syscall_stats(), self.recorder.inflight(), self.recorder.drops())
            self.poll()
        batch = self._take_all()
        if not final and not counters and not m.dirty and all(v is None for v in batch.values()):
            self.stats.flushes += 1  # nothing happened: no transaction to pay for
            if self.on_flush:
                self.on_flush(self)
            return
        proc = batch["proc"]
        if proc is not None:
            m.apply_proc_events(proc)
        if final or self.stats.flushes % self.RESCAN_EVERY == 0:
            self.scan_libraries()
        if self.stats.flushes % 4 == 0 or final:
            m.refresh_names()
        w.begin()
        try:
            sc = batch["syscall"]
            if sc is not None:
                w.append_syscalls(sc["ts"], sc["dur"], m.utids(sc["pid"], sc["tid"]), m.upids(sc["pid"]),
                                  sc["nr"], sc["ret"], sc["args"], sc["cpu"])
            fx = batch["futex"]
            if fx is not None:
                w.append_futex(fx, m.utids(fx["pid"], fx["tid"]), m.upids(fx["pid"]),
                               np.where(fx["waker_tid"] > 0, m.utids_if_known(fx["waker_tid"]), -1))
            st = batch.get("pystack")
            if st is not None and self.library_calls is not None:
                self.library_calls.add_stacks(st)
            ap = batch["api"]
            if ap is not None and self.library_calls is not None:
                self.library_calls.write(ap, m.utids(ap["pid"], ap["tid"]), m.upids(ap["pid"]))
            if final and self.library_calls is not None:
                self._write_calls_in_progress()
            fo = batch["file"]
            if fo is not None:
                w.append_file_opens(fo, m.utids(fo["pid"], fo["tid"]), m.upids(fo["pid"]))
            sg = batch["signal"]
            if sg is not None:
                known = np.isin(sg["pid"], np.fromiter(m.pid_to_upid, dtype=np.int64))
                upid = np.full(len(sg), -1, dtype=np.int32)
                upid[known] = m.upids(sg["pid"][known])
                w.append_signals(sg, _utids_partial(m, sg, known), upid,
                                 m.utids_if_known(sg["target_tid"]))
            if counters:
                self._write_counters(*snapshot)
            if m.dirty:
                w.replace_rows("process", [
                    (p.upid, p.pid, p.parent_upid, p.ppid, p.name, p.cmdline, p.exe, p.start_ts,
                     p.end_ts, p.exit_code, p.exit_signal, p.rank, p.local_rank, p.world_size)
                    for p in m.processes])
                w.replace_rows("thread", [
                    (t.utid, t.tid, t.upid, t.name, t.start_ts, t.end_ts,
                     t.tid == m.processes[t.upid].pid) for t in m.threads])
                m.dirty = False
            if self.ring_window_ns:
                self._prune_older_than(monotonic_ns() - self.ring_window_ns)
            if self.library_calls is not None and self.stats.flushes % self.RESCAN_EVERY == 0:
                with self._poll_lock:  # the drain thread learns into the same caches
                    self.library_calls.frames.prune()
            if counters:  # running totals ride with the counters: one statement less a second
                w.set_meta(events=self.stats.total_events, drops=self.stats.total_drops,
                           last_flush_ts=monotonic_ns())
            w.commit()
        except BaseException:
            w.con.execute("ROLLBACK")
            raise
        self.stats.flushes += 1
        # A prune cuts by time; the bytes it frees are not exactly in
        # proportion (tables hold fixed overheads), so cut again if needed.
        for _ in range(4):
            if not (self.max_size and w.used_bytes() > self.max_size):
                break
            self._prune_for_size()
        if self.on_flush:
            self.on_flush(self)

    def scan_libraries(self) -> None:
        """Attach library probes to libraries the traced processes mapped since
        the last scan (the fallback; loads are normally reported as they happen)."""
        self._scan([p.pid for p in self.model.processes if p.end_ts is None])

    def _scan_loaded(self) -> None:
        """A traced process just loaded a library: attach to it now, not at the next flush."""
        with self._pending_lock:
            pids, self._loaded_in = self._loaded_in, set()
        self._scan(sorted(pids))

    def preattach_libraries(self, argv: list[str], env: dict, libraries=None) -> None:
        """Before a recorded command starts: probe the libraries it would call
        as soon as it loads them (uprobes/preattach.py; or `libraries`)."""
        prober = getattr(self.recorder, "prober", None)
        if prober is not None:
            with self._attach_lock:
                self._report(prober, lambda: prober.preattach(argv, env, libraries))

    def scan_pid(self, pid: int) -> None:
        """Probe what `pid` has mapped now (a load held until it is probed)."""
        self._scan([pid])

    def _scan(self, pids: list[int]) -> None:
        prober = getattr(self.recorder, "prober", None)
        if prober is None:
            return
        with self._attach_lock:  # the main loop and held loads (uprobes/hold.py) both attach
            self._report(prober, lambda: prober.scan(pids))

    def _report(self, prober, attach) -> None:
        seen = len(prober.notes)
        warnings = attach()
        self.warnings += warnings
        if self.on_warning:
            for w in warnings:
                self.on_warning(f"warning: {w}")
            for note in prober.notes[seen:]:
                self.on_warning(note)

    def _write_calls_in_progress(self) -> None:
        """Library calls entered and never returned: what a hung rank is inside."""
        ev = self.recorder.api_in_progress()
        keep = np.array([t in self.model.tid_to_utid for t in ev["tid"].tolist()], dtype=bool)
        ev = ev[keep]
        if len(ev):
            utids = np.array([self.model.tid_to_utid[t] for t in ev["tid"].tolist()], dtype=np.int32)
            upids = np.array([self.model.threads[u].upid for u in utids.tolist()], dtype=np.int32)
            self.library_calls.write(ev, utids, upids, entered=True)

    def _write_counters(self, st, inflight, drops) -> None:
        m, w = self.model, self.writer
        self.last_stats = st
        w.replace_syscall_stats(st, m.utids(st["pid"], st["tid"]), m.upids(st["pid"]))
        w.replace_rows("ring_drop", [(ring, cpu, n) for ring, per_cpu in drops.items()
                                     for cpu, n in enumerate(per_cpu)])
        for ring, per_cpu in drops.items():
            self.stats.drops[ring] = sum(per_cpu)
        now = monotonic_ns()
        rows = []
        for tid, nr, ts, a0, a1 in inflight:
            utid = m.tid_to_utid.get(tid)
            if utid is None:
                continue
            rows.append((now, utid, m.threads[utid].upid, nr, syscall_name(nr), ts, a0, a1))
        w.replace_rows("inflight_syscall", rows)

    # -- bounded storage -------------------------------------------------------
    def _prune_older_than(self, cutoff: int) -> None:
        now = monotonic_ns()
        for table in PRUNABLE:
            n = self.writer.con.execute(f"SELECT count(*) FROM {table} WHERE ts < ?", [cutoff]).fetchone()[0]
            if n:
                self.writer.con.execute(f"DELETE FROM {table} WHERE ts < ?", [cutoff])
                self.writer.con.execute("INSERT INTO prune VALUES (?, ?, ?, ?)", [now, table, cutoff, n])
                self.stats.pruned_rows += n

    def _prune_for_size(self) -> None:
        """Drop the oldest quarter of the recorded time span, then checkpoint so
        the freed blocks are reused."""
        con = self.writer.con
        span = " UNION ALL ".join(f"SELECT min(ts) AS lo, max(ts) AS hi FROM {t}" for t in PRUNABLE)
        lo, hi = con.execute(f"SELECT min(lo), max(hi) FROM ({span})").fetchone()
        if lo is None or hi is None or hi <= lo:
            return
        # Cut to about 3/4 of the cap, so the next flushes do not prune again at once.
        keep = max(0.0, min(1.0, 0.75 * self.max_size / max(self.writer.used_bytes(), 1)))
        con.execute("BEGIN TRANSACTION")
        self._prune_older_than(hi - int((hi - lo) * keep))
        con.execute("COMMIT")
        con.execute("CHECKPOINT")

    def finish(self, **facts) -> None:
        self.poll()
        self.flush(final=True)
        self.writer.set_meta(end_ts=monotonic_ns(), complete="true",
                             collector_cpu_s=round(_cpu_s() - self._cpu0, 3),
                             stat_overflow=self.recorder.stat_overflow(),
                             pruned_rows=self.stats.pruned_rows,
                             probe_warnings="; ".join(self.warnings),
                             library_probes=len(self.recorder.prober.slots) if getattr(
                                 self.recorder, "prober", None) else 0,
                             **{f"events_{r}": n for r, n in self.stats.events.items()},
                             **{f"drops_{r}": n for r, n in self.stats.drops.items()}, **facts)


# Event tables pruned (oldest first) by --max-size and --ring-minutes.
PRUNABLE = ("syscall", "futex", "signal", "api_call", "collective", "file_open")


def _cpu_s() -> float:
    """CPU time of the collector process itself (not of what it launched)."""
    t = os.times()
    return t.user + t.system


def _utids_partial(m: ProcessModel, sg: np.ndarray, known: np.ndarray) -> np.ndarray:
    out = np.full(len(sg), -1, dtype=np.int32)
    idx = np.flatnonzero(known)
    out[idx] = m.utids(sg["pid"][idx], sg["tid"][idx])
    return out
