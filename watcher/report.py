"""`watcher report`: the incidents of a recording, for a terminal or as one HTML page.

The HTML page is self-contained (inline SVG, no script, nothing fetched), so
it can be attached to a ticket or opened from an air-gapped cluster.  Each
incident comes first: its verdict, causal chain and prescription, and a
per-rank timeline of the replayed window (steps, collectives, waits, details
on hover); then loss and grad-norm curves per rank with axes and each
incident marked; then what Watcher cost each rank.  Several nodes' run
directories make one report.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from .store import Recordings

RANK_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def load(recs: Recordings) -> dict:
    """One job from one node's recording or several nodes' (each node's run
    directory holds the same incident documents: each is shown once)."""
    _, inc_rows = recs.query("SELECT json FROM incident ORDER BY incident_id")
    _, step_rows = recs.query("SELECT rank, step, ts, dur, loss, grad_norm, watcher_us FROM step ORDER BY rank, step")
    _, coll_rows = recs.query("SELECT rank, group_name, seq, op, step, ts, dur FROM collective_io ORDER BY rank, ts")
    _, off_rows = recs.query("SELECT DISTINCT rank, reason FROM protection ORDER BY rank")
    nodes = []
    if len(recs.paths) > 1:
        _, by_node = recs.query("SELECT recording, min(rank), max(rank), count(DISTINCT rank) FROM step GROUP BY 1 ORDER BY 1")
        nodes = [{"name": _node_name(recs.paths[i]), "ranks": (lo, hi), "count": n} for i, lo, hi, n in by_node]
    incidents = {}
    for (doc,) in inc_rows:
        inc = json.loads(doc)
        have = incidents.get(inc["incident_id"])
        if have is None or (have.get("classification") is None and inc.get("classification") is not None):
            incidents[inc["incident_id"]] = inc  # one per incident: the node's copy with a verdict
    waits = []
    for inc in incidents.values():  # the blocking calls of each incident's window, for its timeline
        w = inc.get("window") or {}
        if w.get("from_step") is None or w.get("to_step") is None:
            continue
        _, rows = recs.query(
            f"WITH span AS (SELECT min(ts - dur) AS t0, max(ts) AS t1 FROM step "
            f"WHERE step > {int(w['from_step'])} AND step <= {int(w['to_step'])}) "
            "SELECT p.rank, t.tid, s.ts, s.dur, s.name FROM syscall s JOIN process p USING (upid) "
            "JOIN thread t USING (utid), span WHERE p.rank IS NOT NULL AND t.tid = p.pid AND s.dur >= 1000000 "
            "AND s.ts BETWEEN span.t0 AND span.t1 ORDER BY s.dur DESC LIMIT 2000")
        waits += [dict(zip(("rank", "tid", "ts", "dur", "name"), r)) for r in rows]
    return {"incidents": list(incidents.values()), "nodes": nodes, "waits": waits,
            "unprotected": [{"rank": r, "reason": why} for r, why in off_rows],
            "steps": [dict(zip(("rank", "step", "ts", "dur", "loss", "grad_norm", "watcher_us"), r)) for r in step_rows],
            "colls": [dict(zip(("rank", "group", "seq", "op", "step", "ts", "dur"), r)) for r in coll_rows]}


def _stall_lines(inc: dict) -> list[str]:
    """A stall is a report, not a verdict: who held the job up, where, how long."""
    d = inc.get("detail") or {}
    w = d.get("where") or {}
    lines = [f"{inc['incident_id']}: stall at step {inc.get('detected_step')} on rank {inc.get('detected_rank')} "
             f"-> reported, not halted (no progress for {d.get('no_progress_s')} s, "
             f"{d.get('times_median')}x the median step)"]
    if w.get("training_line") or w.get("syscall"):
        lines.append(f"  waiting at {w.get('training_line') or '?'}" + (f", in {w['syscall']}" if w.get("syscall") else ""))
    lines.append(f"  went on after {d['stalled_s']} s" if d.get("stalled_s") is not None else "  never went on")
    return lines


def _straggler_lines(inc: dict) -> list[str]:
    """A straggler is a report: who is slow, by how much, measured how."""
    d = inc.get("detail") or {}
    return [f"{inc['incident_id']}: straggler at step {inc.get('detected_step')}: rank {inc.get('detected_rank')} "
            f"-> reported, not halted ({d.get('ratio')}x its peers)",
            f"  {d.get('own_ms')} ms of its own per step against {d.get('peers_own_ms')} ms "
            f"(median of {d.get('peers')} peer(s)), over the last {d.get('window_steps')} steps"]


def incident_lines(inc: dict) -> list[str]:
    if inc["kind"] == "stall":
        return _stall_lines(inc)
    if inc["kind"] == "straggler":
        return _straggler_lines(inc)
    rep = inc.get("replay") or {}
    if inc["kind"] == "replay_check":  # a check run on request, not a failure
        return [f"{inc['incident_id']}: replay check at step {inc.get('detected_step')}: "
                + ("not replayed (no snapshot to replay from)" if not rep
                   else "passed, the window matched the record exactly" if rep.get("exact")
                   else f"FAILED, first divergence {rep.get('first_divergence')}")]
    st = rep.get("stall") or {}
    lines = [f"{inc['incident_id']}: {inc['kind']} at step {inc.get('detected_step')} on rank {inc.get('detected_rank')}"
             f" -> {inc.get('classification') or 'unclassified'}"
             + (f" ({inc['transient_cause']})" if inc.get("transient_cause") else "")
             + (f", replay reproduced: {rep.get('reproduced')}" if rep else "")]
    if st.get("outside_collective"):
        w = st.get("where") or {}
        lines.append(f"  rank {st['rank']} stuck outside any collective in step {st['step']}, at "
                     f"{w.get('training_line') or '?'}" + (f", in {w['syscall']}" if w.get("syscall") else ""))
    att = inc.get("attribution")
    if att:
        lines.append(f"  attribution: {att['cause']} (confidence {att.get('confidence')})")
    for i, link in enumerate(inc.get("causal_chain") or []):
        lines.append(f"  {'root' if i == 0 else '  ->'} [{link['kind']}] {link.get('evidence')}")
    pre = inc.get("prescription")
    if pre:
        lines.append(f"  prescription: {describe_prescription(pre)}")
    if inc.get("recovered"):
        lines.append(f"  recovered: resumed at step {inc.get('resumed_at_step')}, {inc.get('steps_lost')} steps lost")
    return lines


def describe_prescription(p: dict) -> str:
    a = p.get("action")
    if a == "skip_batch":
        what = "; ".join(f"rank {b['rank']} step {b['step']} batch {b.get('batch_index')} samples {b['samples']}"
                         for b in p.get("batches") or [])
        text = f"skip_batch {what}"
        fix = p.get("fix")
        if fix:  # a bug the data sets off: the op is what to fix, the skip is meanwhile
            at = fix.get("line") or {}
            text += (f"; fix {fix['op']} at {at.get('file')}:{at.get('line')}: {fix.get('advice')}" if at
                     else f"; fix {fix['op']}: {fix.get('advice')}")
            if p.get("reproducer"):
                text += f"; reproducer {p['reproducer']}"
    elif a == "adjust_params":
        text = "adjust_params " + ", ".join(f"{c['name']}{'[' + str(c['param_group']) + ']' if 'param_group' in c else ''}"
                                            f" -> {c['to']:.4g}" for c in p.get("params") or [])
    elif a == "quarantine_device":
        d = p.get("device") or {}
        text = f"quarantine_device {d.get('kind')} {d.get('cpus')} on {d.get('host')} (rank {d.get('rank')}), " \
               f"move to {p.get('move_to')}"
    elif a == "fix_kernel":
        text = f"fix_kernel {p.get('op')} in {p.get('module')}; reproducer {p.get('reproducer')}"
    else:
        text = f"{a}" + (f" ({p['reason']})" if p.get("reason") else "")
    if p.get("applied"):
        text += f" [applied at step {p.get('applied_at_step')}]"
    return text


def _node_name(path) -> str:
    """A recording's node: its run directory's name (DIR/recording.duckdb), else the file's."""
    p = Path(path)
    return p.parent.name if p.name == "recording.duckdb" else p.stem


