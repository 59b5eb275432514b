"""Helpers for `watcher sql` and `watcher info`: argument splitting, output
formats, and the recording summary."""

from __future__ import annotations

import csv
import io
import json
import os
from datetime import datetime

from .errors import UsageError


def split_recordings_and_query(args: list[str], stdin) -> tuple[list[str], str]:
    """Recordings first, query last; '-' reads the query from stdin."""
    if len(args) < 2:
        raise UsageError("give a recording and a query, e.g. watcher sql run.duckdb \"SELECT 1\"")
    *paths, query = args
    if query == "-":
        query = stdin.read()
    elif os.path.exists(query) and query.endswith(".duckdb"):
        raise UsageError("no query given: the last argument is a recording")
    if not query.strip():
        raise UsageError("empty query")
    return paths, query


def _cell(v) -> str:
    if v is None:
        return "NULL"
    return str(v)


def format_rows(cols: list[str], rows: list[tuple], fmt: str) -> str:
    if fmt == "json":
        def conv(v):
            if isinstance(v, (bytes, bytearray)):
                return v.hex()
            if isinstance(v, datetime):
                return v.isoformat()
            return v
        return json.dumps([{c: conv(v) for c, v in zip(cols, r)} for r in rows], default=str) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        w.writerows(rows)
        return buf.getvalue()
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [len(c) for c in cols]
    for r in cells:
        for i, v in enumerate(r):
            widths[i] = min(max(widths[i], len(v)), 60)
    def line(vals):
        return "  ".join(v[:60].ljust(widths[i]) for i, v in enumerate(vals)).rstrip()
    out = [line(cols), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"


def process_roles(procs: list[tuple]) -> dict[int, tuple[str, int]]:
    """upid -> (role, rank) for the ranks and Watcher's own forks of them.

    Snapshots and replays name themselves (w-snap-<R>, w-replay-<R>:
    replay/snapshot.py); a replay too short-lived for the
    recorder to see its name is a child of a snapshot that never exec'd.
    Neither reads RANK from a new environment, so the recording leaves their
    rank NULL.  `procs` rows are (upid, parent_upid, pid, rank, name,
    exit_code, exit_signal, cmdline)."""
    by_upid = {p[0]: p for p in procs}
    roles: dict[int, tuple[str, int]] = {}
    for upid, parent, _, rank, name, *_ in sorted(procs):
        up = roles.get(parent)
        own = name.rsplit("-", 1) if name else None
        if own and own[0] in ("w-snap", "w-replay") and own[1].isdigit():
            roles[upid] = ("snapshot" if own[0] == "w-snap" else "replay", int(own[1]))
        elif up is not None and up[0] == "snapshot" and by_upid[upid][7] == by_upid[parent][7]:
            roles[upid] = ("replay", up[1])
        elif rank is not None:
            roles[upid] = ("rank", rank)
    return roles


def summarise(recs) -> str:
    lines = []
    for i, (path, meta) in enumerate(zip(recs.paths, recs.metas)):
        start, end = meta.get("start_ts"), meta.get("end_ts") or meta.get("last_flush_ts")
        dur = (int(end) - int(start)) / 1e9 if start and end else 0.0
        state = "complete" if meta.get("complete") == "true" else \
            "INCOMPLETE (collector stopped before finishing; data up to the last flush)"
        lines += [
            f"recording   {path}  ({os.path.getsize(path) / 1e6:.2f} MB, {state})",
            f"target      pid {meta.get('target_pid')}  {meta.get('target_cmdline', '')[:80]}",
            f"mode        {meta.get('mode')}   probes {meta.get('probes')}",
            f"host        {meta.get('host')}  kernel {meta.get('kernel')}  watcher {meta.get('watcher_version')}"
            f"  schema {meta.get('schema_version')}",
            f"started     {meta.get('start_wall')}   duration {dur:.1f} s",
            f"events      {int(meta.get('events', 0)):,}   drops {int(meta.get('drops', 0)):,}",
        ]
    counts = {t: recs.query(f"SELECT count(*) FROM {t}")[1][0][0]
              for t in ("process", "thread", "syscall", "futex", "signal")}
    lines.append("rows        " + "  ".join(f"{t} {n:,}" for t, n in counts.items()))
    _, procs = recs.query("SELECT upid, parent_upid, pid, rank, name, exit_code, exit_signal, cmdline FROM process "
                          "ORDER BY upid")
    roles = process_roles(procs)
    lines.append("processes")
    for upid, _, pid, rank, name, code, sig, cmd in procs[:20]:
        role = roles.get(upid)
        status = f"exit {code}" if code is not None else (f"signal {sig}" if sig is not None else "running/unknown")
        if role and role[0] == "snapshot" and sig == 9:
            status = "released"  # Watcher let it go: a snapshot is killed once newer ones replace it
        elif role and role[0] == "snapshot" and code is not None:
            status = f"replayed, exit {code}"  # woken to replay a window, it ran and ended on its own
        r = f"{role[0]} {role[1]}" if role else ""
        lines.append(f"  {pid:>8} {r:<11} {name or '':<16} {status:<16} {(cmd or '')[:50]}")
    if len(procs) > 20:
        lines.append(f"  ... {len(procs) - 20} more (SELECT * FROM process)")
    _, top = recs.query("SELECT name, calls, total_ns FROM top_syscall LIMIT 5")
    lines.append("top syscalls by time")
    for name, calls, total in top:
        lines.append(f"  {name:<18} {calls:>10,} calls {total / 1e6:>10.1f} ms")
    return "\n".join(lines) + "\n"
