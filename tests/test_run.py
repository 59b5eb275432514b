"""`watcher run` end to end: real torchrun and Lightning jobs (gloo, CPU), the real
recorder, real fork snapshots and sandboxed replays.  Ground truth is what the
jobs themselves produce: final-parameter hashes of runs without Watcher, exact
step and collective counts, bytes received on the job's own sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from watcher.rundir import read_steps

from .conftest import ROOT, needs_bpf, query, watcher

STEPS = 16
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
LIGHTNING = str(ROOT / "tests" / "workloads" / "lightning_train.py")
CANARY = str(ROOT / "tests" / "workloads" / "canary.py")


def reference(save: Path, steps: int = STEPS) -> list[str]:
    return TORCHRUN + ["-m", "watcher.workloads.ddp_lm", f"--steps={steps}", f"--save={save}"]


def plain(cmd: list[str], tmp: Path) -> None:
    """A baseline run without Watcher.  Torch's own gloo teardown can abort a
    plain process at interpreter exit (a gloo thread taking the GIL while the
    interpreter finalizes: SIGABRT, seen once in a Lightning baseline in the
    full suite), after its outputs are written: a baseline killed by a signal
    gets one more try, as it is not what these tests are about."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, cwd=tmp, env=env, timeout=300)
    if p.returncode < 0:
        p = subprocess.run(cmd, capture_output=True, cwd=tmp, env=env, timeout=300)
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd, p.stdout, p.stderr)


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("plain")
    plain(reference(d / "p.pt"), d)
    return (d / "p.pt.sha256").read_text()


@needs_bpf
def test_reference_job_is_bit_identical_and_fully_captured(tmp_path, plain_reference):
    run = tmp_path / "run"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "4", "--", *reference(tmp_path / "w.pt"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    rec = run / "recording.duckdb"
    # every rank, every step, once
    assert query(rec, "SELECT rank, count(*), min(step), max(step) FROM step GROUP BY 1 ORDER BY 1") == \
        [(0, STEPS, 0, STEPS - 1), (1, STEPS, 0, STEPS - 1)]
    # DDP replicas: identical parameter checksums on both ranks at every step
    assert query(rec, "SELECT count(DISTINCT step) FROM step GROUP BY step HAVING count(DISTINCT param_sum) > 1") == []
    # one gradient allreduce per step per rank (one bucket), numbered alike on both ranks
    per_step = query(rec, "SELECT rank, step, count(*) FROM collective_io WHERE op = 'allreduce' "
                          "GROUP BY ALL ORDER BY ALL")
    assert per_step == [(r, s, 1) for r in (0, 1) for s in range(STEPS)]
    # DDP issues them from autograd hooks: their Python call site is the training loop's backward()
    src = ROOT / "watcher" / "workloads" / "ddp_lm.py"
    backward = next(i + 1 for i, line in enumerate(src.read_text().splitlines()) if "loss.backward()" in line)
    assert query(rec, "SELECT DISTINCT site FROM collective_io WHERE op = 'allreduce'") == [(f"{src}:{backward}",)]
    mismatched = query(rec, "SELECT a.seq FROM collective_io a JOIN collective_io b USING (group_name, seq) "
                            "WHERE a.rank = 0 AND b.rank = 1 AND (a.op <> b.op OR a.out_sum <> b.out_sum)")
    assert mismatched == []
    # snapshots every 4 steps
    assert query(rec, "SELECT DISTINCT step FROM step WHERE snapshot ORDER BY 1") == [(4,), (8,), (12,)]
    assert query(rec, "SELECT count(*) FROM incident") == [(0,)]
    # what Watcher cost each step is in the record, and is part of the step (never more than all of it)
    assert query(rec, "SELECT count(*) FROM step WHERE watcher_us IS NULL OR watcher_us <= 0 "
                      "OR (dur IS NOT NULL AND watcher_us * 1000 > dur)") == [(0,)]
    shares = sorted(us * 1000 / dur for us, dur in query(rec, "SELECT watcher_us, dur FROM step WHERE dur > 0"))
    report = watcher("report", str(run), check=True).stdout.splitlines()
    assert report[:2] == [f"2 rank(s), {STEPS} steps, 0 incident(s)",
                          f"Watcher's own time in the ranks: {100 * shares[len(shares) // 2]:.1f}% of step time "
                          "(median over steps)"]


@needs_bpf
def test_replay_of_a_healthy_window_matches_the_record_exactly(tmp_path):
    run = tmp_path / "run"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "4", "--replay-check", "11", "--",
                *reference(tmp_path / "w.pt"))
    assert p.returncode == 0, p.stderr
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert inc["kind"] == "replay_check"
    assert inc["window"] == {"from_step": 4, "to_step": 11}
    assert inc["replay"]["exact"] is True
    for r in ("0", "1"):
        assert inc["replay"]["per_rank"][r]["status"] == "done"
        assert inc["replay"]["per_rank"][r]["steps"] == 7           # steps 5..11
        assert inc["replay"]["per_rank"][r]["collectives"] == 7     # one allreduce each
    assert "matched the record" in p.stderr
    assert "unclassified" not in p.stderr  # a check that passed is said to have passed
    # Watcher's own processes are named in the recording: the snapshots each
    # rank forked (released ones die of SIGKILL), and one replay per rank,
    # forked from a snapshot of that rank.
    rows = query(run / "recording.duckdb", "SELECT c.name, p.name, p.rank, c.exit_signal FROM process c "
                 "JOIN process p ON c.parent_upid = p.upid WHERE c.name LIKE 'w-%' ORDER BY 1")
    snaps = [(n, r, sig) for n, _, r, sig in rows if n.startswith("w-snap-")]
    replays = [(n, parent) for n, parent, _, _ in rows if n.startswith("w-replay-")]
    assert all(n == f"w-snap-{r}" for n, r, _ in snaps) and {r for _, r, _ in snaps} == {0, 1}
    assert any(sig == signal.SIGKILL for _, _, sig in snaps)
    assert sorted(replays) == [("w-replay-0", "w-snap-0"), ("w-replay-1", "w-snap-1")]
    info = watcher("info", str(run / "recording.duckdb")).stdout
    assert "replay 0" in info and "replay 1" in info and "released" in info


