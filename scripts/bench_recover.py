"""`just bench recover`: Track A recovery against checkpoint-restart, measured side by side.

The same job (the 2-rank reference workload, gloo, CPU) meets the same
transient fault at the same step, in rounds; the fault's step changes from
round to round (`--fault-steps`, spread over one default snapshot interval),
because where a fault lands relative to the last snapshot (or checkpoint)
decides how much either side recomputes:

- Watcher: `watcher run` (policy recover) with a gradient bit flip on rank 1
  at step F, twice: with default settings (adaptive snapshots at 1% of step
  time, so the replayed window is as long as the snapshot interval made it)
  and with a snapshot every N steps, the baseline's checkpoint interval.
  Detect-to-resume is from the detection to the end of the first step
  trained after recovery (both monotonic clocks of the ranks); it includes
  replaying the window.  Steps lost from the incident.
- Baseline: the job checkpoints every N steps (rank 0, torch.save); at step
  F rank 1 aborts, as a job that notices a NaN does, the launcher's job
  fails, and it is relaunched to resume from the newest checkpoint.
  Detect-to-resume is from the abort to the end of the first step trained
  after the relaunch; steps lost are the steps trained again.

A crash round (`--crash-pairs`) does the same for a rank killed from
outside (SIGKILL on rank 1 once it has logged step F):

- Watcher: `watcher run --rescue`; every rank resumes from its snapshot
  (default settings) while torchrun runs on.
- Baseline: the job checkpointing every N steps fails as torchrun tears it
  down, and is launched again at once (as a scheduler's requeue does): every
  worker starts again and reloads the newest checkpoint.  (torchrun's own
  `--max-restarts` hangs here: the restarted workers wait forever in
  init_process_group, torch 2.13 CPU with gloo; a relaunch costs about the
  same: process start, torch import, rendezvous, checkpoint load.)

Detect-to-resume there is from the kill to the end of the first step the
replacement rank 1 trains (the step-times file it keeps appending to, on
the same monotonic clock); steps recomputed are the steps trained again.

Prints a table and writes bench-results/recover.json.
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def job(steps: int, *extra: str) -> list[str]:
    return TORCHRUN + ["-m", "watcher.workloads.ddp_lm", f"--steps={steps}", *extra]


def step_ends(times: Path, rank: int = 0) -> list[dict]:
    p = Path(f"{times}.rank{rank}")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def watcher_once(tmp: Path, steps: int, fault_step: int, interval: int | None) -> dict:
    from watcher.run import RunConfig, run

    out = tmp / "run"
    t0 = time.monotonic()
    res = run(RunConfig(cmd=job(steps), out=out, inject={"scenario": "grad_bitflip", "rank": 1, "step": fault_step},
                        snapshot_interval=interval, quiet=True))
    wall = time.monotonic() - t0
    inc = res.incidents[0]
    from watcher.rundir import read_steps

    steps0 = read_steps(out, 0)
    resumed = inc["resumed_at_step"]
    end = steps0[resumed]["ts"]
    return {"exit_code": res.exit_code, "recovered": inc["recovered"], "steps_lost": inc["steps_lost"],
            "detected_step": inc["detected_step"], "window": inc["window"],
            "state_copy": (inc.get("replay") or {}).get("state_copy"),
            "copy_attempt": (inc.get("replay") or {}).get("copy_attempt"),
            "detect_to_resume_s": round((end - inc["detected_ts"]) / 1e9, 3),
            "recovery_phases_s": {"detect_to_merged": inc["recovery"]["detect_to_resume_s"],
                                  "halt_to_merged": inc["recovery"]["halt_to_resume_s"]},
            "job_wall_s": round(wall, 2)}


def baseline_once(tmp: Path, steps: int, fault_step: int, every: int) -> dict:
    ckpt = tmp / "ckpt"
    ckpt.mkdir(parents=True)
    times = tmp / "times"
    t0 = time.monotonic()
    first = subprocess.run(job(steps, f"--checkpoint={ckpt}", f"--checkpoint-every={every}",
                               f"--fail-at={fault_step}", f"--step-times={times}"),
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert first.returncode != 0, "the baseline job was meant to fail"
    failed_at = int((ckpt / "failed_at").read_text())
    restored = (fault_step + 1) // every * every  # the newest checkpoint before the failure
    relaunched = tmp / "times-relaunched"
    second = subprocess.run(job(steps, f"--checkpoint={ckpt}", f"--checkpoint-every={every}",
                                f"--step-times={relaunched}"),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert second.returncode == 0, "the relaunched baseline job failed"
    wall = time.monotonic() - t0
    after = step_ends(relaunched)
    assert after[0]["step"] == restored, f"resumed at step {after[0]['step']}, not {restored}"
    return {"restored_step": restored, "steps_lost": fault_step + 1 - restored,
            "detect_to_resume_s": round((after[0]["end"] - failed_at) / 1e9, 3), "job_wall_s": round(wall, 2)}


def _tagged_rank_pid(tag: str, rank: int) -> int | None:
    """A worker process of the baseline job: its environment carries the bench's tag and RANK."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"BENCH_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env \
                and f"LOCAL_RANK={rank}".encode() in env:
            return int(name)
    return None