def text_report(data: dict) -> str:
    ranks = sorted({s["rank"] for s in data["steps"]})
    steps = len({s["step"] for s in data["steps"]})
    out = [f"{len(ranks)} rank(s), {steps} steps, {len(data['incidents'])} incident(s)"]
    if data.get("nodes"):
        out.append(f"{len(data['nodes'])} nodes: " + ", ".join(
            f"{n['name']} (ranks {n['ranks'][0]}..{n['ranks'][1]})" for n in data["nodes"]))
    out += describe_unprotected(data.get("unprotected") or [])
    cost = own_cost(data["steps"])
    if cost is not None:
        out.append(f"Watcher's own time in the ranks: {100 * cost:.1f}% of step time (median over steps)")
    for inc in data["incidents"]:
        out += [""] + incident_lines(inc)
    return "\n".join(out) + "\n"


def own_cost(steps: list[dict]) -> float | None:
    """Median share of a step the rank spent in Watcher's code (step.watcher_us)."""
    shares = sorted(s["watcher_us"] * 1000 / s["dur"] for s in steps if s.get("watcher_us") is not None and s["dur"])
    return shares[len(shares) // 2] if shares else None


# -- HTML ----------------------------------------------------------------------------------------

def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def rank_colour(i: int) -> str:
    """Eight distinct colours, then hues spread by the golden angle."""
    return RANK_COLOURS[i] if i < len(RANK_COLOURS) else f"hsl({(i * 137.508) % 360:.0f},65%,42%)"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round values from lo to hi."""
    span = hi - lo
    raw = span / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


AXIS_NAMES = {"loss": "loss", "grad_norm": "gradient norm (L2)"}


def curve_svg(data: dict, field: str, title: str, width: int = 680, height: int = 260) -> str:
    """One curve per rank, with axes (step; the value, log scale where it
    spans decades), the incidents marked in a band above the plot, and the
    legend in its own band below the axis, where nothing else is drawn."""
    pts = [s for s in data["steps"] if _finite(s[field])]
    if not pts:
        return f"<p>No {field} recorded.</p>"
    log = field == "grad_norm" or max(p[field] for p in pts) > 100 * max(min(p[field] for p in pts), 1e-12)
    val = (lambda v: math.log10(max(v, 1e-12))) if log else (lambda v: v)
    xs = [s["step"] for s in data["steps"]]  # non-finite steps too: they are marked, not plotted
    ys = [val(p[field]) for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    ranks = sorted({p["rank"] for p in pts})
    incidents = [i for i in data["incidents"] if i.get("detected_step") is not None and x0 <= i["detected_step"] <= x1]
    left, right, band = 64, 16, 14
    top = 24 + band * max(1, min(len(incidents), 4))       # title, then one line per incident label
    per_row = max(1, (width - left - right) // 72)
    legend_rows = -(-len(ranks) // per_row)
    plot_h = height - top - 44
    total_h = height + 16 * legend_rows
    bottom = top + plot_h
    sx = lambda x: left + (x - x0) / (x1 - x0) * (width - left - right)
    sy = lambda y: bottom - (y - y0) / (y1 - y0) * plot_h
    parts = [f'<svg class="plot" data-field="{field}" width="{width}" height="{total_h}" '
             f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{html.escape(title)}">',
             f'<rect x="0" y="0" width="{width}" height="{total_h}" fill="#fff"/>',
             f'<text x="{left}" y="16" font-size="13" font-weight="bold">{html.escape(title)}</text>',
             f'<line class="axis" x1="{left}" y1="{bottom}" x2="{width - right}" y2="{bottom}" stroke="#888"/>',
             f'<line class="axis" x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#888"/>']
    for t in _ticks(x0, x1, 8):
        if t != int(t):
            continue
        parts.append(f'<line class="tick" x1="{sx(t):.1f}" y1="{bottom}" x2="{sx(t):.1f}" y2="{bottom + 4}" '
                     f'stroke="#888"/><text class="tick" x="{sx(t):.1f}" y="{bottom + 15}" font-size="10" '
                     f'text-anchor="middle">{int(t)}</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{bottom + 30}" font-size="11" '
                 f'text-anchor="middle">step</text>')
    for t in _ticks(y0, y1, 5):
        label = _fmt(10 ** t) if log else _fmt(t)
        parts.append(f'<line x1="{left}" y1="{sy(t):.1f}" x2="{width - right}" y2="{sy(t):.1f}" stroke="#eee"/>'
                     f'<text class="tick" x="{left - 4}" y="{sy(t) + 3:.1f}" font-size="10" '
                     f'text-anchor="end">{label}</text>')
    ylabel = AXIS_NAMES.get(field, field) + (", log scale" if log else "")
    parts.append(f'<text x="12" y="{(top + bottom) / 2:.0f}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 12 {(top + bottom) / 2:.0f})">{html.escape(ylabel)}</text>')
    for n, inc in enumerate(incidents):
        k = inc["detected_step"]
        y_label = 24 + band * (n % 4) + 10
        parts.append(f'<line class="incident" x1="{sx(k):.1f}" y1="{y_label + 2}" x2="{sx(k):.1f}" y2="{bottom}" '
                     f'stroke="#e00" stroke-dasharray="4 3"/>'
                     f'<text class="incident-label" x="{min(sx(k) + 3, width - right - 150):.1f}" y="{y_label}" '
                     f'font-size="11" fill="#e00">{html.escape(inc["incident_id"])} {html.escape(inc["kind"])} '
                     f'at step {k}</text>')
    for s in data["steps"]:
        if s[field] is not None and not _finite(s[field]):
            parts.append(f'<text class="non-finite" x="{sx(s["step"]) - 3:.1f}" y="{top + 8}" font-size="11" '
                         f'fill="#e00"><title>rank {s["rank"]} step {s["step"]}: {s[field]}</title>x</text>')
    for i, r in enumerate(ranks):
        colour = rank_colour(i)
        mine = [p for p in pts if p["rank"] == r]
        line = " ".join(f"{sx(p['step']):.1f},{sy(val(p[field])):.1f}" for p in mine)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{line}">'
                     f'<title>rank {r}</title></polyline>')
        lx, ly = left + 72 * (i % per_row), height + 16 * (i // per_row) - 4
        parts.append(f'<g class="legend"><rect x="{lx}" y="{ly - 8}" width="12" height="3" fill="{colour}"/>'
                     f'<text x="{lx + 16}" y="{ly - 3}" font-size="11" fill="{colour}">rank {r}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def timeline_svg(data: dict, inc: dict, width: int = 680) -> str:
    """The incident's window, one row per rank: steps (the incident's in
    red), collectives, and the training thread's blocking waits (system
    calls of 1 ms or more) under them; every mark has its details on hover."""
    w = inc.get("window") or {}
    lo, hi = w.get("from_step"), w.get("to_step")
    if lo is None or hi is None:
        return "<p>No replay window.</p>"
    steps = [s for s in data["steps"] if lo < s["step"] <= hi and s["dur"]]
    colls = [c for c in data["colls"] if lo < c["step"] <= hi]
    if not steps:
        return "<p>No steps recorded in the window.</p>"
    t0 = min(s["ts"] - s["dur"] for s in steps)
    t1 = max(s["ts"] for s in steps)
    waits = [x for x in data.get("waits", []) if t0 <= x["ts"] <= t1]
    ranks = sorted({s["rank"] for s in steps})
    row, pad = 34, 60
    height = row * len(ranks) + 44
    sx = lambda t: pad + (t - t0) / max(t1 - t0, 1) * (width - pad - 10)
    parts = [f'<svg class="timeline" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">']
    for i, r in enumerate(ranks):
        y = 10 + i * row
        parts.append(f'<text x="4" y="{y + 14}" font-size="11">rank {r}</text>')
        for s in (s for s in steps if s["rank"] == r):
            x, x2 = sx(s["ts"] - s["dur"]), sx(s["ts"])
            bad = s["step"] == inc.get("detected_step")
            loss = f", loss {_fmt(s['loss'])}" if s.get("loss") is not None else ""
            parts.append(f'<rect class="step" x="{x:.1f}" y="{y}" width="{max(x2 - x - 1, 1):.1f}" height="18" '
                         f'fill="{"#f4b6b6" if bad else "#cfe0f3"}"><title>rank {r} step {s["step"]}: '
                         f'{s["dur"] / 1e6:.1f} ms{loss}</title></rect>'
                         f'<text x="{x + 2:.1f}" y="{y + 13}" font-size="9">{s["step"]}</text>')
        for c in (c for c in colls if c["rank"] == r and c["ts"] is not None):
            x = sx(c["ts"])
            parts.append(f'<rect class="collective" x="{x:.1f}" y="{y + 19}" '
                         f'width="{max(sx(c["ts"] + (c["dur"] or 0)) - x, 1):.1f}" height="5" fill="#555">'
                         f'<title>{html.escape(c["op"])} #{c["seq"]} ({html.escape(str(c["group"]))}), step '
                         f'{c["step"]}: {(c["dur"] or 0) / 1e6:.2f} ms</title></rect>')
        for x_ in (x_ for x_ in waits if x_["rank"] == r):
            x = sx(x_["ts"])
            parts.append(f'<rect class="wait" x="{x:.1f}" y="{y + 25}" width="{max(sx(x_["ts"] + x_["dur"]) - x, 1):.1f}" '
                         f'height="4" fill="#c60"><title>rank {r} thread {x_["tid"]}: {html.escape(x_["name"])} '
                         f'{x_["dur"] / 1e6:.1f} ms</title></rect>')
    axis_y = 10 + len(ranks) * row
    parts.append(f'<line class="axis" x1="{pad}" y1="{axis_y}" x2="{width - 10}" y2="{axis_y}" stroke="#888"/>')
    for t in _ticks(0, (t1 - t0) / 1e6, 6):
        x = sx(t0 + t * 1e6)
        parts.append(f'<text class="tick" x="{x:.1f}" y="{axis_y + 13}" font-size="10" '
                     f'text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text x="{(pad + width) / 2:.0f}" y="{axis_y + 28}" font-size="11" text-anchor="middle">'
                 f'ms from the window\'s first step (steps; collectives; waits of 1 ms or more)</text></svg>')
    return "".join(parts)


def cost_table(data: dict) -> str:
    """What Watcher cost each rank: its own time in the rank, per step."""
    rows = []
    for r in sorted({s["rank"] for s in data["steps"]}):
        mine = [s for s in data["steps"] if s["rank"] == r]
        share = own_cost(mine)
        us = sorted(s["watcher_us"] for s in mine if s.get("watcher_us") is not None)
        if share is None:
            continue
        rows.append(f"<tr><td>rank {r}</td><td>{100 * share:.2f}%</td><td>{us[len(us) // 2]:.0f} us</td>"
                    f"<td>{len(mine)}</td></tr>")
    if not rows:
        return ""
    return ('<h2>What Watcher cost the ranks</h2><table class="cost"><tr><th>rank</th><th>share of step time '
            "(median)</th><th>per step (median)</th><th>steps</th></tr>" + "".join(rows) + "</table>")


def html_report(data: dict, title: str) -> str:
    """Each incident first (verdict, chain, prescription, its window), then
    the curves, then what Watcher cost."""
    e = html.escape
    summary = text_report(data).split("\n\n")[0].splitlines()
    body = [f"<h1>Watcher report: {e(title)}</h1>", '<ul class="summary">'
            + "".join(f"<li>{e(line)}</li>" for line in summary) + "</ul>"]
    for inc in data["incidents"]:
        att = inc.get("attribution") or {}
        body.append(f'<section class="incident" id="{e(inc["incident_id"])}">'
                    f'<h2 class="verdict">{e(incident_lines(inc)[0])}</h2>')
        if att:
            body.append(f"<p><b>Attribution:</b> {e(att['cause'])} (confidence {att.get('confidence')})</p>")
        chain = inc.get("causal_chain") or []
        if chain:
            body.append('<h3>Causal chain</h3><ol class="chain">' + "".join(
                f"<li><b>{e(link['kind'])}</b>"
                + (f" step {link['step']}" if link.get("step") is not None else "")
                + (f" rank {link['rank']}" if link.get("rank") is not None else "")
                + (f" <code>{e(link['module'])}</code>" if link.get("module") else "")
                + (f" <code>{e(link['op'])}</code>" if link.get("op") else "")
                + f": {e(str(link.get('evidence')))}</li>" for link in chain) + "</ol>")
        if inc.get("prescription"):
            body.append(f'<p class="prescription"><b>Prescription:</b> '
                        f'{e(describe_prescription(inc["prescription"]))}</p>')
        body.append("<h3>Replayed window</h3>" + timeline_svg(data, inc))
        body.append(f"<details><summary>Incident document</summary><pre>{e(json.dumps(inc, indent=1))}</pre>"
                    "</details></section>")
    body += ["<h2>Training curves</h2>", curve_svg(data, "loss", "Loss per rank"),
             curve_svg(data, "grad_norm", "Gradient norm per rank"), cost_table(data)]
    style = ("body{font-family:sans-serif;max-width:760px;margin:2em auto;color:#222}"
             "svg{display:block;margin:1em 0;border:1px solid #ddd}code{background:#f4f4f4}"
             "section{border-top:2px solid #ccc;margin-top:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ddd;padding:2px 8px;text-align:right}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>Watcher report: {e(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")


def report(paths: list[str], html_out: Path | None) -> str:
    with Recordings(paths) as recs:
        data = load(recs)
    if html_out is not None:
        html_out.write_text(html_report(data, ", ".join(map(str, paths))))
    return text_report(data)


def describe_unprotected(rows: list[dict]) -> list[str]:
    """One line per reason protection was off, with the ranks it was off on."""
    ranks: dict[str, list[int]] = {}
    for off in rows:
        ranks.setdefault(off["reason"], []).append(off["rank"])
    return [f"protection off on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(set(rs))))}: {why}"
            for why, rs in ranks.items()]