@needs_bpf
def test_lightning_ddp_is_bit_identical_and_replays_exactly(tmp_path):
    plain([sys.executable, LIGHTNING, "--steps", "20", "--save", str(tmp_path / "plain.sha")], tmp_path)
    run = tmp_path / "run"
    log = tmp_path / "metrics"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "4", "--replay-check", "13", "--",
                sys.executable, LIGHTNING, "--steps", "20", "--save", str(tmp_path / "w.sha"), "--log", str(log))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.sha").read_text() == (tmp_path / "plain.sha").read_text()
    rec = run / "recording.duckdb"
    assert query(rec, "SELECT rank, count(*) FROM step GROUP BY 1 ORDER BY 1") == [(0, 20), (1, 20)]
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert inc["replay"]["exact"] is True and inc["window"] == {"from_step": 8, "to_step": 13}
    # the replay re-ran the user's logging code, and none of it reached the file
    for r in (0, 1):
        assert len(Path(f"{log}.rank{r}").read_text().splitlines()) == 20
    assert query(rec, "SELECT rank, count(*) FROM sandbox_event WHERE syscall = 'write' AND action = 'swallowed' "
                      "GROUP BY 1 ORDER BY 1") == [(0, 5), (1, 5)]


@needs_bpf
def test_sandbox_canary_live_job_receives_nothing_from_a_replay(tmp_path):
    run = tmp_path / "run"
    result = tmp_path / "canary.json"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "4", "--replay-check", "11", "--",
                sys.executable, CANARY, "--steps", "16", "--out", str(result))
    assert p.returncode == 0, p.stderr
    got = json.loads(result.read_text())
    # exactly the live steps' traffic: 8 bytes, one line, one connection per step
    assert got == {"bytes": 16 * 8, "lines": 16, "connections": 16, "steps": 16}
    rows = query(run / "recording.duckdb",
                 "SELECT syscall, action, count(*) FROM sandbox_event GROUP BY ALL ORDER BY ALL")
    assert rows == [("sendto", "swallowed", 7), ("socket", "denied", 7), ("write", "swallowed", 7)]


@needs_bpf
def test_exception_inside_a_watcher_hook_leaves_training_correct(tmp_path, plain_reference):
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True,
                        inject={"scenario": "runtime_bug", "rank": 1, "step": 5}))
    assert res.exit_code == 0
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    err = (tmp_path / "run" / "runtime" / "rank1.error").read_text()
    assert "injected failure inside a Watcher hook" in err
    rec = tmp_path / "run" / "recording.duckdb"
    # rank 1 stopped capturing at the failing step; rank 0 went on
    assert query(rec, "SELECT rank, count(*) FROM step GROUP BY 1 ORDER BY 1") == [(0, STEPS), (1, 5)]


