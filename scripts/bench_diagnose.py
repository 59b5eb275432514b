"""`just bench diagnose`: how long Track B's diagnosis takes against the window it replays.

For each persistent scenario (software, data, params, hardware) the 2-rank
reference workload (gloo, CPU) runs under `watcher run --policy recover` with
the fault at step F and a snapshot every S steps, so the diagnosis replays
from the snapshot S*(F//S - 1) to the halt step F+1: a 10-step window with the
defaults.  Measured in the same run:

- window_s: the window's original time (the recorded durations of its steps);
- in-run: the diagnosis inside `watcher run`, all its counterfactual replays;
- again: `watcher diagnose` on the retained snapshots, R times (median),
  checking each repeat gives the recorded verdict and chain.

The ratio is diagnosis time over window_s (goal: under 20x).  Prints a table
and writes bench-results/diagnose.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL = 20.0


def once(tmp: Path, name: str, steps: int, fault_step: int, every: int, repeats: int) -> dict:
    from watcher.demo import reference_command
    from watcher.drill import BY_NAME
    from watcher.rundir import read_steps
    from watcher.replay.rediagnose import rediagnose, release
    from watcher.run import RunConfig, run

    s = BY_NAME[name]
    out = tmp / name
    t0 = time.monotonic()
    res = run(RunConfig(cmd=reference_command(steps), out=out, policy="recover", snapshot_interval=every,
                        detect=s.detect, inject=dict(s.inject, rank=1, step=fault_step), retain_s=600, quiet=True))
    wall = time.monotonic() - t0
    try:
        inc = res.incidents[0]
        diag = inc.get("diagnosis") or {}
        lo, hi = diag.get("from_step"), diag.get("to_step")
        if lo is None:
            return {"scenario": name, "error": f"no diagnosis ({inc.get('classification')}: "
                                               f"{(inc.get('replay') or {}).get('reason')})"}
        done = json.loads((out / "incidents" / inc["incident_id"] / "diagnosis" / "done.json").read_text())
        durs = [read_steps(out, r) for r in (0, 1)]
        # The slower rank's time for each step: the window as the job lived it.
        window_s = sum(max(d[k]["dur"] for d in durs) for k in range(lo + 1, hi + 1)) / 1e9
        again, same = [], []
        for _ in range(repeats):
            doc = rediagnose(out)
            again.append(doc["diagnosis_s"])
            same.append(doc["same_as_recorded"])
        med = statistics.median(again)
        return {"scenario": name, "attribution": inc["attribution"]["cause"], "window_steps": hi - lo,
                "window_s": round(window_s, 3), "replays": len(diag["replays"]),
                "in_run_s": done["diagnosis_s"], "again_s": again, "again_median_s": med,
                "ratio_in_run": round(done["diagnosis_s"] / window_s, 2), "ratio_again": round(med / window_s, 2),
                "same_verdict": all(same), "job_wall_s": round(wall, 1)}
    finally:
        release(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="bad_op,bad_batch,lr_spike,bad_cores")
    ap.add_argument("--fault-step", type=int, default=14)
    ap.add_argument("--every", type=int, default=5, help="snapshot interval (steps)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "diagnose.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="watcher-bench-diagnose-") as tmp:
        for name in args.scenarios.split(","):
            print(f"{name}: running ...", file=sys.stderr, flush=True)
            row = once(Path(tmp), name, args.steps, args.fault_step, args.every, args.repeats)
            print(f"{name}: {row}", file=sys.stderr, flush=True)
            rows.append(row)
    ok = [r for r in rows if "error" not in r]
    print(f"{'scenario':10} {'cause':9} {'window':>12} {'replays':>7} {'in-run':>8} {'again(med)':>10} "
          f"{'x in-run':>8} {'x again':>8}  same")
    for r in rows:
        if "error" in r:
            print(f"{r['scenario']:10} error: {r['error']}")
            continue
        print(f"{r['scenario']:10} {r['attribution']:9} {r['window_steps']:>3} st {r['window_s']:>5.2f} s "
              f"{r['replays']:>7} {r['in_run_s']:>7.2f}s {r['again_median_s']:>9.2f}s {r['ratio_in_run']:>8.1f} "
              f"{r['ratio_again']:>8.1f}  {r['same_verdict']}")
    worst = max((max(r["ratio_in_run"], r["ratio_again"]) for r in ok), default=None)
    summary = {"goal_ratio": GOAL, "worst_ratio": worst, "median_ratio_in_run":
               statistics.median(r["ratio_in_run"] for r in ok) if ok else None,
               "met": bool(ok) and len(ok) == len(rows) and worst < GOAL and all(r["same_verdict"] for r in ok)}
    print(f"worst ratio {worst}x (goal under {GOAL:g}x): {'met' if summary['met'] else 'NOT met'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
