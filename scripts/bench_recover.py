"""`just bench recover`: Track A recovery against checkpoint-restart, measured side by side.

The same job (the 2-rank reference workload, gloo, CPU) meets the same
transient fault at the same step, in alternating pairs:

- Watcher: `watcher run` with default settings (adaptive snapshots, policy
  recover); a gradient bit flip on rank 1 at step F.  Detect-to-resume is
  from the detection to the end of the first step trained after recovery
  (both monotonic clocks of the ranks); steps lost from the incident.
- Baseline: the job checkpoints every N steps (rank 0, torch.save); at step
  F rank 1 aborts, as a job that notices a NaN does, the launcher's job
  fails, and it is relaunched to resume from the newest checkpoint.
  Detect-to-resume is from the abort to the end of the first step trained
  after the relaunch; steps lost are the steps trained again.

Prints a table and writes bench-results/recover.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def job(steps: int, *extra: str) -> list[str]:
    return TORCHRUN + ["-m", "watcher.workloads.ddp_lm", f"--steps={steps}", *extra]


def step_ends(times: Path, rank: int = 0) -> list[dict]:
    p = Path(f"{times}.rank{rank}")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def watcher_once(tmp: Path, steps: int, fault_step: int) -> dict:
    from watcher.run import RunConfig, run

    out = tmp / "run"
    t0 = time.monotonic()
    res = run(RunConfig(cmd=job(steps), out=out, inject={"scenario": "grad_bitflip", "rank": 1, "step": fault_step},
                        quiet=True))
    wall = time.monotonic() - t0
    inc = res.incidents[0]
    from watcher.replay.coordinator import read_steps

    steps0 = read_steps(out, 0)
    resumed = inc["resumed_at_step"]
    end = steps0[resumed]["ts"]
    return {"exit_code": res.exit_code, "recovered": inc["recovered"], "steps_lost": inc["steps_lost"],
            "detected_step": inc["detected_step"], "window": inc["window"],
            "detect_to_resume_s": round((end - inc["detected_ts"]) / 1e9, 3),
            "recovery_phases_s": {"detect_to_merged": inc["recovery"]["detect_to_resume_s"],
                                  "halt_to_merged": inc["recovery"]["halt_to_resume_s"]},
            "job_wall_s": round(wall, 2)}


def baseline_once(tmp: Path, steps: int, fault_step: int, every: int) -> dict:
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    times = tmp / "times"
    t0 = time.monotonic()
    first = subprocess.run(job(steps, f"--checkpoint={ckpt}", f"--checkpoint-every={every}",
                               f"--fail-at={fault_step}", f"--step-times={times}"),
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert first.returncode != 0, "the baseline job was meant to fail"
    failed_at = int((ckpt / "failed_at").read_text())
    restored = (fault_step + 1) // every * every  # the newest checkpoint before the failure
    second = subprocess.run(job(steps, f"--checkpoint={ckpt}", f"--checkpoint-every={every}",
                                f"--step-times={times}"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert second.returncode == 0, "the relaunched baseline job failed"
    wall = time.monotonic() - t0
    after = [r for r in step_ends(times) if r["end"] > failed_at]
    return {"restored_step": restored, "steps_lost": fault_step + 1 - restored,
            "detect_to_resume_s": round((after[0]["end"] - failed_at) / 1e9, 3), "job_wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-step", type=int, default=27)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "recover.json"))
    args = ap.parse_args()
    watch, base = [], []
    with tempfile.TemporaryDirectory(prefix="watcher-bench-recover-") as d:
        for i in range(args.pairs):
            w = watcher_once(Path(d) / f"w{i}", args.steps, args.fault_step)
            b = baseline_once(Path(d) / f"b{i}", args.steps, args.fault_step, args.checkpoint_every)
            watch.append(w)
            base.append(b)
            print(f"pair {i + 1}/{args.pairs}: watcher {w['detect_to_resume_s']} s ({w['steps_lost']} lost)  "
                  f"checkpoint-restart {b['detect_to_resume_s']} s ({b['steps_lost']} lost)", file=sys.stderr,
                  flush=True)
    wm = statistics.median(w["detect_to_resume_s"] for w in watch)
    bm = statistics.median(b["detect_to_resume_s"] for b in base)
    ratios = [w["detect_to_resume_s"] / b["detect_to_resume_s"] for w, b in zip(watch, base)]
    result = {"pairs": args.pairs, "steps": args.steps, "fault_step": args.fault_step,
              "checkpoint_every": args.checkpoint_every, "watcher": watch, "checkpoint_restart": base,
              "median_detect_to_resume_s": {"watcher": wm, "checkpoint_restart": bm},
              "ratio_per_pair": ratios, "median_ratio": statistics.median(ratios),
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    rows = [
        ("detect-to-resume, median s", f"{wm:.2f}", f"{bm:.2f}", f"ratio {statistics.median(ratios):.3f} (goal < 0.10)"),
        ("steps lost", str(sorted({w['steps_lost'] for w in watch})), str(sorted({b['steps_lost'] for b in base})),
         f"fault at step {args.fault_step}, checkpoint every {args.checkpoint_every}"),
        ("recovered / bit-identical path", str(all(w["recovered"] for w in watch)), "relaunch", ""),
        ("job wall s, median", f"{statistics.median(w['job_wall_s'] for w in watch):.1f}",
         f"{statistics.median(b['job_wall_s'] for b in base):.1f}", f"{args.steps} steps"),
    ]
    table = [("metric", "watcher", "checkpoint-restart", "note"), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    print()
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
