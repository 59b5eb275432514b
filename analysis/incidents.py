"""Hang and crash analysis from outside the process, for any backend.

Collectives are matched across ranks by (group_index, seq): the order in which
each rank first used a group, and the per-group sequence number.  The first
(group, seq) that not every rank issued is where the job stopped agreeing;
the ranks that never issued it are where to look, and the recording says
where each of them is: its last collective, the system call it is blocked in
and for how long, and its last library calls.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RankState:
    rank: int
    pid: int
    alive: bool
    exit_code: int | None
    exit_signal: int | None
    last_collective: dict | None
    blocked_in: list[dict] = field(default_factory=list)
    last_api_calls: list[dict] = field(default_factory=list)
    last_syscalls: list[dict] = field(default_factory=list)


def _rows(recs, sql: str) -> list[dict]:
    cols, rows = recs.query(sql)
    return [dict(zip(cols, r)) for r in rows]


def _rank_processes(recs) -> dict[int, dict]:
    procs = _rows(recs, "SELECT upid, pid, rank, end_ts, exit_code, exit_signal FROM process "
                        "WHERE rank IS NOT NULL ORDER BY upid")
    out = {}
    for p in procs:
        out[p["rank"]] = p  # a relaunched rank: the latest process wins
    return out


def _state(recs, rank: int, proc: dict, n_calls: int = 5) -> RankState:
    upid = proc["upid"]
    last = _rows(recs, f"SELECT c.group_index, c.seq, c.op, c.tensor_count, c.numel, c.dtype, c.state, c.ts, "
                       f"a.py_site FROM collective c LEFT JOIN api_call a "
                       f"ON a.api_call_id = c.api_call_id AND a.upid = c.upid "
                       f"WHERE c.upid = {upid} ORDER BY c.ts DESC LIMIT 1")
    blocked = _rows(recs, f"SELECT tid, thread_name, syscall, blocked_ns, arg0 FROM blocked_thread "
                          f"WHERE upid = {upid} ORDER BY blocked_ns DESC LIMIT 4")
    calls = _rows(recs, f"SELECT ts, dur, probe, symbol, ret_name, detail, py_site FROM api_call "
                        f"WHERE upid = {upid} ORDER BY ts DESC LIMIT {n_calls}")
    sys_ = _rows(recs, f"SELECT s.ts, s.name, s.ret, t.name AS thread FROM syscall s JOIN thread t USING (utid) "
                       f"WHERE s.upid = {upid} AND t.is_main_thread ORDER BY s.ts DESC LIMIT {n_calls}")
    return RankState(rank, proc["pid"], proc["end_ts"] is None, proc["exit_code"], proc["exit_signal"],
                     last[0] if last else None, blocked, calls, sys_)


def _first_disagreement(recs, ranks: set[int]) -> dict | None:
    """The first (group, seq) not issued by every rank, or issued differently."""
    per = _rows(recs, "SELECT group_index, seq, rank, op, tensor_count, numel, dtype, state FROM collective "
                      "WHERE rank IS NOT NULL ORDER BY group_index, seq, rank")
    by_key: dict[tuple[int, int], list[dict]] = {}
    for r in per:
        by_key.setdefault((r["group_index"], r["seq"]), []).append(r)
    for (group, seq), rows in sorted(by_key.items()):
        present = {r["rank"] for r in rows}
        ops = {r["op"] for r in rows}
        # A field one rank could not decode (NULL: e.g. the tensor layout was
        # still being measured) is unknown, not a disagreement.
        for field in ("tensor_count", "numel", "dtype"):
            known = {r[field] for r in rows if r[field] is not None}
            if len(known) > 1:
                ops.add((field, tuple(sorted(map(str, known)))))
        if present != ranks or len(ops) > 1:
            return {"group_index": group, "seq": seq,
                    "issued_by": sorted(present), "missing": sorted(ranks - present),
                    "ops": {r["rank"]: {"op": r["op"], "tensor_count": r["tensor_count"], "numel": r["numel"],
                                        "dtype": r["dtype"], "state": r["state"]} for r in rows},
                    "mismatch": len(ops) > 1}
    return None


def analyze_hang(recs) -> dict:
    world = _rank_processes(recs)
    if not world:
        return {"kind": "hang", "verdict": "no ranks found (no process had RANK in its environment)"}
    ranks = set(world)
    first = _first_disagreement(recs, ranks)
    suspects = first["missing"] if first and first["missing"] else []
    if first and first["mismatch"]:
        suspects = suspects or sorted(ranks)
    states = {r: _state(recs, r, world[r]) for r in sorted(ranks)}
    if first is None:
        verdict = "every rank issued the same collectives; no collective disagreement found"
    elif first["missing"]:
        verdict = (f"ranks {first['missing']} never issued collective #{first['seq']} "
                   f"({next(iter(first['ops'].values()))['op']}) of group {first['group_index']}, "
                   f"which ranks {first['issued_by']} issued")
    else:
        verdict = f"ranks disagree on collective #{first['seq']} of group {first['group_index']}: {first['ops']}"
    return {"kind": "hang", "verdict": verdict, "first_disagreement": first, "suspect_ranks": suspects,
            "ranks": {r: asdict(s) for r, s in states.items()}}


def analyze_crash(recs) -> dict:
    world = _rank_processes(recs)
    dead = {r: p for r, p in world.items()
            if p["exit_signal"] is not None or (p["exit_code"] not in (None, 0))}
    if not dead:
        return {"kind": "crash", "verdict": "no rank exited abnormally", "crashed": {}}
    # The first to die is the cause; the launcher usually takes the others down after it.
    end = {r: p["end_ts"] or 0 for r, p in dead.items()}
    first = min(end, key=end.get)
    states = {r: asdict(_state(recs, r, world[r])) for r in sorted(world)}
    p = dead[first]
    how = f"signal {p['exit_signal']}" if p["exit_signal"] is not None else f"exit code {p['exit_code']}"
    last = states[first]["last_collective"]
    verdict = f"rank {first} (pid {p['pid']}) died first, by {how}" + (
        f", after collective #{last['seq']} ({last['op']}{_at(last)})" if last else "")
    return {"kind": "crash", "verdict": verdict, "first_dead_rank": first,
            "crashed": {r: {"pid": q["pid"], "exit_code": q["exit_code"], "exit_signal": q["exit_signal"]}
                        for r, q in dead.items()},
            "ranks": states}


def _at(call: dict) -> str:
    """ ` issued at FILE:LINE FUNCTION`, the user's line that made the call, when recorded."""
    return f" issued at {call['py_site']}" if call.get("py_site") else ""


