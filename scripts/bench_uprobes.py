"""`just bench uprobes`: what each library-probe family costs per hit, and the
reference workload's overhead with the default probe set.

Per-hit cost: a tight loop of one probed call, timed inside the process, run
plain and under `watcher record` alternately; cost = (recorded - plain) / N,
median over runs.  The loop starts only after the library is loaded and the
recorder had time to attach (the script sleeps after loading).

Prints a table and writes bench-results/uprobes.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = sysconfig.get_paths()["purelib"]
sys.path.insert(0, str(ROOT / "scripts"))

LOOP = textwrap.dedent("""
    import ctypes, os, sys, time
    kind, n = sys.argv[1], int(sys.argv[2])
    if kind == "cudart":
        lib = ctypes.CDLL(sys.argv[3]); out = ctypes.c_int()
        call = lambda: lib.cudaGetDeviceCount(ctypes.byref(out))
    elif kind == "nccl":
        lib = ctypes.CDLL(sys.argv[3]); out = ctypes.c_int()
        call = lambda: lib.ncclGetVersion(ctypes.byref(out))
    elif kind == "op":
        import torch
        a = torch.ones(1, 1)
        call = lambda: torch.mm(a, a)
    elif kind == "none":
        import torch
        a = torch.ones(1, 1)
        call = lambda: torch.mm(a, a)
    depth = int(os.environ.get("DEPTH", "0"))   # Python frames above the call (a training step's are ~20-30)
    if depth:
        inner = call
        def nest(k):
            return inner() if k == 0 else nest(k - 1)
        call = lambda: nest(depth)
    time.sleep(1.0)                     # the recorder attaches to what was just loaded
    for _ in range(1000):
        call()
    t = time.perf_counter_ns()
    for _ in range(n):
        call()
    print((time.perf_counter_ns() - t) / n)
""")

COLLECTIVE_LOOP = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    n = int(sys.argv[1])
    dist.init_process_group("gloo")
    t = torch.ones(1)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    s = time.perf_counter_ns()
    for _ in range(n):
        dist.all_reduce(t)
    if dist.get_rank() == 0:
        print((time.perf_counter_ns() - s) / n)
    dist.destroy_process_group()
""")


KERNEL_ONLY = ("--probes", "syscall,futex,proc,signal")


def run_loop(tmp: Path, argv: list[str], recorded: bool, extra: tuple[str, ...] = (), env=None) -> float:
    """One timed loop; `recorded` runs it under `watcher record` with `extra`
    options, and False with no recorder at all unless `extra` says otherwise."""
    cmd = [sys.executable, *argv]
    if recorded or extra:
        out = tmp / f"r{time.monotonic_ns()}.duckdb"
        cmd = [sys.executable, "-m", "watcher.cli", "record", "--out", str(out), *extra, "--", *cmd]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=None if env is None else {**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return float(res.stdout.strip().splitlines()[-1])


def per_hit(tmp: Path, argv: list[str], n: int, runs: int, extra=(), baseline=(), env=None) -> dict:
    """`baseline` options give the comparison run (default: no recorder); a
    loop that makes syscalls compares against the kernel probes alone, so the
    difference is the library probe's own cost."""
    plain, rec = [], []
    for i in range(runs):
        for recorded in ((False, True) if i % 2 == 0 else (True, False)):
            if recorded:
                rec.append(run_loop(tmp, argv, True, extra, env))
            else:
                plain.append(run_loop(tmp, argv, False, baseline, env))
    cost = statistics.median(r - p for r, p in zip(rec, plain)) / 1000
    return {"calls": n, "plain_ns": statistics.median(plain), "recorded_ns": statistics.median(rec),
            "cost_us_per_hit": cost}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=6, help="overhead pairs (see bench_recorder)")
    ap.add_argument("--only", help="one family: libcudart, pystacks, libnccl, ops, collectives, overhead")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "uprobes.json"))
    args = ap.parse_args()
    cudart = glob.glob(f"{SITE}/nvidia/cu*/lib/libcudart.so.*")
    nccl = glob.glob(f"{SITE}/nvidia/nccl/lib/libnccl.so.*")
    results = {}
    with tempfile.TemporaryDirectory(prefix="watcher-bench-") as d:
        tmp = Path(d)
        script = tmp / "loop.py"
        script.write_text(LOOP)
        coll = tmp / "coll.py"
        coll.write_text(COLLECTIVE_LOOP)
        want = lambda fam: args.only in (None, fam)  # noqa: E731
        if cudart and want("libcudart"):
            print("libcudart (cudaGetDeviceCount)...", file=sys.stderr)
            argv = [str(script), "cudart", "200000", cudart[0]]
            results["libcudart"] = per_hit(tmp, argv, 200000, args.runs)
        if cudart and want("pystacks"):
            # The Python stack read with each call: the same probe 24 frames deep, with and without.
            print("libcudart 24 Python frames deep, with and without stacks...", file=sys.stderr)
            argv = [str(script), "cudart", "100000", cudart[0]]
            results["libcudart_depth24"] = per_hit(tmp, argv, 100000, args.runs, env={"DEPTH": "24"})
            results["libcudart_depth24_no_stacks"] = per_hit(tmp, argv, 100000, args.runs, ("--no-py-stacks",),
                                                             env={"DEPTH": "24"})
        if nccl and want("libnccl"):
            print("libnccl (ncclGetVersion)...", file=sys.stderr)
            results["libnccl"] = per_hit(tmp, [str(script), "nccl", "200000", nccl[0]], 200000, args.runs)
        if want("ops"):
            print("libtorch operators (--ops mm)...", file=sys.stderr)
            results["ops"] = per_hit(tmp, [str(script), "op", "50000"], 50000, args.runs, ("--ops", "mm"))
        if want("collectives"):
            print("libtorch c10d collectives (2-rank gloo all_reduce)...", file=sys.stderr)
            results["collectives"] = per_hit(
                tmp, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(coll), "3000"],
                3000, args.runs, baseline=KERNEL_ONLY)
        if want("overhead"):
            print("reference workload, default probe set...", file=sys.stderr)
            from bench_recorder import bench_overhead

            results["overhead"] = bench_overhead(tmp, args.pairs, 4.0)
    rows = [(f"{fam}: cost per hit", f"{r['cost_us_per_hit']:.2f} us",
             f"(plain {r['plain_ns'] / 1000:.2f} us/call)")
            for fam, r in results.items() if fam != "overhead"]
    if "overhead" in results:
        ov = results["overhead"]
        rows.append(("reference workload: median step-time ratio", f"{ov['median_ratio']:.3f}",
                     f"target <= 1.03; pairs {[round(r, 3) for r in ov['ratios']]}"))
    from bench_recorder import print_table

    print_table(rows, "note")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.exists() and args.only else {}
    out.write_text(json.dumps({**old, **results, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