@needs_bpf
def test_killed_watcher_leaves_training_running_to_a_correct_finish(tmp_path, plain_reference):
    run = tmp_path / "killed-run"
    started = time.time() - 1
    cmd = [sys.executable, "-m", "watcher.cli", "run", "--out", str(run), "--snapshot-interval", "4", "--",
           *reference(tmp_path / "w.pt", steps=40)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps_log = run / "runtime" / "rank0.steps.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not steps_log.exists() or len(read_steps(run, 0)) < 5):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    sha = tmp_path / "w.pt.sha256"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not sha.exists():
        time.sleep(0.5)
    plain_40 = tmp_path / "plain"
    plain_40.mkdir()
    plain(reference(plain_40 / "p.pt", steps=40), plain_40)
    assert sha.read_text() == (plain_40 / "p.pt.sha256").read_text()
    assert sorted(read_steps(run, 0)) == list(range(40))  # the runtime kept recording without the collector
    # Nobody was left to clean up the tmpfs window directory; the ranks freed it at exit.
    leftovers = [d for d in Path("/dev/shm").glob(f"watcher-window-{run.name}-*") if d.stat().st_mtime >= started]
    assert leftovers == []


@needs_bpf
def test_drills_detect_localise_and_classify_every_scenario(tmp_path):
    out = tmp_path / "drills.json"
    # The persistent drills diagnosed by counterfactual replay are in test_diagnose.py.
    p = watcher("drill", "--steps", "22", "--out", str(tmp_path / "d"), "--json", str(out), "--scenario",
                "grad_bitflip,allreduce_corrupt,stall,link_reset,net_blackhole,merge_bitflip,two_transients,segv,"
                "long_stall,hang_pipe", timeout=1500)
    card = json.loads(out.read_text())["scenarios"]
    by = {row["scenario"]: row for row in card}
    assert set(by) == {"grad_bitflip", "allreduce_corrupt", "stall", "link_reset", "net_blackhole", "merge_bitflip",
                       "two_transients", "segv", "long_stall", "hang_pipe"}
    failed = [r for r in card if not r["pass"]]
    assert not failed, f"{failed}\n{p.stdout}\n{p.stderr[-3000:]}"
    assert p.returncode == 0
    assert by["grad_bitflip"]["localised"] == "rank 1 step 12 allreduce compute"
    assert by["allreduce_corrupt"]["localised"] == "rank 1 step 12 allreduce communication"
    assert by["stall"]["localised"] == "rank 1 step 12 allreduce"
    # Track A: every transient recovered in place, no step lost, and the final
    # parameters are bit-identical to the fault-free baseline run's.
    assert by["link_reset"]["detected"] == "collective_error@12"  # the transport was rebuilt and the allreduce retried
    assert by["net_blackhole"]["detected"] == "collective_error@12"  # aborted by the per-operation timeout
    for name in ("grad_bitflip", "allreduce_corrupt", "stall", "link_reset", "net_blackhole", "merge_bitflip",
                 "two_transients"):
        row = by[name]
        assert (row["classification"], row["recovered"], row["steps_lost"], row["bit_identical"], row["exit_code"]) \
            == ("transient", True, 0, True, 0), row
    assert by["two_transients"]["incidents"] == 2
    assert by["merge_bitflip"]["merge_retried"] is True  # the corrupted merge was caught and redone
    assert by["segv"]["classification"] == "persistent"
    # A 20-s stall is a report, and the run goes on; a hang that repeats in replay is persistent.
    assert (by["long_stall"]["localised"], by["long_stall"]["bit_identical"], by["long_stall"]["exit_code"]) == \
        ("rank 1 step 12 in clock_nanosleep", True, 0)
    assert (by["hang_pipe"]["classification"], by["hang_pipe"]["localised"]) == \
        ("persistent", "rank 1 step 12 outside collectives, in read")


def test_run_rejects_bad_input_with_one_line(tmp_path):
    cases = [
        (["run", "--policy", "sometimes", "--", "true"], 2, "unknown --policy"),
        (["run", "--snapshot-budget", "0", "--", "true"], 2, "--snapshot-budget"),
        (["run", "--retain", "-1", "--", "true"], 2, "--retain"),
        (["diagnose", "/nonexistent-run"], 6, "not a `watcher run` directory"),
        (["release", "/nonexistent-run"], 6, "not a `watcher run` directory"),
        (["run", "--detect", "nonsense=1", "--", "true"], 2, "unknown detector setting"),
        (["run", "--detect", "loss_spike_z", "--", "true"], 2, "KEY=VALUE"),
        (["drill", "--scenario", "meteor"], 2, "unknown scenario"),
    ]
    for args, code, text in cases:
        p = watcher(*args)
        assert p.returncode == code, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], (args, p.stderr)
    (tmp_path / "exists").mkdir()
    p = watcher("run", "--out", str(tmp_path / "exists"), "--", "true")
    assert p.returncode == 6 and "already exists" in p.stderr


