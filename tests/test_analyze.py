"""`watcher analyze hang|crash` on real 2-rank gloo jobs with a known fault."""

import json
import os
import signal
import sys

from .conftest import ROOT, needs_bpf, query, record, watcher

pytestmark = needs_bpf

JOB = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
       str(ROOT / "tests" / "workloads" / "collectives.py"))


def _kill_tree(rec):
    for (pid,) in query(rec, "SELECT pid FROM process WHERE end_ts IS NULL"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_hang_names_the_rank_the_collective_and_where_it_is(tmp_path, monkeypatch):
    out = tmp_path / "hang.duckdb"
    # rank 1 sleeps instead of its 4th all_reduce; the recording ends while it does (with room for
    # a slow start on a loaded machine: the sleep outlasts the recording by far)
    monkeypatch.setenv("HANG_S", "40")
    proc = record(out, sys.executable, *JOB, "hang", extra=("--duration", "15"), timeout=600)
    try:
        assert proc.returncode == 0, proc.stderr
        res = watcher("analyze", "hang", str(out), "--format", "json", check=True)
        report = json.loads(res.stdout)
        first = report["first_disagreement"]
        assert (first["group_index"], first["seq"], first["missing"], first["issued_by"]) == (0, 3, [1], [0])
        assert first["ops"]["0"]["op"] == "allreduce"
        assert report["suspect_ranks"] == [1]
        r1 = report["ranks"]["1"]
        assert r1["alive"] and r1["last_collective"]["seq"] == 2
        # the line that issued it, from the Python stack read by the probe
        lines = (ROOT / "tests" / "workloads" / "collectives.py").read_text().splitlines()
        site = f"{ROOT / 'tests' / 'workloads' / 'collectives.py'}:{lines.index('        dist.all_reduce(t)') + 1} main"
        assert r1["last_collective"]["py_site"] == site
        main_thread = [b for b in r1["blocked_in"] if b["tid"] == r1["pid"]]
        assert main_thread and main_thread[0]["syscall"] == "clock_nanosleep"
        assert main_thread[0]["blocked_ns"] > 1e9
        text = watcher("analyze", "hang", str(out), check=True).stdout
        assert "ranks [1] never issued collective #3 (allreduce)" in text
        assert f"last collective: #2 allreduce group 0 (returned) issued at {site}" in text
    finally:
        _kill_tree(out)


def test_crash_names_the_signal_and_the_last_collective(tmp_path):
    out = tmp_path / "crash.duckdb"
    proc = record(out, sys.executable, *JOB, "crash", timeout=600)
    assert proc.returncode != 0        # torchrun reports the failed rank
    report = json.loads(watcher("analyze", "crash", str(out), "--format", "json", check=True).stdout)
    assert report["first_dead_rank"] == 1
    assert report["crashed"]["1"]["exit_signal"] == 11
    assert report["ranks"]["1"]["last_collective"]["seq"] == 2
    assert report["ranks"]["1"]["last_collective"]["op"] == "allreduce"
    script = ROOT / "tests" / "workloads" / "collectives.py"
    site = f"{script}:{script.read_text().splitlines().index('        dist.all_reduce(t)') + 1} main"
    text = watcher("analyze", "crash", str(out), check=True).stdout
    assert "rank 1" in text and f"died first, by signal 11, after collective #2 (allreduce issued at {site})" in text


def test_analyze_rejects_bad_input(tmp_path):
    res = watcher("analyze", "slow", str(tmp_path / "x.duckdb"))
    assert res.returncode == 2 and "unknown analysis 'slow'" in res.stderr
