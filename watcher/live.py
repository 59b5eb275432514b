"""`--live`: a terminal view refreshed at every flush (about once a second):
events/s per probe, top syscalls by time over the last interval, blocked
threads, and drops."""

from __future__ import annotations

import sys
import time

from .syscall_names import syscall_name


class LiveView:
    def __init__(self, stream=sys.stderr, top: int = 8):
        self.stream = stream
        self.top = top
        self.tty = stream.isatty()
        self._last_t = time.monotonic()
        self._last_events: dict[str, int] = {}
        self._last_dur: dict[int, int] = {}

    def render(self, collector) -> None:
        now = time.monotonic()
        dt = max(now - self._last_t, 1e-3)
        self._last_t = now
        ev = collector.stats.events
        lines = ["watcher live  " + time.strftime("%H:%M:%S")]
        rates = "  ".join(f"{ring} {(n - self._last_events.get(ring, 0)) / dt:,.0f}/s"
                          for ring, n in ev.items())
        self._last_events = dict(ev)
        lines.append(f"events  {rates}")
        lines.append(f"drops   {collector.stats.total_drops:,}   total events {collector.stats.total_events:,}")
        st = collector.last_stats
        if st is not None and len(st):
            by_nr: dict[int, int] = {}
            for nr, dur in zip(st["nr"].tolist(), st["dur"].tolist()):
                by_nr[nr] = by_nr.get(nr, 0) + dur
            delta = {nr: d - self._last_dur.get(nr, 0) for nr, d in by_nr.items()}
            self._last_dur = by_nr
            lines.append("top syscalls by time (last interval)")
            for nr, d in sorted(delta.items(), key=lambda kv: -kv[1])[: self.top]:
                if d > 0:
                    lines.append(f"  {syscall_name(nr):<18} {d / 1e6:10.1f} ms")
        blocked = sorted(collector.recorder.inflight(), key=lambda r: r[2])[: self.top]
        if blocked:
            t_now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            lines.append("blocked threads (longest first)")
            for tid, nr, ts, a0, _ in blocked:
                lines.append(f"  tid {tid:<8} {syscall_name(nr):<16} {(t_now - ts) / 1e9:8.2f} s  arg0=0x{a0:x}")
        text = "\n".join(lines)
        if self.tty:
            self.stream.write("\x1b[H\x1b[J" + text + "\n")
        else:
            self.stream.write(text + "\n\n")
        self.stream.flush()

    def close(self) -> None:
        pass
