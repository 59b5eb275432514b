"""`just bench agent`: the node agent's own cost, and what it costs the job.

One agent runs throughout.  It records only jobs whose command line holds
"agent-on", so the same reference job (2-rank DDP, gloo) runs recorded or not
by the name of its step-time file alone, in ABBA pairs.  Measured:

- the agent's CPU (share of one core) idle, with no job, over IDLE_S;
- its CPU while recording a job, and its resident memory (sampled every
  0.25 s, the in-memory ring included): the median while recording, the
  peak, and the peak of its anonymous part (the peak's file pages are
  libtorch's symbol table, mapped while the library probes are attached);
- the job's median step time recorded vs not (per-step wall times the
  workload writes itself), and the whole job's wall time.

Prints a table and writes bench-results/agent.json.
    python scripts/bench_agent.py [--pairs 3] [--steps 300] [--idle 30]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp: Path, label: str, steps: int) -> tuple[float, float]:
    """(median step s, wall s) of one reference job."""
    times = tmp / f"{label}-{time.monotonic_ns()}.steps"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "watcher.workloads.ddp_lm", f"--steps={steps}", f"--step-times={times}"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    per = []
    for r in (0, 1):
        lines = Path(f"{times}.rank{r}").read_text().splitlines()
        per += [json.loads(x)["ns"] / 1e9 for x in lines[5:]]  # the first steps warm up
    return statistics.median(per), wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--idle", type=float, default=30.0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "watcher.cli", "agent", "--root", str(tmp / "root"),
                              "--listen", f"127.0.0.1:{port}", "--match", "agent-on", "--quiet"], cwd=ROOT)
    peak = [0, 0]
    during: list[int] = []   # resident memory while a recorded job runs
    recording = threading.Event()
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                r = rss(agent.pid)
                peak[0] = max(peak[0], r)
                peak[1] = max(peak[1], rss(agent.pid, "RssAnon"))
                if recording.is_set():
                    during.append(r)
            except OSError:
                return
            stop.wait(0.25)

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or agent.poll() is not None:
                    sys.exit("the agent did not start")
                time.sleep(0.2)
        threading.Thread(target=sample, daemon=True).start()
        time.sleep(3)  # past its start-up
        c0, t0 = cpu_s(agent.pid), time.monotonic()
        time.sleep(a.idle)
        idle_share = (cpu_s(agent.pid) - c0) / (time.monotonic() - t0)
        idle_rss = rss(agent.pid)
        print(f"idle: {100 * idle_share:.2f}% of a core, {idle_rss / 2**20:.0f} MiB", file=sys.stderr)
        rows = []
        busy = []
        for i in range(a.pairs):
            for label in (("agent-off", "agent-on") if i % 2 == 0 else ("agent-on", "agent-off")):
                c0, t0 = cpu_s(agent.pid), time.monotonic()
                if label == "agent-on":
                    recording.set()
                step, wall = run_job(tmp, label, a.steps)
                recording.clear()
                share = (cpu_s(agent.pid) - c0) / (time.monotonic() - t0)
                if label == "agent-on":
                    busy.append(share)
                rows.append({"pair": i, "label": label, "median_step_s": step, "wall_s": wall,
                             "agent_cpu_share": share})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        m = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/jobs", timeout=5).read())
    finally:
        stop.set()
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
    ratios = [next(r["median_step_s"] for r in rows if r["pair"] == i and r["label"] == "agent-on") /
              next(r["median_step_s"] for r in rows if r["pair"] == i and r["label"] == "agent-off")
              for i in range(a.pairs)]
    walls = [next(r["wall_s"] for r in rows if r["pair"] == i and r["label"] == "agent-on") /
             next(r["wall_s"] for r in rows if r["pair"] == i and r["label"] == "agent-off")
             for i in range(a.pairs)]
    out = {"idle_cpu_share": idle_share, "idle_rss_bytes": idle_rss,
           "recording_cpu_share_median": statistics.median(busy), "peak_rss_bytes": peak[0],
           "peak_anon_bytes": peak[1], "recording_rss_median_bytes": statistics.median(during),
           "step_ratio_on_off_median": statistics.median(ratios), "step_ratios": ratios,
           "wall_ratio_on_off_median": statistics.median(walls), "jobs_seen": len(m), "runs": rows,
           "steps": a.steps, "pairs": a.pairs, "cpus": os.cpu_count()}
    print(f"\n{'measure':<44} {'value':>12}  goal")
    print(f"{'agent CPU, idle (share of one core)':<44} {100 * idle_share:>11.2f}%  <= 1%")
    print(f"{'agent CPU, recording a 2-rank job':<44} {100 * out['recording_cpu_share_median']:>11.1f}%")
    print(f"{'agent resident memory, idle':<44} {idle_rss / 2**20:>9.0f} MiB")
    print(f"{'agent resident memory, recording (median)':<44} {out['recording_rss_median_bytes'] / 2**20:>9.0f} MiB  <= 250 MiB")
    print(f"{'agent resident memory, peak':<44} {peak[0] / 2**20:>9.0f} MiB")
    print(f"{'agent anonymous memory, peak':<44} {peak[1] / 2**20:>9.0f} MiB")
    print(f"{'job median step, recorded / not (median)':<44} {out['step_ratio_on_off_median']:>12.3f}")
    print(f"{'job wall time, recorded / not (median)':<44} {out['wall_ratio_on_off_median']:>12.3f}")
    (ROOT / "bench-results").mkdir(exist_ok=True)
    (ROOT / "bench-results" / "agent.json").write_text(json.dumps(out, indent=1))
    print("wrote bench-results/agent.json")


if __name__ == "__main__":
    main()
