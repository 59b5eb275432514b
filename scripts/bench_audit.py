"""`just bench audit`: what the background SDC audit finds, and what it costs.

1. Detection against budget: the reference job (2-rank DDP, gloo, CPU) at
   default settings, one run per audit budget, with one gradient element's
   lowest exponent bit flipped on rank 1 before its allreduce at step FLIP
   (no detector sees it: the replicas agree and the loss hardly moves).  Per
   budget: whether an audit caught it, the steps from corruption to the
   incident, the share of steps audited, the audits' CPU against the ranks'
   time, and whether the run ended bit-identical to one without the flip.
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

FLIP_STEP = 1200
STEPS = 1800


def detection(tmp: Path, budget: float) -> dict:
    out = tmp / f"flip-{budget:g}"
    fault = {"scenario": "grad_bitflip", "rank": 1, "step": FLIP_STEP, "bit": 23}
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), audit_budget=a['budget'], inject=a['fault'], "
            "quiet=True)); sys.exit(r.exit_code)")
    cmd = job(STEPS, tmp / f"t-{budget:g}") + [f"--save={out}.pt"]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code, json.dumps({"cmd": cmd, "out": str(out), "budget": budget,
                                                                 "fault": fault})],
                       cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"watcher run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    incs = [json.loads(x.read_text()) for x in sorted((out / "incidents").glob("inc-*.json"))]
    sdc = [i for i in incs if i["kind"] == "sdc"]
    audit = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else {}
    found = sdc[0] if sdc else None
    return {"budget_pct": budget, "caught": found is not None,
            "detected_step": found and found["detected_step"],
            "steps_to_detection": found and (found.get("detail") or {}).get("detected_after_steps"),
            "classification": found and found.get("classification"), "recovered": found and found.get("recovered"),
            "sha256": Path(f"{out}.pt.sha256").read_text().strip(),
            "audits": audit.get("audits", 0), "coverage": audit.get("coverage", 0.0),
            "cost_share": audit.get("cost_share"), "audit_cpu_s": audit.get("cpu_s"),
            "wall_s": round(time.monotonic() - t0, 1)}


def plain_sha(tmp: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(job(STEPS, tmp / "t-plain") + [f"--save={tmp}/plain.pt"], check=True, cwd=ROOT, env=env,
                   capture_output=True)
    return (tmp / "plain.pt.sha256").read_text().strip()


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
    ap.add_argument("--pairs", type=int, default=8, help="off/on window pairs for the overhead")
    ap.add_argument("--window", type=float, default=15.0, help="seconds per window")
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
            plain = plain_sha(tmp)
            out["detection"] = []
            for b in (float(x) for x in args.budgets.split(",")):
                row = detection(tmp, b)
                row["bit_identical"] = row.pop("sha256") == plain
                out["detection"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        if args.only != "detection":
            out["overhead"] = overhead(tmp, args.pairs, args.window, args.overhead_budget)
    rows = []
    for r in out.get("detection", []):
        rows.append((f"budget {r['budget_pct']:g}%: flip at step {FLIP_STEP}",
                     f"{r['steps_to_detection']} steps" if r["caught"] else "missed",
                     f"coverage {100 * r['coverage']:.1f}%, {r['audits']} audits, audit CPU "
                     f"{100 * (r['cost_share'] or 0):.2f}% of the ranks' time, "
                     f"{'recovered bit-identical' if r['bit_identical'] else 'run differs from plain'}"))
    o = out["overhead"]
    rows.append((f"budget {o.get('budget_pct', 0.5):g}%: steps/s off / on", f"{o['throughput_ratio_median']:.3f}",
                 f"median of {o['pairs']} pairs of {o['window_s']:g}-s windows, one job; {o['audit_lines']} "
                 f"audit replays, {o['audit_cpu_s']} CPU-s"))
    if o["median_step_ratio"]:
        rows.append((f"budget {o.get('budget_pct', 0.5):g}%: median step on / off", f"{o['median_step_ratio']:.3f}",
                     "same pairs"))
    print_table(rows, "notes")
    (ROOT / "bench-results").mkdir(exist_ok=True)
    (ROOT / "bench-results" / "audit.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
