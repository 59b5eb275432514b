"""`just bench run`: what `watcher run` costs, measured side by side in one run.

1. Whole-Watcher overhead, paired inside one job: one long `watcher run` of
   the reference workload (2-rank DDP, gloo, CPU) with default settings;
   Watcher is switched off and on in alternating windows (1 s, ABBA order)
   through the run's control block: off pauses the recorder (the job's
   processes leave the traced set, so each probe returns after one array
   lookup) and the in-rank runtime (every hook passes through, snapshots
   and copies are dropped); on is everything at defaults: recorder,
   runtime, adaptive snapshots and state copies.  The machine's drift (a
   plain step here varies 21-34 ms from window to window) cancels.
   One pair alone is mostly noise (0.8-1.3; the spread is the same for 1-s
   and 2-s windows, so many short pairs beat a few long ones).  Reported:
   the median over pairs of (on / off) with a bootstrap 95% interval, the
   geometric mean with its 95% interval, and as the worst case the worst
   median of independent blocks of 40 consecutive pairs (a block of 10 pairs
   moves by +-4% on noise alone); also the CPU per step of the ranks plus
   the collector, and Watcher's own time inside the ranks.
2. End to end against plain torchrun: plain torchrun and `watcher run` with
   default settings as separate jobs in alternating pairs; per job the
   median steady step.  Noisier (job to job).
3. Snapshot cost: a run with a fixed interval of 8 steps: fork ms, the
   memory each snapshot came to hold over one interval (pages the rank
   rewrote), and the interval the default budget chose in the overhead runs.
4. Replay time: a replay check of the longest retained window, against the
   time the same steps took live.

Prints a table and writes bench-results/run.json.
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
sys.path.insert(0, str(ROOT / "scripts"))
from bench_recorder import print_table, read_steps, window_median_ms  # noqa: E402

from watcher.rundir import read_steps as read_rank_steps  # noqa: E402
from watcher.run import POLICIES  # noqa: E402

WARMUP = 10
RANKS = 2  # --ranks


def job(steps: int, times: Path, batch: int | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
            "-m", "watcher.workloads.ddp_lm", f"--steps={steps}", f"--step-times={times}",
            *([f"--batch={batch}"] if batch else [])]


def steady_median_ms(times: Path) -> float:
    rows = [r for r in read_steps(times) if r["step"] >= WARMUP]
    return statistics.median(r["ns"] for r in rows) / 1e6


def watcher_run(out: Path, cmd: list[str], *extra: str) -> None:
    p = subprocess.run([sys.executable, "-m", "watcher.cli", "run", "--out", str(out), *extra, "--", *cmd],
                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        raise SystemExit(f"watcher run failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def runtime_steps(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted((run_dir / "runtime").glob("rank*.steps.jsonl")):
        out += read_rank_steps(run_dir, int(f.name[4:].split(".")[0])).values()
    return out


def rank_pids() -> list[int]:
    """The reference workload's rank processes (not their launcher)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"watcher.workloads.ddp_lm" in argv and b"torch.distributed.run" not in argv:
            out.append(int(d.name))
    return sorted(out)


def cpu_ticks(pids: list[int]) -> int:
    """User + system CPU of the processes, all threads (gloo's included), in clock ticks."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total


def steal_ticks() -> int:
    """CPU time the hypervisor gave to other guests (all CPUs, clock ticks):
    this VM's main source of window-to-window noise."""
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def steps_ended(steps: list[dict], lo: int, hi: int) -> int:
    return sum(1 for s in steps if lo <= s["end"] <= hi)


BLOCK = 40  # window pairs per block (the worst-case figure)


def median_interval(xs: list[float], resamples: int = 4000) -> list[float] | None:
    """A bootstrap 95% interval of the median of `xs` (pairs resampled; fixed seed)."""
    import random

    if len(xs) < 10:
        return None
    rnd = random.Random(0)
    meds = sorted(statistics.median(rnd.choices(xs, k=len(xs))) for _ in range(resamples))
    return [meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]]


def _t975(df: int) -> float:
    """Student's t, two-sided 95%, for `df` degrees of freedom (a few points, the next lower one used)."""
    table = ((1, 12.71), (2, 4.30), (3, 3.18), (4, 2.78), (5, 2.57), (6, 2.45), (8, 2.31), (10, 2.23),
             (15, 2.13), (20, 2.09), (30, 2.04), (40, 2.02), (60, 2.00), (120, 1.98))
    return next((t for d, t in reversed(table) if df >= d), 12.71) if df < 1000 else 1.96