def _kill_rank1_at(proc: subprocess.Popen, times: Path, step: int, pid_of) -> tuple[int, int]:
    """SIGKILL rank 1 once it has logged `step`; (monotonic ns of the kill, its last logged step)."""
    deadline = time.monotonic() + 120
    while True:
        done = step_ends(times, 1) if Path(f"{times}.rank1").exists() else []
        if done and done[-1]["step"] >= step:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled before rank 1 reached step {step}")
        time.sleep(0.002)
    pid = pid_of()
    t = time.monotonic_ns()
    os.kill(pid, signal.SIGKILL)
    return t, step_ends(times, 1)[-1]["step"]


def _after_kill(times: Path, t_kill: int, last: int) -> dict:
    """The replacement rank 1's first step: when it ended, and how far back it started."""
    after = [r for r in step_ends(times, 1) if r["end"] > t_kill]
    caught_up = next(r for r in after if r["step"] == last + 1)
    return {"detect_to_resume_s": round((after[0]["end"] - t_kill) / 1e9, 3), "resumed_step": after[0]["step"],
            "steps_recomputed": last + 1 - after[0]["step"],
            "back_to_step_s": round((caught_up["end"] - t_kill) / 1e9, 3)}


def crash_watcher_once(tmp: Path, steps: int, kill_step: int) -> dict:
    times, out = tmp / "times", tmp / "run"
    tmp.mkdir(parents=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "watcher.cli", "run", "--rescue", "--out", str(out), "--",
                             *job(steps, f"--step-times={times}")],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_kill, last = _kill_rank1_at(proc, times, kill_step,
                                  lambda: json.loads((out / "runtime" / "rank1.process.json").read_text())["pid"])
    assert proc.wait(timeout=600) == 0, "the rescued job failed"
    inc = json.loads(next((out / "incidents").glob("inc-*.json")).read_text())
    assert (inc["kind"], inc["classification"], inc["recovered"]) == ("crash", "transient", True), inc
    return dict(_after_kill(times, t_kill, last), killed_after_step=last, job_wall_s=round(time.monotonic() - t0, 2),
                rescue_s=inc["recovery"]["detect_to_resume_s"], from_step=inc["window"]["from_step"])


