"""`just bench recorder`: the recorder's cost, measured side by side in one run.

1. Overhead: reference workload (2-rank DDP, gloo, CPU) step time with and
   without `watcher attach`, in alternating pairs; the median of per-pair
   ratios of median step times.
2. Collector throughput: a getppid storm from a C program; events/s recorded,
   drops, and events per second of collector CPU.
3. Size: bytes per event on disk, and MB per rank-minute on the workload.

Prints a table and writes bench-results/recorder.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5


def workload_cmd(steps: int, step_times: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "watcher.workloads.ddp_lm", f"--steps={steps}", f"--step-times={step_times}"]


def median_step_ms(step_times: Path) -> float:
    per_rank = []
    for f in sorted(step_times.parent.glob(step_times.name + ".rank*")):
        ns = [json.loads(line)["ns"] for line in f.read_text().splitlines()]
        per_rank.append(statistics.median(ns[WARMUP_STEPS:]) / 1e6)
    return max(per_rank)  # a DDP step is as slow as its slowest rank


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_workload(tmp: Path, tag: str, steps: int, recorded: bool) -> dict:
    st = tmp / f"{tag}.steps"
    job = subprocess.Popen(workload_cmd(steps, st), cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    out = tmp / f"{tag}.duckdb"
    watcher = None
    if recorded:
        watcher = subprocess.Popen([sys.executable, "-m", "watcher.cli", "attach", "--pid", str(job.pid),
                                    "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        watcher.stderr.readline()  # "Recording PID ..." once the probes are live
    t0 = time.monotonic()
    assert job.wait() == 0, "workload failed"
    wall = time.monotonic() - t0
    res = {"step_ms": median_step_ms(st), "wall_s": wall}
    if watcher:
        collector_cpu = None
        try:
            collector_cpu = cpu_seconds(watcher.pid)
        except OSError:
            pass
        assert watcher.wait(60) == 0, watcher.stderr.read()
        res.update(size_bytes=out.stat().st_size, collector_cpu_s=collector_cpu,
                   events=int(_meta(out)["events"]), drops=int(_meta(out)["drops"]))
    return res


def _meta(path: Path) -> dict:
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        return dict(con.execute("SELECT key, value FROM meta").fetchall())
    finally:
        con.close()


def bench_overhead(tmp: Path, pairs: int, steps: int) -> dict:
    ratios, plain, traced, sizes, rank_minutes, events = [], [], [], [], [], []
    for i in range(pairs):
        # Alternate which goes first, so drift on a noisy machine cancels out.
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {rec: run_workload(tmp, f"p{i}-{int(rec)}", steps, rec) for rec in order}
        ratios.append(got[True]["step_ms"] / got[False]["step_ms"])
        plain.append(got[False]["step_ms"])
        traced.append(got[True]["step_ms"])
        sizes.append(got[True]["size_bytes"])
        events.append(got[True]["events"])
        rank_minutes.append(2 * got[True]["wall_s"] / 60)
        print(f"  pair {i + 1}/{pairs}: plain {plain[-1]:.2f} ms  recorded {traced[-1]:.2f} ms  "
              f"ratio {ratios[-1]:.3f}", file=sys.stderr)
    return {
        "pairs": pairs, "steps": steps,
        "median_ratio": statistics.median(ratios), "ratios": ratios,
        "median_step_ms_plain": statistics.median(plain),
        "median_step_ms_recorded": statistics.median(traced),
        "mb_per_rank_minute": statistics.median(s / 1e6 / rm for s, rm in zip(sizes, rank_minutes)),
        "events_per_run": statistics.median(events),
    }


def bench_throughput(tmp: Path, n: int, runs: int) -> dict:
    storm = tmp / "storm"
    subprocess.run(["cc", "-O2", "-o", str(storm), str(ROOT / "scripts" / "storm.c")], check=True)
    results = []
    for i in range(runs):
        out = tmp / f"storm{i}.duckdb"
        w = subprocess.Popen([sys.executable, "-m", "watcher.cli", "record", "--out", str(out), "--",
                              str(storm), str(n)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        stdout, stderr = w.communicate()
        assert w.returncode == 0, stderr
        calls, secs = stdout.split()
        meta = _meta(out)
        con_rows = _count(out, "SELECT count(*) FROM syscall WHERE name = 'getppid'")
        results.append({"calls": int(calls), "storm_s": float(secs), "rows": con_rows,
                        "drops": int(meta["drops"]), "size_bytes": out.stat().st_size,
                        "events_per_s": con_rows / float(secs)})
        print(f"  storm {i + 1}/{runs}: {con_rows:,} of {calls} recorded in {float(secs):.2f} s, "
              f"drops {meta['drops']}", file=sys.stderr)
    best = statistics.median(r["events_per_s"] for r in results)
    return {"calls_per_run": n, "runs": results, "median_events_per_s": best,
            "total_drops": sum(r["drops"] for r in results),
            "bytes_per_event": statistics.median(r["size_bytes"] / max(r["rows"], 1) for r in results)}


def _count(path: Path, sql: str) -> int:
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--storm", type=int, default=3_000_000)
    ap.add_argument("--storm-runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "recorder.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="watcher-bench-") as d:
        tmp = Path(d)
        print("overhead (reference workload, paired runs)...", file=sys.stderr)
        ov = bench_overhead(tmp, args.pairs, args.steps)
        print("collector throughput (getppid storm)...", file=sys.stderr)
        th = bench_throughput(tmp, args.storm, args.storm_runs)
    rows = [
        ("overhead: median step-time ratio", f"{ov['median_ratio']:.3f}", "<= 1.03"),
        ("  median step ms, plain / recorded",
         f"{ov['median_step_ms_plain']:.2f} / {ov['median_step_ms_recorded']:.2f}", ""),
        ("collector: events/s recorded (storm)", f"{th['median_events_per_s']:,.0f}", ">= 1,000,000"),
        ("  drops over all storms", f"{th['total_drops']:,}", "0"),
        ("size: bytes per event (storm)", f"{th['bytes_per_event']:.1f}", ""),
        ("size: MB per rank-minute (workload)", f"{ov['mb_per_rank_minute']:.2f}", ""),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"\n{'metric':<{w}}  {'measured':>22}  target")
    for name, val, target in rows:
        print(f"{name:<{w}}  {val:>22}  {target}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"overhead": ov, "throughput": th,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
