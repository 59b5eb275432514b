"""Loads recorder.bpf.c with bcc and exposes its maps to the collector.

The BPF side decides what is recorded (the traced tgid set, idle-poll
counting, futex pairing); this class only compiles, attaches, and hands out
bulk ring readers and the exact counters.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .events import EVENT_DTYPES, RING_NAMES
from .ringbuf import RingReader

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "recorder.bpf.c"

ALL_PROBES = ("syscall", "futex", "proc", "signal")

# Ring sizes in pages (powers of two).  The syscall ring (32 MiB) holds
# ~350k records: a quarter of a second of a 1.3M/s storm.
DEFAULT_RING_PAGES = {"syscall": 8192, "futex": 1024, "proc": 256, "signal": 64}


@dataclass
class RecorderConfig:
    probes: tuple[str, ...] = ALL_PROBES
    log_idle_polls: bool = False
    # Poll-class calls returning ready faster than this are counted, not logged.
    poll_log_min_ns: int = 1_000_000
    ring_pages: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_RING_PAGES))

    def cflags(self) -> list[str]:
        flags = [f"-I{HERE}", f"-DLOG_IDLE_POLLS={int(self.log_idle_polls)}", f"-DPID_MAX={pid_max()}",
                 f"-DPOLL_LOG_MIN_NS={int(self.poll_log_min_ns)}ULL"]
        for probe in ALL_PROBES:
            flags.append(f"-DPROBE_{probe.upper()}={int(probe in self.probes)}")
        for ring, pages in self.ring_pages.items():
            flags.append(f"-DRING_PAGES_{ring.upper()}={pages}")
        return flags


def pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22  # the kernel's ceiling


class KernelRecorder:
    """The loaded BPF programs for one recording."""

    def __init__(self, config: RecorderConfig | None = None):
        from bcc import BPF  # imported late: `watcher check` explains a missing bcc

        self.config = config or RecorderConfig()
        self.bpf = BPF(src_file=str(SOURCE).encode(), cflags=self.config.cflags())
        self._traced = self.bpf["traced"]
        page = os.sysconf("SC_PAGE_SIZE")
        self.readers = {
            ring: RingReader(self.bpf[f"{ring}_ring"].map_fd,
                             self.config.ring_pages[ring] * page, EVENT_DTYPES[ring])
            for ring in RING_NAMES
        }

    def trace(self, pid: int) -> None:
        """Record process `pid` and every process it forks from now on."""
        self._traced[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def is_traced(self, pid: int) -> bool:
        return bool(self._traced[ctypes.c_int(pid)].value)

    def read(self) -> dict[str, np.ndarray]:
        return {ring: r.read() for ring, r in self.readers.items()}

    def pending_fraction(self) -> float:
        return max(r.pending_bytes() / r.size for r in self.readers.values())

    def syscall_stats(self) -> np.ndarray:
        """Exact per (pid, tid, nr) counters as a structured array."""
        dt = np.dtype([("pid", "<u4"), ("tid", "<u4"), ("nr", "<u4"), ("count", "<u8"),
                       ("dur", "<u8"), ("logged", "<u8"), ("idle", "<u8")])
        table = self.bpf["syscall_stats"]
        rows = [(k.pid, k.tid, k.nr, v.count, v.dur, v.logged, v.idle) for k, v in table.items()]
        return np.array(rows, dtype=dt)

    def stat_overflow(self) -> int:
        return int(self.bpf["stat_overflow"][ctypes.c_int(0)].value)

    def inflight(self) -> list[tuple[int, int, int, int, int]]:
        """(tid, nr, entry ts, arg0, arg1) of every traced thread inside a syscall."""
        return [(k.value, v.nr, v.ts, v.args[0], v.args[1])
                for k, v in self.bpf["inflight"].items() if v.ts]

    def drops(self) -> dict[str, list[int]]:
        """Per ring, per CPU, records the kernel failed to queue."""
        table = self.bpf["drops"]
        return {ring: [int(x) for x in table[ctypes.c_int(i)]] for i, ring in enumerate(RING_NAMES)}

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.bpf.cleanup()