def crash_baseline_once(tmp: Path, steps: int, kill_step: int, every: int) -> dict:
    times, ckpt = tmp / "times", tmp / "ckpt"
    ckpt.mkdir(parents=True)
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    cmd = job(steps, f"--checkpoint={ckpt}", f"--checkpoint-every={every}", f"--step-times={times}")
    env = dict(os.environ, BENCH_TAG=tag)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    t_kill, last = _kill_rank1_at(proc, times, kill_step, lambda: _tagged_rank_pid(tag, 1))
    assert proc.wait(timeout=600) != 0, "the baseline job was meant to fail"
    again = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    assert again.returncode == 0, "the relaunched baseline job failed"
    return dict(_after_kill(times, t_kill, last), killed_after_step=last, job_wall_s=round(time.monotonic() - t0, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4, help="rounds; round i faults at fault-steps[i mod n]")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-steps", default="12,17,20,27",
                    help="steps the fault lands on, one per round in turn (default: early, middle and late in "
                         "the first default snapshot interval; 17 is the worst place for state copies every 4 or "
                         "8 steps, the newest usable one being 5 or 9 steps back)")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--crash-pairs", type=int, default=3, help="crash rounds (a rank killed from outside; 0: none)")
    ap.add_argument("--crash-job-steps", type=int, default=120, help="steps of the crash rounds' job")
    ap.add_argument("--kill-steps", default="35,47,58", help="steps after which rank 1 is killed, one per crash round")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "recover.json"))
    args = ap.parse_args()
    every = args.checkpoint_every
    try:
        faults = [int(x) for x in args.fault_steps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"bad --fault-steps {args.fault_steps!r}: use e.g. 12,20,27")
    if not faults or not all(2 <= f < args.steps - 2 for f in faults):
        ap.error(f"--fault-steps must lie in 2..{args.steps - 3}")
    try:
        kills = [int(x) for x in args.kill_steps.split(",") if x.strip()]
    except ValueError:
        ap.error(f"bad --kill-steps {args.kill_steps!r}: use e.g. 35,47")
    if args.crash_pairs and (not kills or not all(10 <= k < args.crash_job_steps - 20 for k in kills)):
        ap.error(f"--kill-steps must lie in 10..{args.crash_job_steps - 21}")
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    watch, matched, base = [], [], []
    with tempfile.TemporaryDirectory(prefix="watcher-bench-recover-") as d:
        for i in range(args.pairs):
            fault = faults[i % len(faults)]
            w = watcher_once(Path(d) / f"w{i}", args.steps, fault, None)
            m = watcher_once(Path(d) / f"m{i}", args.steps, fault, every)
            b = baseline_once(Path(d) / f"b{i}", args.steps, fault, every)
            for r in (w, m, b):
                r["fault_step"] = fault
            watch.append(w)
            matched.append(m)
            base.append(b)
            print(f"round {i + 1}/{args.pairs} (fault at step {fault}): watcher default {w['detect_to_resume_s']} s (window {w['window']}), "
                  f"snapshot every {every}: {m['detect_to_resume_s']} s; checkpoint-restart "
                  f"{b['detect_to_resume_s']} s ({b['steps_lost']} lost)", file=sys.stderr, flush=True)

        crash_w, crash_b = [], []
        for i in range(args.crash_pairs):
            k = kills[i % len(kills)]
            w = crash_watcher_once(Path(d) / f"cw{i}", args.crash_job_steps, k)
            b = crash_baseline_once(Path(d) / f"cb{i}", args.crash_job_steps, k, every)
            crash_w.append(w)
            crash_b.append(b)
            print(f"crash round {i + 1}/{args.crash_pairs} (rank 1 killed after step {w['killed_after_step']} / "
                  f"{b['killed_after_step']}): watcher --rescue {w['detect_to_resume_s']} s (from step {w['from_step']}), "
                  f"relaunch + checkpoint {b['detect_to_resume_s']} s", file=sys.stderr, flush=True)

    def med(rows, key="detect_to_resume_s"):
        return statistics.median(r[key] for r in rows)

    def ratio(rows):
        return statistics.median(r["detect_to_resume_s"] / b["detect_to_resume_s"] for r, b in zip(rows, base))

    def worst(rows):
        return max(r["detect_to_resume_s"] / b["detect_to_resume_s"] for r, b in zip(rows, base))

    result = {"pairs": args.pairs, "steps": args.steps, "fault_steps": faults, "checkpoint_every": every,
              "watcher_default": watch, "watcher_snapshot_every_n": matched, "checkpoint_restart": base,
              "median_detect_to_resume_s": {"watcher_default": med(watch), "watcher_snapshot_every_n": med(matched),
                                            "checkpoint_restart": med(base)},
              "median_ratio": {"watcher_default": ratio(watch), "watcher_snapshot_every_n": ratio(matched)},
              "worst_ratio": {"watcher_default": worst(watch), "watcher_snapshot_every_n": worst(matched)},
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    if crash_w:
        result["crash"] = {"job_steps": args.crash_job_steps, "kill_steps": kills, "watcher_rescue": crash_w,
                           "torchrun_restart": crash_b,
                           "median_detect_to_resume_s": {"watcher_rescue": med(crash_w),
                                                         "torchrun_restart": med(crash_b)},
                           "median_ratio": statistics.median(w["detect_to_resume_s"] / b["detect_to_resume_s"]
                                                             for w, b in zip(crash_w, crash_b))}
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    lost = lambda rows: str(sorted({r["steps_lost"] for r in rows}))  # noqa: E731
    rows = [
        ("detect-to-resume, median s", f"{med(watch):.2f}", f"{med(matched):.2f}", f"{med(base):.2f}",
         f"ratio to baseline {ratio(watch):.3f} / {ratio(matched):.3f} (goal < 0.10); worst round "
         f"{worst(watch):.3f} / {worst(matched):.3f}"),
        ("replayed window, steps", str(sorted({r["window"]["to_step"] - r["window"]["from_step"] for r in watch})),
         str(sorted({r["window"]["to_step"] - r["window"]["from_step"] for r in matched})), "-",
         "Watcher recomputes these in the replay"),
        ("steps lost", lost(watch), lost(matched), lost(base), f"faults at steps {faults}"),
        ("recovered", str(all(r["recovered"] for r in watch)), str(all(r["recovered"] for r in matched)),
         "relaunch", ""),
        ("job wall s, median", f"{med(watch, 'job_wall_s'):.1f}", f"{med(matched, 'job_wall_s'):.1f}",
         f"{med(base, 'job_wall_s'):.1f}", f"{args.steps} steps, one fault"),
    ]
    if crash_w:
        c = result["crash"]
        rows += [
            ("crash: detect-to-resume, median s", f"{med(crash_w):.2f}", "-", f"{med(crash_b):.2f}",
             f"rank 1 killed (SIGKILL); --rescue against a relaunch + checkpoint reload; ratio "
             f"{c['median_ratio']:.3f} (goal < 0.10)"),
            ("crash: steps recomputed", str(sorted({r["steps_recomputed"] for r in crash_w})), "-",
             str(sorted({r["steps_recomputed"] for r in crash_b})), f"killed after steps {kills}"),
            ("crash: back at the killed step, median s", f"{med(crash_w, 'back_to_step_s'):.2f}", "-",
             f"{med(crash_b, 'back_to_step_s'):.2f}", "from the kill to the end of the step rank 1 died in, "
             "trained again"),
        ]
    table = [("metric", "watcher (default)", f"watcher (snapshot/{every})", f"checkpoint/{every} restart",
              "note"), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    print()
    for r in table:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