def geometric_mean(xs: list[float]) -> dict:
    """The geometric mean of the ratios and its 95% interval (a t-interval on their logs)."""
    import math

    if len(xs) < 3:
        return {"geo_mean_ratio": None, "geo_mean_ci95": None}
    logs = [math.log(x) for x in xs]
    m, half = statistics.mean(logs), _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"geo_mean_ratio": math.exp(m), "geo_mean_ci95": [math.exp(m - half), math.exp(m + half)]}


def bench_watcher_windows(tmp: Path, pairs: int, window_s: float, settle_s: float = 0.4,
                          toggle: str = "all", policy: str | None = None, batch: int | None = None) -> dict:
    import signal

    from watcher.runtime.control import PAUSE_RECORDER, PAUSE_RUNTIME, Control

    pause = {"all": PAUSE_RUNTIME | PAUSE_RECORDER, "runtime": PAUSE_RUNTIME, "recorder": PAUSE_RECORDER}[toggle]

    run_dir = tmp / "windows"
    times = tmp / "windows-times" / "t"
    times.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "watcher.cli", "run", "--out", str(run_dir),
                             *(["--policy", policy] if policy else []), "--", *job(10_000_000, times, batch)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    windows = []
    try:
        while len(read_steps(times)) < 200:
            assert proc.poll() is None, "watcher run failed to start"
            time.sleep(0.5)
        ctl = Control(run_dir / "runtime")
        pids = rank_pids() + [proc.pid]  # the ranks and `watcher run` (the collector's threads)
        cpu, steal = [], []
        for i in range(pairs):
            if proc.poll() is not None:  # the job ended: the windows from here would hold no steps
                print(f"watcher run ended (exit {proc.returncode}) after {i} window pairs; its run directory: "
                      f"{run_dir}", file=sys.stderr, flush=True)
                break
            pair, ticks, st = {}, {}, {}
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                ctl.paused = pause if mode == "off" else 0
                time.sleep(settle_s)  # the collector follows within 0.25 s; the ranks at their next step
                lo, c0, s0 = time.monotonic_ns(), cpu_ticks(pids), steal_ticks()
                time.sleep(window_s)
                pair[mode] = (lo, time.monotonic_ns())
                ticks[mode] = cpu_ticks(pids) - c0
                st[mode] = steal_ticks() - s0
            windows.append(pair)
            cpu.append(ticks)
            steal.append(st)
        steps = read_steps(times)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    # CPU per step: the ranks' and the collector's CPU time (the probes'
    # in-kernel time included) over the steps that ended in the window.
    cpu_ratios = []
    for pair, ticks in zip(windows, cpu):
        per_step = {m: ticks[m] / max(steps_ended(steps, *pair[m]), 1) for m in ("off", "on")}
        if ticks["off"] and ticks["on"]:
            cpu_ratios.append(per_step["on"] / per_step["off"])
    ratios, off_ms, on_ms, calm = [], [], [], []
    # A window counts when it holds at least a third of the steps it could:
    # one the hypervisor stalled says nothing about Watcher.
    typical_s = statistics.median(r["ns"] for r in steps) / 1e9 if steps else 0.05
    min_steps = max(5, int(window_s / typical_s / 3))
    hz = os.sysconf("SC_CLK_TCK")
    for i, pair in enumerate(windows):
        off = window_median_ms(steps, *pair["off"], min_steps=min_steps)
        on = window_median_ms(steps, *pair["on"], min_steps=min_steps)
        if off is None or on is None:
            continue
        ratios.append(on / off)
        off_ms.append(off)
        on_ms.append(on)
        # A pair in which the hypervisor took under 1% of the machine in both windows.
        if max(steal[i].values()) < 0.01 * window_s * hz * os.cpu_count():
            calm.append(on / off)
    blocks = [statistics.median(ratios[i:i + BLOCK]) for i in range(0, len(ratios) - BLOCK + 1, BLOCK)]
    for b, m in enumerate(blocks):
        print(f"block {b + 1}/{len(blocks)} ({BLOCK} window pairs): median ratio {m:.3f}", file=sys.stderr, flush=True)
    # Watcher's own time inside the ranks (hooks, checksums, capture), logged
    # per step by the runtime: what it costs, free of the machine's drift.
    logged = runtime_steps(run_dir)
    own = [fp["watcher_us"] / (fp["dur"] / 1000) for fp in logged
           if fp.get("watcher_us") is not None and fp.get("dur") and not fp.get("snapshot")]
    forks = [fp for fp in logged if fp.get("snapshot")]
    return {"pairs": len(ratios), "window_s": window_s, "toggle": toggle, "policy": policy, "batch": batch,
            "ratios": ratios,
            "steal_ticks": steal, "calm_pairs": len(calm),
            "calm_median_ratio": statistics.median(calm) if calm else None,
            "snapshots": len(forks), "state_copies": sum(1 for fp in logged if fp.get("state_copy_us")),
            "steps_on": len(logged), "snapshot_intervals": sorted({fp.get("snapshot_interval") for fp in forks}),
            "own_time_fraction_median": statistics.median(own) if own else None,
            "own_time_fraction_p90": statistics.quantiles(own, n=10)[-1] if len(own) > 10 else None,
            "median_ratio": statistics.median(ratios), "median_ci95": median_interval(ratios),
            **geometric_mean(ratios), "block_medians": blocks,
            "worst_block_ratio": max(blocks) if blocks else None, "worst_pair_ratio": max(ratios),
            "off_ms": off_ms, "on_ms": on_ms, "rank_pids": pids, "cpu_ratios": cpu_ratios,
            "cpu_median_ratio": statistics.median(cpu_ratios) if cpu_ratios else None,
            "cpu_worst_ratio": max(cpu_ratios) if cpu_ratios else None,
            "cpu_worst_block_ratio": max((statistics.median(cpu_ratios[i:i + BLOCK])
                                          for i in range(0, len(cpu_ratios) - BLOCK + 1, BLOCK)), default=None)}


