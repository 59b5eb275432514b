"""Loads recorder.bpf.c with bcc and exposes its maps to the collector.

The BPF side decides what is recorded (the traced tgid set, idle-poll
counting, futex pairing); this class only compiles, attaches, and hands out
bulk ring readers and the exact counters.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..uprobes.attach import LibraryProber
from ..uprobes.python_frames import cflags as python_frame_flags
from ..uprobes.spec import load_specs, select
from .events import API_EVENT, EVENT_DTYPES, LIBRARY_RINGS, RING_NAMES
from .ringbuf import RingReader

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "recorder.bpf.c"

KERNEL_PROBES = ("syscall", "futex", "proc", "signal", "file")
LIBRARY_PROBES = ("libtorch", "libtorch_cuda", "libcudart", "libnccl")   # uprobes/<name>.toml
ALL_PROBES = KERNEL_PROBES + LIBRARY_PROBES

# Ring sizes in pages (powers of two).  The syscall ring (32 MiB) holds
# ~350k records: a quarter of a second of a 1.3M/s storm.
DEFAULT_RING_PAGES = {"syscall": 8192, "futex": 1024, "proc": 256, "signal": 64, "api": 1024, "file": 512,
                      "pystack": 1024}
UPROBES_DIR = HERE.parent / "uprobes"


@dataclass
class RecorderConfig:
    probes: tuple[str, ...] = ALL_PROBES
    log_idle_polls: bool = False
    log_quick_socket_io: bool = False  # log socket transfers that did not block, too
    # Poll-class calls returning ready, and socket transfers, faster than this are counted, not logged.
    poll_log_min_ns: int = 1_000_000
    ring_pages: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_RING_PAGES))
    op_pattern: str | None = None   # opt-in operator probes: at::_ops::<op>::call, op matching this
    python_stacks: bool = True      # library calls carry the caller's Python stack

    @property
    def libraries(self) -> tuple[str, ...]:
        return tuple(p for p in self.probes if p in LIBRARY_PROBES)

    @property
    def with_uprobes(self) -> bool:
        return bool(self.libraries or self.op_pattern)

    @cached_property
    def api_rows(self) -> int:
        """Rows of 16 probe slots.  Each row adds ~0.6 s of compile time (bcc
        inlines every handler), so size it to the probe set with a quarter
        spare (a library mapped from two files); operator patterns can expand
        to many symbols."""
        if self.op_pattern:
            return 8
        n = sum(len(lib.probes) for lib in select(load_specs(UPROBES_DIR), set(self.libraries), None))
        return max(1, min(16, -(-(n * 5 // 4) // 16)))

    def cflags(self) -> list[str]:
        flags = [f"-I{HERE}", f"-DLOG_IDLE_POLLS={int(self.log_idle_polls)}",
                 f"-DLOG_QUICK_SOCKET_IO={int(self.log_quick_socket_io)}", f"-DPID_MAX={pid_max()}",
                 f"-DHAVE_GROUP_DEAD={int(has_group_dead())}",
                 f"-DPOLL_LOG_MIN_NS={int(self.poll_log_min_ns)}ULL"]
        for probe in KERNEL_PROBES:
            flags.append(f"-DPROBE_{probe.upper()}={int(probe in self.probes)}")
        flags += python_frame_flags()
        flags += [f"-I{UPROBES_DIR}", f"-DWITH_UPROBES={int(self.with_uprobes)}",
                  f"-DAPI_ROWS={self.api_rows}", f"-DAPI_SLOTS={16 * self.api_rows}"]
        for ring, pages in self.ring_pages.items():
            flags.append(f"-DRING_PAGES_{ring.upper()}={pages}")
        return flags


def has_group_dead() -> bool:
    """sched_process_exit gained `group_dead` after Linux 6.1."""
    for base in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        try:
            with open(f"{base}/events/sched/sched_process_exit/format") as f:
                return "group_dead" in f.read()
        except OSError:
            continue
    return False


def pid_max() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 22  # the kernel's ceiling


class KernelRecorder:
    """The loaded BPF programs for one recording."""

    def __init__(self, config: RecorderConfig | None = None):
        from bcc import BPF  # lazy: bcc is heavy and optional; `watcher check` explains a missing bcc

        self.config = config or RecorderConfig()
        text = SOURCE.read_text()
        if self.config.with_uprobes:
            text += "\n" + (UPROBES_DIR / "api.bpf.c").read_text()
        self.bpf = BPF(text=text.encode(), cflags=self.config.cflags())
        self._traced = self.bpf["traced"]
        page = os.sysconf("SC_PAGE_SIZE")
        rings = [r for r in RING_NAMES if r not in LIBRARY_RINGS or self.config.with_uprobes]
        self.readers = {
            ring: RingReader(self.bpf[f"{ring}_ring"].map_fd,
                             self.config.ring_pages[ring] * page, EVENT_DTYPES[ring])
            for ring in rings
        }
        self.prober = None
        if self.config.with_uprobes:
            specs = select(load_specs(UPROBES_DIR), set(self.config.libraries), self.config.op_pattern)
            self.prober = LibraryProber(self.bpf, specs, 16 * self.config.api_rows,
                                        python_stacks=self.config.python_stacks)

    def trace(self, pid: int) -> None:
        """Record process `pid` and every process it forks from now on."""
        self._traced[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def pause(self, candidates: list[int]) -> list[int]:
        """Stop recording the processes among `candidates` (the live ones the
        collector knows; the traced array spans pid_max, up to 4M entries,
        too many to scan) for an overhead measurement's "off" window: each
        probe then returns after one array lookup.  Returns the tgids taken
        out, for `resume`."""
        out = [pid for pid in candidates if self.is_traced(pid)]
        for pid in out:
            self._traced[ctypes.c_uint32(pid)] = ctypes.c_uint8(0)
        return out

    def resume(self, pids: list[int]) -> None:
        """Record again the processes `pause` took out that still run.  What
        they did meanwhile, processes they started included, is not recorded."""
        for pid in pids:
            if os.path.exists(f"/proc/{pid}"):
                self.trace(pid)

    def is_traced(self, pid: int) -> bool:
        return bool(self._traced[ctypes.c_int(pid)].value)

    def read(self) -> dict[str, np.ndarray]:
        # The proc ring last: a fork or clone is emitted before anything the
        # new task does, so every task seen in the other rings has its
        # creation event in this same read.
        order = [r for r in self.readers if r != "proc"] + (["proc"] if "proc" in self.readers else [])
        return {ring: self.readers[ring].read() for ring in order}

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
                for k, v in self.bpf["inflight"].items() if v.ts and v.nr != 335]  # 335: uretprobe trampoline

    def api_in_progress(self) -> np.ndarray:
        """Library calls entered and not yet returned, as api_event records."""
        if self.prober is None:
            return np.empty(0, dtype=API_EVENT)
        rows = []
        for k, v in self.bpf["api_inflight"].items():
            rows.append((v.ts, 0, 0, k.tid, k.slot, v.flags, 0, tuple(v.args), tuple(v.deref), tuple(v.tensor)))
        return np.array(rows, dtype=API_EVENT)

    def drops(self) -> dict[str, list[int]]:
        """Per ring, per CPU, records the kernel failed to queue."""
        table = self.bpf["drops"]
        return {ring: [int(x) for x in table[ctypes.c_int(i)]] for i, ring in enumerate(RING_NAMES)}

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.bpf.cleanup()