@needs_bpf
def test_user_collectives_and_subgroups_are_captured_and_replayed(tmp_path):
    """No DDP: the user's own all_reduce on a new_group, broadcast and all_gather."""
    script = str(ROOT / "tests" / "workloads" / "subgroups.py")
    plain(TORCHRUN + [script, "--steps", "16", "--save", str(tmp_path / "plain.sha")], tmp_path)
    run = tmp_path / "run"
    p = watcher("run", "--out", str(run), "--snapshot-interval", "4", "--replay-check", "11", "--",
                *TORCHRUN, script, "--steps", "16", "--save", str(tmp_path / "w.sha"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.sha").read_text() == (tmp_path / "plain.sha").read_text()
    rec = run / "recording.duckdb"
    # per step and rank: 4 gradient all_reduces on the subgroup, 1 broadcast and 1 all_gather on the default group
    rows = query(rec, "SELECT rank, group_name = '0' AS default_group, op, count(*) FROM collective_io "
                      "WHERE step BETWEEN 1 AND 15 GROUP BY ALL ORDER BY ALL")
    assert rows == [(r, d, op, n * 15) for r in (0, 1)
                    for d, op, n in ((False, "allreduce", 4), (True, "allgather", 1), (True, "broadcast", 1))]
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert inc["replay"]["exact"] is True
    assert inc["replay"]["per_rank"]["0"]["collectives"] == 7 * 6
    # each collective links to the line of the user's code that issued it
    lines = Path(script).read_text().splitlines()
    where = {op: f"{script}:{next(i + 1 for i, l in enumerate(lines) if call in l)}"
             for op, call in (("allreduce", "dist.all_reduce(prm.grad"), ("broadcast", "dist.broadcast(scale"),
                              ("allgather", "dist.all_gather(losses"))}
    assert query(rec, "SELECT op, site, count(*) FROM collective_io WHERE step BETWEEN 1 AND 15 GROUP BY ALL "
                      "ORDER BY ALL") == sorted((op, site, n * 2 * 15) for op, site, n in
                                                (("allgather", where["allgather"], 1), ("allreduce", where["allreduce"], 4),
                                                 ("broadcast", where["broadcast"], 1)))


@needs_bpf
def test_incident_in_the_last_step_is_replayed_at_exit(tmp_path):
    """Detected at the final step: the halt step never comes, so the ranks
    handle the incident when the training loop is over, at exit."""
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt", steps=13), out=tmp_path / "run", quiet=True,
                        policy="recover", snapshot_interval=4,
                        inject={"scenario": "grad_bitflip", "rank": 1, "step": 12}))
    assert res.exit_code == 0  # at exit, the run is over anyway: nothing is stopped
    (inc,) = res.incidents
    assert inc["kind"] == "non_finite" and inc["detected_step"] == 12
    assert inc["classification"] == "transient" and inc["transient_cause"] == "bit_flip"
    d = inc["replay"]["first_divergence"]
    assert (d["rank"], d["step"], d["where"]) == (1, 12, "compute")