def bench_overhead(tmp: Path, pairs: int, steps: int) -> dict:
    env_note = dict(os.environ, OMP_NUM_THREADS="1")
    ratios, plain_ms, watch_ms, intervals, forks = [], [], [], [], []
    for i in range(pairs):
        t_plain = tmp / f"plain{i}" / "t"
        t_plain.parent.mkdir()
        subprocess.run(job(steps, t_plain), check=True, cwd=ROOT, env=env_note,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run_dir = tmp / f"run{i}"
        t_watch = tmp / f"times{i}" / "t"
        t_watch.parent.mkdir()
        watcher_run(run_dir, job(steps, t_watch))
        p, w = steady_median_ms(t_plain), steady_median_ms(t_watch)
        plain_ms.append(p)
        watch_ms.append(w)
        ratios.append(w / p)
        snaps = [s for s in runtime_steps(run_dir) if s.get("snapshot")]
        forks += [s["fork_ms"] for s in snaps]
        intervals += [s.get("snapshot_interval") for s in snaps]
        print(f"pair {i}: plain {p:.2f} ms  watcher {w:.2f} ms  ratio {w / p:.3f}  snapshots {len(snaps)}",
              file=sys.stderr, flush=True)
    return {"pairs": pairs, "steps": steps, "ratios": ratios, "median_ratio": statistics.median(ratios),
            "worst_ratio": max(ratios), "best_ratio": min(ratios), "plain_ms": plain_ms, "watcher_ms": watch_ms,
            "default_snapshots_per_job": len(forks) / max(pairs, 1) / 2, "default_fork_ms": forks,
            "default_interval_after_first": [i for i in intervals if i]}


def bench_snapshots_and_replay(tmp: Path, steps: int) -> dict:
    run_dir = tmp / "snap"
    check = steps - 3
    watcher_run(run_dir, job(steps, tmp / "snap-times"), "--snapshot-interval", "8", "--replay-check", str(check))
    snaps = [s for s in runtime_steps(run_dir) if s.get("snapshot")]
    inc = json.loads((run_dir / "incidents" / "inc-0001.json").read_text())
    w = inc["window"]
    live_s = sum(s["dur"] for s in runtime_steps(run_dir)
                 if s["rank"] == 0 and w["from_step"] < s["step"] <= w["to_step"]) / 1e9
    replay_s = [inc["replay"]["per_rank"][r]["wall_s"] for r in sorted(inc["replay"]["per_rank"])]
    return {"fork_ms": [s["fork_ms"] for s in snaps],
            "median_fork_ms": statistics.median(s["fork_ms"] for s in snaps),
            "snapshot_private_mb": [s["prev_snapshot_private_mb"] for s in runtime_steps(run_dir)
                                if s.get("prev_snapshot_private_mb")],
            "replay_window": w, "replay_steps": w["to_step"] - w["from_step"], "replay_exact": inc["replay"]["exact"],
            "replay_wall_s": replay_s, "live_window_s": round(live_s, 3),
            "replay_over_live": round(max(replay_s) / live_s, 2) if live_s else None}


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4, help="separate-job pairs (end to end)")
    ap.add_argument("--window-pairs", type=int, default=120, help="on/off window pairs inside one job")
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", help="results file (default bench-results/run.json, or run-windows.json "
                    "with --windows-only)")
    ap.add_argument("--windows-only", action="store_true",
                    help="only the on/off windows inside one job (a quick comparison of two settings)")
    ap.add_argument("--toggle", choices=("all", "runtime", "recorder"), default="all",
                    help="what the 'off' windows switch off (default all of Watcher; runtime or recorder "
                    "alone split the overhead between them)")
    ap.add_argument("--policy", choices=POLICIES, help="watcher run --policy (default: watcher run's own)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the reference workload (one node; "
                    "`just bench scale` compares world sizes and 2 nodes side by side)")
    ap.add_argument("--batch", type=int, help="sequences per rank per step in the windows' job (default the "
                    "workload's 8; more makes steps longer with the same model and collectives)")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (the jobs' run directories and step "
                    "times), instead of a temporary directory")
    args = ap.parse_args()
    global RANKS
    RANKS = args.ranks
    if args.out is None:
        args.out = str(ROOT / "bench-results" / ("run-windows.json" if args.windows_only else "run.json"))
    with tempfile.TemporaryDirectory(prefix="watcher-bench-run-") as d:
        tmp = Path(args.keep) if args.keep else Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        win = bench_watcher_windows(tmp, args.window_pairs, args.window_s, toggle=args.toggle, policy=args.policy,
                                    batch=args.batch)
        if args.windows_only:
            Path(args.out).parent.mkdir(exist_ok=True)
            Path(args.out).write_text(json.dumps({"watcher_windows": win}, indent=1))
            print(json.dumps({k: v for k, v in win.items() if not isinstance(v, list)}, indent=1))
            return
        over = bench_overhead(tmp, args.pairs, args.steps)
        snap = bench_snapshots_and_replay(tmp, 64)
    result = {"watcher_windows": win, "overhead": over, "snapshots_and_replay": snap, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    rows = [
        ("Watcher on/off step time, median", f"{win['median_ratio']:.3f}",
         f"{win['pairs']} window pairs of {win['window_s']:g} s in one job, defaults; target <=1.05 worst, goal 1.02"),
        ("  its 95% interval (bootstrap)", "-" if not win["median_ci95"] else
         f"{win['median_ci95'][0]:.3f}-{win['median_ci95'][1]:.3f}", "pairs resampled"),
        ("Watcher on/off step time, geometric mean", _f(win["geo_mean_ratio"]),
         "-" if not win["geo_mean_ci95"] else
         f"95% interval {win['geo_mean_ci95'][0]:.3f}-{win['geo_mean_ci95'][1]:.3f}"),
        ("Watcher on/off step time, worst block", _f(win["worst_block_ratio"]),
         f"medians of blocks of {BLOCK} pairs: {', '.join(f'{b:.3f}' for b in win['block_medians'])}; "
         f"worst single pair {win['worst_pair_ratio']:.3f}"),
        ("Watcher on/off step time, median of calm pairs",
         f"{win['calm_median_ratio']:.3f}" if win["calm_median_ratio"] else "-",
         f"{win['calm_pairs']} pairs whose windows lost under 1% of the machine to the hypervisor (steal)"),
        ("Watcher on/off CPU per step, median", _f(win["cpu_median_ratio"]),
         f"ranks + collector, same windows; worst block {_f(win['cpu_worst_block_ratio'])}"),
        ("Watcher's own time / step time, median", _f(win["own_time_fraction_median"]),
         f"step.watcher_us over dur in the 'on' windows; p90 {_f(win['own_time_fraction_p90'])}"),
        ("snapshots / state copies in the 'on' windows", f"{win['snapshots']} / {win['state_copies']}",
         f"over {win['steps_on']} rank-steps; fork intervals {win['snapshot_intervals']}"),
        ("end-to-end ratio, median", f"{over['median_ratio']:.3f}", f"{args.pairs} pairs; target <=1.05, goal 1.02"),
        ("end-to-end ratio, worst", f"{over['worst_ratio']:.3f}", f"best {over['best_ratio']:.3f}; separate jobs"),
        ("plain step, median ms", f"{statistics.median(over['plain_ms']):.2f}", ""),
        ("snapshots per rank-job (default)", f"{over['default_snapshots_per_job']:.1f}",
         f"interval chosen {sorted(set(over['default_interval_after_first']))}"),
        ("fork ms, median", f"{snap['median_fork_ms']:.1f}", f"all {snap['fork_ms']}"),
        ("snapshot private MB / 8 steps", f"{statistics.median(snap['snapshot_private_mb'] or [0]):.1f}",
         "pages the rank rewrote since the fork"),
        ("replay wall s / live s", f"{max(snap['replay_wall_s']):.2f} / {snap['live_window_s']:.2f}",
         f"{snap['replay_steps']} steps, exact={snap['replay_exact']}"),
    ]
    print_table(rows, "note")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
