"""The measurement pause of `watcher run` (the control block's `paused` word,
used by `just bench run` for its on/off windows): while it is set the recorder
records nothing of the job, after it records again, and the recording says how
long it was paused."""

import subprocess
import sys
import textwrap
import time

from watcher.rundir import read_steps

from .conftest import ROOT, needs_bpf, query

pytestmark = needs_bpf

# Three phases of getppid, 100 / 50 / 30 calls; between phases the job waits
# for the test's file and says where it is with its own.
TARGET = textwrap.dedent("""
    import os, sys, time
    d = sys.argv[1]
    def phase(n, done, go):
        for _ in range(n):
            os.getppid()
        open(os.path.join(d, done), "w").close()
        while go and not os.path.exists(os.path.join(d, go)):
            time.sleep(0.01)
    phase(100, "a", "b")
    phase(50, "c", "d")
    phase(30, "e", None)
""")


def _wait_file(p, timeout=60):
    deadline = time.monotonic() + timeout
    while not p.exists():
        assert time.monotonic() < deadline, f"the job never wrote {p.name}"
        time.sleep(0.02)


def test_paused_recorder_misses_exactly_the_paused_phase(tmp_path):
    from watcher.runtime.control import PAUSE_RECORDER, Control

    out, sync = tmp_path / "run", tmp_path / "sync"
    sync.mkdir()
    w = subprocess.Popen([sys.executable, "-m", "watcher.cli", "run", "--out", str(out), "--",
                          sys.executable, "-c", TARGET, str(sync)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_file(sync / "a")
        ctl = Control(out / "runtime")
        ctl.paused = PAUSE_RECORDER  # the recorder's bit alone (`just bench run --toggle recorder`)
        time.sleep(1.0)  # the collector polls the word at least every 0.25 s
        (sync / "b").touch()
        _wait_file(sync / "c")
        ctl.paused = 0
        time.sleep(1.0)
        (sync / "d").touch()
        assert w.wait(120) == 0, w.stderr.read()
    finally:
        w.kill()
    [(n,)] = query(out / "recording.duckdb", "SELECT count(*) FROM syscall WHERE name = 'getppid'")
    assert n == 130  # 100 before the pause, 30 after; the 50 in between are not recorded
    meta = dict(query(out / "recording.duckdb", "SELECT key, value FROM meta"))
    assert 0.5 < float(meta["paused_s"]) < 30  # paused about 1 s; the collector follows within 0.25 s


def test_no_replay_crosses_a_pause(tmp_path):
    # Rank 0 pauses Watcher for steps 40..59 from inside the job.  The snapshot
    # at 32 has no record of those steps: replaying 33..62 from it would "find"
    # a divergence at step 40 that never happened, so it must not be offered.
    import json

    from .conftest import watcher

    run = tmp_path / "run"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "32", "--replay-check", "62", "--",
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(ROOT / "tests" / "workloads" / "pause_midway.py"))
    assert p.returncode == 0, p.stderr
    for r in (0, 1):
        logged = list(read_steps(run, r).values())
        missing = set(range(70)) - {fp["step"] for fp in logged}
        # The paused steps pass through unrecorded (rank 1 reads the word at its
        # own step ends, so its edges may fall one step either way).
        assert set(range(41, 59)) <= missing <= set(range(39, 60))
        assert [fp["step"] for fp in logged if fp.get("snapshot")] == [32, 64]  # snapshots go on after the pause
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert inc["window"]["from_step"] is None
    assert inc["replay"]["reason"] == "no snapshot before the failing step is held by every rank"


def test_no_audit_window_crosses_a_pause(tmp_path):
    # The background audit at a budget that fits every window it can (back to
    # back, 16 steps each) while rank 0 pauses Watcher for steps 40..59: a
    # window holding a paused step has no record of it to compare with, so it
    # is skipped, never judged (judged, it "departed" at the pause: an SDC
    # finding in a healthy job, seen in `just bench run`'s on/off windows).
    import json

    from .conftest import watcher

    run = tmp_path / "run"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "8", "--audit-budget", "1000", "--", sys.executable,
                "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(ROOT / "tests" / "workloads" / "pause_midway.py"), "--steps", "120")
    assert p.returncode == 0, p.stderr
    assert list((run / "incidents").glob("inc-*.json")) == [], p.stderr
    lines = []
    for r in (0, 1):
        lines += [json.loads(x) for x in (run / "runtime" / f"rank{r}.audits.jsonl").read_text().splitlines()]
    judged = [e for e in lines if e["status"] != "skipped"]
    assert all(e["status"] == "clean" for e in judged), judged
    # None judged holds a step of the pause (either rank's edges: 39..60) ...
    assert not [e for e in judged if e["from_step"] < 60 and e["to_step"] >= 39], judged
    # ... and windows were judged on both sides of it, on both ranks.
    for r in (0, 1):
        assert [e for e in judged if e["rank"] == r and e["to_step"] < 39], lines
        assert [e for e in judged if e["rank"] == r and e["from_step"] >= 60], lines
    assert any("ran paused" in (e.get("error") or "") for e in lines), lines