@needs_bpf
def test_a_crash_that_does_not_come_back_in_replay_is_transient(tmp_path):
    """SIGSEGV on rank 1 in the live run only: the replay of every rank from
    the last snapshot runs past the crash step, so the crash was transient;
    the launcher saw the rank die (--no-rescue: the death ends the job) and
    its peer did not wait for it."""
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True, snapshot_interval=4,
                        copy_interval=0, rescue=False, inject={"scenario": "segv_once", "rank": 1, "step": 12}))
    assert res.exit_code != 0
    (inc,) = res.incidents
    assert (inc["incident_id"], inc["kind"], inc["detected_rank"], inc["detected_step"]) == ("inc-0001", "crash", 1, 12)
    assert inc["detail"]["how"] == "signal SIGSEGV" and inc["classification"] == "transient"
    rep = inc["replay"]
    assert (rep["crashed_again"], rep["from_step"], rep["replayed_steps"]) == (False, 8, [9, 10, 11, 12])
    assert (rep["replay_site"], rep["same_site"]) == (None, None)  # the replay did not die
    assert json.loads((tmp_path / "run" / "runtime" / "rank1.process.json").read_text())["pid"] == inc["detail"]["pid"]
    assert inc["detail"]["crash_site"]["signal"] == "SIGSEGV" and inc["causal_chain"] is None


@needs_bpf
def test_a_native_crash_that_comes_back_is_persistent_with_its_site_in_the_chain(tmp_path):
    """Rank 1 writes through a null pointer in libc (ctypes.memset(0, ...)) at
    step 12, every time.  The live rank and its replay from the snapshot of
    step 8 both die of SIGSEGV at the same native instruction under the same
    Python line: persistent, one incident, and its causal chain (also in the
    recording's causal_link table) goes from the faulting native frame
    through the Python frames to the death.  (--no-rescue: with the rescue
    the same verdict comes after one rescue, tests/test_rescue.py.)"""
    import duckdb

    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True, snapshot_interval=4,
                        copy_interval=0, rescue=False, inject={"scenario": "segv", "rank": 1, "step": 12}))
    assert res.exit_code != 0
    (inc,) = res.incidents
    assert (inc["kind"], inc["detected_rank"], inc["detected_step"], inc["classification"]) == \
        ("crash", 1, 12, "persistent")
    site, rep = inc["detail"]["crash_site"], inc["replay"]
    assert (site["signal"], site["address"]) == ("SIGSEGV", "0x0")
    assert site["native"][0]["object"].startswith("libc.so")  # the write itself, inside libc
    assert (site["python"][0]["function"], Path(site["python"][1]["file"]).name, site["python"][1]["function"]) \
        == ("_null_write", "inject.py", "pre")
    assert (rep["crashed_again"], rep["replay_signal"], rep["same_site"], rep["from_step"]) == \
        (True, "SIGSEGV", True, 8)
    assert rep["replay_site"]["native"][0] == dict(site["native"][0], address=rep["replay_site"]["native"][0]["address"])
    assert (inc["attribution"]["cause"], inc["prescription"]["action"]) == ("software", "fix_kernel")
    assert inc["prescription"]["op"] == site["native"][0]["object"] + site["native"][0]["offset"]
    chain = inc["causal_chain"]
    assert [c["kind"] for c in chain] == ["native", "code", "code", "code", "detector"]
    assert chain[0]["op"].startswith("libc.so") and chain[1]["op"] == "_null_write"
    with duckdb.connect(str(tmp_path / "run" / "recording.duckdb"), read_only=True) as db:
        rows = db.execute("SELECT position, kind, op FROM causal_link WHERE incident_id = ? ORDER BY position",
                          [inc["incident_id"]]).fetchall()
    assert [(p, k) for p, k, _ in rows] == [(i, c["kind"]) for i, c in enumerate(chain)]


@needs_bpf
def test_a_rank_persistently_slower_than_its_peers_is_reported_as_a_straggler(tmp_path):
    """From step 10 rank 1 sleeps 100 ms in every step before computing, in a
    job of ~25-ms steps: both ranks' steps slow down alike, but rank 1's own
    time (outside collectives) is several times its peer's (with margin: on
    a busy 2-core machine a rank's compute alone can take 40 ms a step, and
    the threshold is 2x).  One straggler
    incident names rank 1 with that ratio; nothing halts, rank 0 is never
    named, and the run ends bit-identical to a fault-free run."""
    from watcher.run import RunConfig, run

    steps = 40
    plain(reference(tmp_path / "p.pt", steps=steps), tmp_path)
    res = run(RunConfig(cmd=reference(tmp_path / "w.pt", steps=steps), out=tmp_path / "run", quiet=True,
                        inject={"scenario": "slow_rank", "ms": 100, "rank": 1, "step": 10}))
    assert res.exit_code == 0
    assert (tmp_path / "w.pt.sha256").read_text() == (tmp_path / "p.pt.sha256").read_text()
    (inc,) = res.incidents
    assert (inc["kind"], inc["detected_rank"], inc["classification"]) == ("straggler", 1, None)
    assert 24 <= inc["detected_step"] <= 32  # two checks (every 8 steps) after the window turned slow
    d = inc["detail"]
    assert d["ratio"] >= 2.0 and 92.0 <= d["slower_by_ms"] <= 115.0  # the 100 ms of sleep a step, measured
    assert d["own_ms"] >= 100.0 and d["window_steps"] == 16
    assert inc["window"] == {"from_step": None, "to_step": None}  # nothing halted


