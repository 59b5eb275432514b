"""`watcher preflight` on real 2-rank torchrun jobs (gloo, CPU), each seeded
with one misconfiguration the test itself made: a memory limit (a cgroup the
test creates) the batch does not fit in, more threads than the CPUs, float16
with no scaler, ranks that build their models in different dtypes.  A healthy
job passes.  Preflight needs no privileges; only the cgroup does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
PRECISION = str(ROOT / "tests" / "workloads" / "precision.py")
TRY_STEPS = 10


def preflight(tmp: Path, *job: str, preexec=None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / "report.json"
    p = subprocess.run([sys.executable, "-m", "watcher.cli", "preflight", "--steps", str(TRY_STEPS),
                        "--out", str(tmp / "try"), "--json", str(out), "--", *job],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, preexec_fn=preexec)
    return p, (json.loads(out.read_text()) if out.exists() else {})


def by_check(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in report["findings"]:
        out.setdefault(f["check"], []).append(f)
    return out


def test_a_healthy_job_is_ready_and_stops_after_the_try(tmp_path):
    p, rep = preflight(tmp_path, *TORCHRUN, "-m", "watcher.workloads.ddp_lm", "--steps=200")
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["verdict"] == "ready"
    assert {f["severity"] for f in rep["findings"]} == {"ok"}, rep["findings"]
    assert sorted(r["rank"] for r in rep["ranks"]) == [0, 1]
    assert all(r["done"] and r["steps_done"] == TRY_STEPS and r["batch"] == 8 and r["threads"] == 1
               and r["param_dtypes"] == ["float32"] for r in rep["ranks"])
    assert all(r["peak_rss_mb"] > r["base_rss_mb"] > 0 for r in rep["ranks"])
    assert by_check(rep)["link"][0]["message"].startswith("allreduce of 4 MB")
    # The job stopped after the try: each rank logged exactly TRY_STEPS steps.
    for r in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / "try" / "runtime" / f"rank{r}.steps.jsonl").read_text().splitlines()]
        assert sorted(x["step"] for x in lines if "seq" not in x) == list(range(TRY_STEPS))
    assert "verdict: ready" in p.stdout


def test_more_threads_than_cpus_is_reported_with_the_thread_count_that_fits(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    p, rep = preflight(tmp_path, *TORCHRUN, "-m", "watcher.workloads.ddp_lm", "--steps=200", f"--threads={2 * cpus}")
    assert p.returncode == 0, p.stdout + p.stderr  # slow, not failing
    cpu = by_check(rep)["cpu"][0]
    assert cpu["severity"] == "warn"
    assert cpu["message"].startswith(f"2 ranks x {2 * cpus} threads on {cpus} CPUs")
    per = max(1, cpus // 2)
    assert cpu["fix"] == f"set OMP_NUM_THREADS={per} (or torch.set_num_threads({per})) in each rank"


def test_float16_without_a_scaler_is_reported(tmp_path):
    p, rep = preflight(tmp_path, *TORCHRUN, PRECISION, "--half")
    assert p.returncode == 0, p.stdout + p.stderr
    prec = by_check(rep)["precision"]
    assert [(f["severity"], f["fix"]) for f in prec] == \
        [("warn", "use torch.amp.GradScaler around the optimizer step, or bfloat16")]
    assert all(r["param_dtypes"] == ["float16"] and r["grad_scaler"] is False for r in rep["ranks"])


def test_ranks_that_disagree_on_dtypes_fail_the_preflight(tmp_path):
    p, rep = preflight(tmp_path, *TORCHRUN, PRECISION, "--rank1-dtype", "float64")
    assert p.returncode == 1, p.stdout + p.stderr
    assert rep["verdict"] == "fix before launch"
    prec = by_check(rep)["precision"]
    assert [f["severity"] for f in prec] == ["fail"]
    assert "(rank 0: float32, rank 1: float64)" in prec[0]["message"]
    assert "verdict: fix before launch (1 failing)" in p.stdout


def _memory_cgroup(limit_bytes: int) -> tuple[Path, Path]:
    """A memory cgroup of this test's own (v1 or v2) and the file a process joins it by."""
    name = f"watcher-test-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    if v1.is_dir():
        d = v1 / name
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
        return d, d / "cgroup.procs"
    d = Path("/sys/fs/cgroup") / name
    d.mkdir()
    (d / "memory.max").write_text(str(limit_bytes))
    (d / "memory.swap.max").write_text("0")
    return d, d / "cgroup.procs"


def test_a_batch_that_does_not_fit_the_memory_limit_fails_with_the_batch_that_does(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("making a cgroup needs root")
    limit_mb = 1400
    cg, procs = _memory_cgroup(limit_mb << 20)
    try:
        p, rep = preflight(tmp_path, *TORCHRUN, "-m", "watcher.workloads.ddp_lm", "--steps=200", "--batch=1024",
                           preexec=lambda: procs.write_text(str(os.getpid())))
    finally:
        try:
            cg.rmdir()
        except OSError:
            pass
    assert p.returncode == 1, p.stdout + p.stderr
    mem = by_check(rep)["memory"][0]
    assert mem["severity"] == "fail" and mem["message"].startswith("the OOM killer stopped the job")
    assert f"({limit_mb} MB for 2 ranks, cgroup {cg})" in mem["message"]
    fit = int(mem["fix"].split("at most ")[1].split()[0])
    assert 8 <= fit < 1024 and mem["fix"].endswith("per rank (now 1024)")
    assert rep["node"]["oom_kills"] >= 1


def test_a_command_that_is_not_there_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "watcher.cli", "preflight", "--", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "cannot start" in p.stderr
