"""`just bench scale`: what protection costs as a job grows, measured side by side.

For 2, 4 and 8 ranks on one node, and 2 nodes x 2 ranks (network
namespaces joined by a veth pair, scripts/two_nodes.py), each with its own
`watcher run`:

1. Overhead inside one job: Watcher switched off and on in alternating
   windows through every node's control block (as `just bench run` does),
   the median over window pairs of (on / off) step time.
2. Detect to resume: a transient fault (a gradient bit flip on rank 1 at
   step 12) under the default policy: detection to training resumed, the
   halt to resume, the replay's wall time and its collective exchange time,
   the bytes relayed between nodes, the merge.
3. The replica check's own cost per step: reading every rank's beacon for
   one step from the control block, timed in place for W = 2..1024 ranks.

Prints a table and writes bench-results/scale.json.  Needs root.
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
from bench_recorder import read_steps, window_median_ms  # noqa: E402
from two_nodes import TwoNodes  # noqa: E402

from watcher.runtime.control import PAUSE_RECORDER, PAUSE_RUNTIME, Control  # noqa: E402

FAULT = {"scenario": "grad_bitflip", "rank": 1, "step": 12}


def one_node_job(ranks: int, steps: int, times: Path | None = None, save: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            "-m", "watcher.workloads.ddp_lm", f"--steps={steps}",
            *([f"--step-times={times}"] if times else []), *([f"--save={save}"] if save else [])]


def watched(out: Path, cmd: list[str], faults=None) -> list[str]:
    """`watcher run` through the library API (only it injects drill faults)."""
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), inject=a['faults'], snapshot_interval=4, "
            "copy_interval=0, quiet=True)); "
            "sys.exit(r.exit_code)")
    return [sys.executable, "-c", code, json.dumps({"cmd": cmd, "out": str(out), "faults": faults})]


def overhead(starts, run_dirs: list[Path], times: Path, pairs: int, window_s: float) -> dict:
    """On/off window pairs inside one job, every node toggled at once."""
    procs = starts()
    try:
        deadline = time.monotonic() + 600
        while len(read_steps(times)) < 60 * len(run_dirs):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise SystemExit("the overhead job did not start")
            time.sleep(0.5)
        ctls = [Control(d / "runtime") for d in run_dirs]
        windows = []
        for i in range(pairs):
            pair = {}
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                for c in ctls:
                    c.paused = (PAUSE_RUNTIME | PAUSE_RECORDER) if mode == "off" else 0
                time.sleep(0.5)
                lo = time.monotonic_ns()
                time.sleep(window_s)
                pair[mode] = (lo, time.monotonic_ns())
            windows.append(pair)
        steps = read_steps(times)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGINT)
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    typical = statistics.median(s["ns"] for s in steps) / 1e9
    ratios = []
    for pair in windows:
        off = window_median_ms(steps, *pair["off"], min_steps=max(3, int(window_s / typical / 3)))
        on = window_median_ms(steps, *pair["on"], min_steps=max(3, int(window_s / typical / 3)))
        if off and on:
            ratios.append(on / off)
    return {"pairs": len(ratios), "median_ratio": statistics.median(ratios) if ratios else None,
            "step_ms": round(typical * 1e3, 1), "ratios": ratios}


def recovery(incident: dict) -> dict:
    rep, rec = incident.get("replay") or {}, incident.get("recovery") or {}
    per = (rep.get("per_rank") or {}).values()
    merged = rec.get("merged") or []
    return {"classification": incident.get("classification"), "recovered": incident.get("recovered"),
            "detect_to_resume_s": rec.get("detect_to_resume_s"), "halt_to_resume_s": rec.get("halt_to_resume_s"),
            "replay_s": max((p.get("replay_s") or 0) for p in per) if per else None,
            "exchange_wait_ms": max(((p.get("exchange_ms") or {}).get("wait") or 0) for p in per) if per else None,
            "merge_s": max((m.get("merge_s") or 0) for m in merged) if merged else None,
            "window": incident.get("window")}


def one_node(ranks: int, tmp: Path, pairs: int, window_s: float, steps: int) -> dict:
    times = tmp / f"t{ranks}" / "t"
    times.parent.mkdir()
    run_dir = tmp / f"over{ranks}"
    cmd = [sys.executable, "-m", "watcher.cli", "run", "--out", str(run_dir), "--",
           *one_node_job(ranks, 10_000_000, times)]
    over = overhead(lambda: [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                              start_new_session=True)], [run_dir], times, pairs, window_s)
    out = tmp / f"fault{ranks}"
    p = subprocess.run(watched(out, one_node_job(ranks, steps), FAULT), cwd=ROOT, capture_output=True, text=True,
                       timeout=1800)
    inc = json.loads((out / "incidents" / "inc-0001.json").read_text()) if (out / "incidents" / "inc-0001.json").exists() else {}
    return {"config": f"1 node x {ranks}", "ranks": ranks, "overhead": over, "recovery": recovery(inc),
            "exit_code": p.returncode}


def two_nodes(tmp: Path, pairs: int, window_s: float, steps: int) -> dict:
    with TwoNodes() as nodes:
        times = tmp / "t2x2" / "t"
        times.parent.mkdir()
        dirs = [tmp / f"over2x2-{i}" for i in (0, 1)]

        def starts():
            return [nodes.start(i, [sys.executable, "-m", "watcher.cli", "run", "--out", str(dirs[i]), "--",
                                    *nodes.job(i, None, 10_000_000, f"--step-times={times}")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                    for i in (0, 1)]
        over = overhead(starts, dirs, times, pairs, window_s)
        nodes.port += 1
        done = nodes.run_both(nodes.watched(tmp / "fault2x2", FAULT), timeout=1800)
        path = tmp / "fault2x2" / "node0" / "incidents" / "inc-0001.json"
        inc = json.loads(path.read_text()) if path.exists() else {}
        rec = recovery(inc)
        relayed = []
        for i in (0, 1):
            for r in (2 * i, 2 * i + 1):
                f = tmp / "fault2x2" / f"node{i}" / "incidents" / "inc-0001" / f"replayed.rank{r}.json"
                if f.exists():
                    relayed.append(json.loads(f.read_text()).get("relayed_mb") or 0)
        rec["relayed_mb_per_rank"] = max(relayed) if relayed else None
        return {"config": "2 nodes x 2", "ranks": 4, "overhead": over, "recovery": rec,
                "exit_code": [p.returncode for p in done]}


def replica_check_cost(tmp: Path) -> list[dict]:
    """Reading W beacons for one step, as check_replicas does each step (median of 200)."""
    ctl = Control(tmp)
    out = []
    for w in (2, 8, 64, 1024):
        for r in range(w):
            ctl.beacon(r, 5, 123)
        ts = []
        for _ in range(200):
            t0 = time.perf_counter_ns()
            [ctl.beacon_at(r, 5) for r in range(w)]
            ts.append(time.perf_counter_ns() - t0)
        out.append({"ranks": w, "us_per_step": round(statistics.median(ts) / 1e3, 1)})
    return out


def table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8", help="one-node world sizes")
    ap.add_argument("--no-two-nodes", action="store_true", help="skip 2 nodes x 2 ranks")
    ap.add_argument("--pairs", type=int, default=20, help="on/off window pairs per configuration")
    ap.add_argument("--steps", type=int, default=22, help="steps of the fault runs")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "scale.json"))
    args = ap.parse_args()
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="watcher-bench-scale-") as d:
        tmp = Path(d)
        for n in (int(x) for x in args.ranks.split(",")):
            print(f"bench scale: 1 node x {n}", file=sys.stderr, flush=True)
            results.append(one_node(n, tmp, args.pairs, 1.0 * max(1, n // 2), args.steps))
        if not args.no_two_nodes:
            print("bench scale: 2 nodes x 2", file=sys.stderr, flush=True)
            results.append(two_nodes(tmp, args.pairs, 2.0, args.steps))
        check = replica_check_cost(tmp)
    for r in results:
        o, rec = r["overhead"], r["recovery"]
        rows.append((r["config"], "-" if o["median_ratio"] is None else f"{o['median_ratio']:.3f}",
                     f"{o['step_ms']}", "-" if rec["detect_to_resume_s"] is None else f"{rec['detect_to_resume_s']:.2f}",
                     "-" if rec["halt_to_resume_s"] is None else f"{rec['halt_to_resume_s']:.2f}",
                     "-" if rec["replay_s"] is None else f"{rec['replay_s']:.2f}",
                     "-" if rec["exchange_wait_ms"] is None else f"{rec['exchange_wait_ms']:.0f}",
                     "-" if rec["merge_s"] is None else f"{rec['merge_s']:.3f}",
                     str(rec.get("relayed_mb_per_rank", "-")), f"{rec['classification']}/{rec['recovered']}"))
    table([("config", "on/off median", "step ms", "detect->resume s", "halt->resume s", "replay s",
                  "exchange wait ms", "merge s", "relayed MB/rank", "verdict")] + rows)
    print("\nreplica check, reading every rank's beacon for a step: "
          + ", ".join(f"{c['ranks']} ranks {c['us_per_step']} us" for c in check))
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"configs": results, "replica_check": check,
                                          "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