def render_text(report: dict) -> str:
    lines = [f"{report['kind']}: {report['verdict']}"]
    for r, s in (report.get("ranks") or {}).items():
        status = "alive" if s["alive"] else (
            f"signal {s['exit_signal']}" if s["exit_signal"] is not None else f"exit {s['exit_code']}")
        mark = " <- suspect" if r in report.get("suspect_ranks", []) or r == report.get("first_dead_rank") else ""
        lines.append(f"rank {r} (pid {s['pid']}, {status}){mark}")
        c = s["last_collective"]
        lines.append(f"  last collective: " + (f"#{c['seq']} {c['op']} group {c['group_index']} ({c['state']})"
                                                f"{_at(c)}" if c else "none"))
        for b in s["blocked_in"][:2]:
            lines.append(f"  blocked in {b['syscall']} for {b['blocked_ns'] / 1e9:.2f} s "
                         f"(thread {b['thread_name']} tid {b['tid']})")
        for a in s["last_api_calls"][:3]:
            lines.append(f"  recent call: {a['symbol']} {a['detail'] or ''}".rstrip() + _at(a))
        if not s["alive"]:
            last = ", ".join(f"{x['name']}={x['ret']}" for x in s["last_syscalls"][:5])
            lines.append(f"  last syscalls of the main thread (newest first): {last or 'none'}")
    return "\n".join(lines) + "\n"
