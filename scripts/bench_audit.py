"""`just bench audit`: what the background SDC audit finds, and what it costs.

1. Detection against budget: the reference job (2-rank DDP, gloo, CPU) at
   default settings, one run per audit budget, with one gradient element's
   lowest exponent bit flipped on rank 1 before its allreduce every
   FLIP_EVERY steps (no detector sees it: the replicas agree and the loss
   hardly moves), policy observe so that each finding is replayed and judged
   and the run goes on.  Per budget: the flips that fell in an audited
   window and those caught (every covered flip should be), the steps and
   seconds from corruption to the incident, the share of steps audited, and
   the audits' CPU against the ranks' time.
2. Overhead at the default budget, side by side in one job: one long
   `watcher run` with the audit switched off and on in alternating windows
   (ABBA) through the control block's PAUSE_AUDIT bit (no audit is ordered
   and no budget accrues while off).  Per window pair: the ratio of steps
   per second (off / on: a rare audit shows in throughput, not in a median)
   and of median step time; medians over pairs.

Prints a table and writes bench-results/audit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_recorder import print_table, read_steps, window_median_ms  # noqa: E402
from bench_run import job, steps_ended  # noqa: E402

from watcher.runtime.control import PAUSE_AUDIT, Control  # noqa: E402

FLIP_FROM, FLIP_EVERY = 105, 25
STEPS = 1800


def detection(tmp: Path, budget: float) -> dict:
    """One run at `budget`: a flip every FLIP_EVERY steps (policy observe, so
    each found flip is replayed and judged and the run goes on); which flips
    fell in an audited window, which were caught, and how soon."""
    out = tmp / f"flip-{budget:g}"
    fault = {"scenario": "grad_bitflip", "rank": 1, "step": FLIP_FROM, "every": FLIP_EVERY, "bit": 23}
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), audit_budget=a['budget'], inject=a['fault'], "
            "policy='observe', quiet=True)); sys.exit(r.exit_code)")
    cmd = job(STEPS, tmp / f"t-{budget:g}")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code, json.dumps({"cmd": cmd, "out": str(out), "budget": budget,
                                                                 "fault": fault})],
                       cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"watcher run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    flips = list(range(FLIP_FROM, STEPS + 1, FLIP_EVERY))
    # A flip is covered when a window that was replayed to its end on every rank holds it.
    windows: dict[int, list[dict]] = {}
    for f in sorted((out / "runtime").glob("rank*.audits.jsonl")):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            windows.setdefault(e["audit"], []).append(e)
    done = [(es[0]["from_step"], es[0]["to_step"]) for es in windows.values()
            if es[0].get("from_step") is not None and all(e["status"] in ("clean", "mismatch") for e in es)]
    covered = [s for s in flips if any(a < s <= b for a, b in done)]
    incs = [json.loads(x.read_text()) for x in sorted((out / "incidents").glob("inc-*.json"))]
    found = [i for i in incs if i["kind"] == "sdc" and (i.get("detail") or {}).get("found_by") == "audit"]
    caught = sorted({i["detected_step"] for i in found} & set(flips))
    false_alarms = sorted({i["detected_step"] for i in found} - set(flips))
    lat_steps = [i["detail"]["detected_after_steps"] for i in found if i["detected_step"] in flips]
    lat_s = [i["detail"]["detected_after_s"] for i in found if i["detected_step"] in flips
             and i["detail"].get("detected_after_s") is not None]
    audit = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else {}
    return {"budget_pct": budget, "flips": len(flips), "covered": len(covered), "caught": len(caught),
            "missed_covered": sorted(set(covered) - set(caught)), "false_alarms": false_alarms,
            "classified": sorted({i.get("classification") or "none" for i in found}),
            "latency_steps_median": statistics.median(lat_steps) if lat_steps else None,
            "latency_steps_max": max(lat_steps) if lat_steps else None,
            "latency_s_median": statistics.median(lat_s) if lat_s else None,
            "audits": audit.get("audits", 0), "coverage": audit.get("coverage", 0.0),
            "cost_share": audit.get("cost_share"), "audit_cpu_s": audit.get("cpu_s"),
            "wall_s": round(time.monotonic() - t0, 1)}


def overhead(tmp: Path, pairs: int, window_s: float, budget: float) -> dict:
    run_dir = tmp / "windows"
    times = tmp / "windows-times" / "t"
    times.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "watcher.cli", "run", "--out", str(run_dir),
                             "--audit-budget", str(budget), "--", *job(10_000_000, times)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    spans = []
    try:
        while len(read_steps(times)) < 200:
            assert proc.poll() is None, "watcher run failed to start"
            time.sleep(0.5)
        ctl = Control(run_dir / "runtime")
        for i in range(pairs):
            pair = {}
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                ctl.paused = PAUSE_AUDIT if mode == "off" else 0
                lo = time.monotonic_ns()
                time.sleep(window_s)
                pair[mode] = (lo, time.monotonic_ns())
            spans.append(pair)
            print(f"pair {i + 1}/{pairs}", file=sys.stderr, flush=True)
        steps = read_steps(times)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(300)
    rate, med = [], []
    for pair in spans:
        n = {m: steps_ended(steps, *pair[m]) for m in ("off", "on")}
        if n["off"] and n["on"]:
            rate.append(n["off"] / n["on"])  # >1: the audit cost throughput
        off, on = (window_median_ms(steps, *pair[m]) for m in ("off", "on"))
        if off and on:
            med.append(on / off)
    audits = []
    for f in sorted((run_dir / "runtime").glob("rank*.audits.jsonl")):
        audits += [json.loads(x) for x in f.read_text().splitlines()]
    return {"budget_pct": budget, "pairs": len(rate), "window_s": window_s, "throughput_ratio_median": statistics.median(rate),
            "throughput_ratios": rate, "median_step_ratio": statistics.median(med) if med else None,
            "audit_lines": len(audits), "audits_clean": sum(a["status"] == "clean" for a in audits),
            "audit_cpu_s": round(sum(a.get("cpu_s") or 0 for a in audits), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="1000,10,2,0.5", help="audit budgets to try, percent")
    ap.add_argument("--pairs", type=int, default=6, help="off/on window pairs for the overhead")
    ap.add_argument("--window", type=float, default=100.0, help="seconds per window")
    ap.add_argument("--overhead-budget", type=float, default=0.5,
                    help="audit budget (percent) of the overhead job; at the default 0.5 a window is audited every "
                         "~100 s of a 25-ms-step job, so pairs must be long to hold any")
    ap.add_argument("--only", choices=("detection", "overhead"), help="run one part; the other is kept from "
                    "bench-results/audit.json")
    args = ap.parse_args()
    saved = ROOT / "bench-results" / "audit.json"
    out: dict = json.loads(saved.read_text()) if args.only and saved.exists() else {}
    with tempfile.TemporaryDirectory(prefix="watcher-bench-audit-") as d:
        tmp = Path(d)
        if args.only != "overhead":
            out["detection"] = []
            for b in (float(x) for x in args.budgets.split(",")):
                row = detection(tmp, b)
                out["detection"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        if args.only != "detection":
            out["overhead"] = overhead(tmp, args.pairs, args.window, args.overhead_budget)
    rows = []
    for r in out.get("detection", []):
        lat = (f"{r['latency_steps_median']:g} steps, {r['latency_s_median']:g} s" if r["caught"] else "-")
        rows.append((f"budget {r['budget_pct']:g}%: {r['flips']} flips, caught / in audited windows",
                     f"{r['caught']} / {r['covered']}",
                     f"median detection {lat}; coverage {100 * r['coverage']:.1f}%, {r['audits']} audits, "
                     f"audit CPU {100 * (r['cost_share'] or 0):.2f}% of the ranks' time"))
    o = out.get("overhead") or {}
    if o:
        rows.append((f"budget {o.get('budget_pct', 0.5):g}%: steps/s off / on", f"{o['throughput_ratio_median']:.3f}",
                     f"median of {o['pairs']} pairs of {o['window_s']:g}-s windows, one job; {o['audit_lines']} "
                     f"audit replays, {o['audit_cpu_s']} CPU-s"))
    if o.get("median_step_ratio"):
        rows.append((f"budget {o.get('budget_pct', 0.5):g}%: median step on / off", f"{o['median_step_ratio']:.3f}",
                     "same pairs"))
    print_table(rows, "notes")
    (ROOT / "bench-results").mkdir(exist_ok=True)
    (ROOT / "bench-results" / "audit.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