@needs_bpf
def test_a_hang_that_repeats_in_replay_is_persistent_and_stops_the_job(tmp_path):
    """Rank 1 reads a pipe nobody writes to at step 12, every time: stuck
    outside any collective, its peer waiting inside one, so no rank ever
    reaches a halt step.  The stall is reported; past the hang limit the
    ranks' watchdogs handle the hang themselves: the replay from the snapshot
    blocks in the same read until its timeout (from the healthy steps), so
    the hang is persistent, rank 1 is named with its step and system call,
    the snapshot is kept for diagnosis, and the job is stopped, not left
    hanging."""
    from watcher.rundir import STOP_EXIT_CODE
    from watcher.run import RunConfig, run

    from watcher.store import rank_processes

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True, snapshot_interval=4,
                        detect={"hang_seconds": 3.0}, inject={"scenario": "hang_pipe", "rank": 1, "step": 12}))
    assert res.exit_code != 0
    assert {r["rank"]: r["exit_code"] for r in rank_processes(tmp_path / "run" / "recording.duckdb")} == \
        {0: STOP_EXIT_CODE, 1: STOP_EXIT_CODE}
    by_kind = {i["kind"]: i for i in res.incidents}
    assert sorted(by_kind) == ["hang", "stall"]
    stall = by_kind["stall"]
    assert (stall["detected_rank"], stall["detected_step"], stall["detail"]["where"]["syscall"]) == (1, 12, "read")
    inc = by_kind["hang"]
    assert (inc["classification"], inc["track"]) == ("persistent", "B")
    rep = inc["replay"]
    assert rep["reproduced"] is True and rep["per_rank"]["1"]["timed_out"] is True
    st = rep["stall"]
    assert (st["rank"], st["step"], st["outside_collective"], st["where"]["syscall"]) == (1, 12, True, "read")
    assert st["where"]["python"][0].split(" in ")[-1] == "_read_forever"
    assert inc["snapshot"]["retained"] is True and inc["window"]["from_step"] == 8
    steps = [read_steps(tmp_path / "run", r) for r in (0, 1)]
    assert (max(steps[0]), max(steps[1])) == (12, 11)  # stopped where they were stuck


@needs_bpf
def test_a_stalled_rank_is_reported_in_seconds_and_the_job_goes_on(tmp_path, plain_reference):
    """Rank 1 sleeps 20 s before a collective of step 12, in a job of ~25-ms
    steps: a stall incident names rank 1 and step 12 within seconds, where it
    waits (the Python line, the system call), nothing halts, and the run ends
    bit-identical to the fault-free one."""
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True,
                        inject={"scenario": "stall", "seconds": 20, "rank": 1, "step": 12}))
    assert res.exit_code == 0
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    (inc,) = res.incidents
    assert (inc["kind"], inc["detected_rank"], inc["detected_step"]) == ("stall", 1, 12)
    d = inc["detail"]
    assert 2.0 <= d["no_progress_s"] < 5.0  # the default limit: 2 s (10x a ~25-ms step is less)
    assert "ddp_lm.py" in d["where"]["training_line"]  # the training loop's line that issued it
    assert d["where"]["syscall"] == "clock_nanosleep"  # time.sleep, as the recording would show it
    assert "inject.py" in d["where"]["python"][0] and "in hook" in d["where"]["python"][0]
    assert d["resumed"] is True and 19.0 < d["stalled_s"] < 25.0
    assert inc["classification"] is None and inc["window"] == {"from_step": None, "to_step": None}  # nothing halted
    steps = query(tmp_path / "run" / "recording.duckdb", "SELECT rank, count(*) FROM step GROUP BY 1 ORDER BY 1")
    assert steps == [(0, STEPS), (1, STEPS)]
