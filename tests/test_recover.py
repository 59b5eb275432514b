"""Track A: a transient fault is recovered in place under `watcher run`'s
default policy.  The ground truth is a fault-free run of the same job: the
recovered run must end with bit-identical parameters, run every step exactly
once, in the same two rank processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, needs_bpf, query
from .test_run import LIGHTNING, STEPS, plain, plain_reference, reference  # noqa: F401 (fixture)

FAULT = {"scenario": "grad_bitflip", "rank": 1, "step": 9}
# The rank processes themselves: not their snapshots and replays (forks that inherit RANK).
RANK_PROCESSES = ("SELECT p.rank, p.pid, p.exit_code FROM process p LEFT JOIN process parent "
                  "ON parent.upid = p.parent_upid WHERE p.rank IS NOT NULL AND parent.rank IS NULL ORDER BY p.rank")


def run_with(tmp: Path, faults, *cmd: str, detect=None, snapshot_interval=4, copy_interval=0) -> subprocess.CompletedProcess:
    """`watcher run` with drill faults: only the library API injects them
    (the CLI never passes a stray WATCHER_INJECT on to a job).  Fixed
    intervals, so the test knows the window; no state copies unless asked."""
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), snapshot_interval=a['si'], "
            "copy_interval=a['ci'], inject=a['faults'], detect=a['detect'], quiet=True)); "
            "sys.exit(r.exit_code)")
    arg = json.dumps({"cmd": list(cmd), "out": str(tmp / "run"), "faults": faults, "detect": detect or {},
                      "si": snapshot_interval, "ci": copy_interval})
    return subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=600, cwd=ROOT)


@needs_bpf
def test_bitflip_recovers_in_place_with_no_step_lost(tmp_path, plain_reference):
    p = run_with(tmp_path, FAULT, *reference(tmp_path / "w.pt"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference  # as if the fault never happened
    run = tmp_path / "run"
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert (inc["kind"], inc["detected_step"], inc["classification"]) == ("non_finite", 9, "transient")
    assert inc["replay"]["first_divergence"]["rank"] == 1
    assert inc["replay"]["first_divergence"]["where"] == "compute"
    assert (inc["recovered"], inc["resumed_at_step"], inc["steps_lost"]) == (True, 11, 0)
    assert inc["window"] == {"from_step": 8, "to_step": 10}
    assert [m["tries"] for m in inc["recovery"]["merged"]] == [1, 1]
    rec = run / "recording.duckdb"
    # The same two rank processes from the first step to the last: nothing restarted.
    ranks = query(rec, RANK_PROCESSES)
    assert [(r, c) for r, _, c in ranks] == [(0, 0), (1, 0)]
    halted = {r: json.loads((run / "incidents" / "inc-0001" / f"arrive.rank{r}.json").read_text())["pid"]
              for r in (0, 1)}
    assert {r: pid for r, pid, _ in ranks} == halted
    # Every step exactly once per rank; the recovered steps carry the replayed values.
    assert query(rec, "SELECT rank, count(*), count(DISTINCT step), min(step), max(step) FROM step "
                      "GROUP BY 1 ORDER BY 1") == [(0, STEPS, STEPS, 0, STEPS - 1), (1, STEPS, STEPS, 0, STEPS - 1)]
    assert query(rec, "SELECT count(*) FROM step WHERE NOT isfinite(grad_norm) OR NOT isfinite(loss)") == [(0,)]
    assert query(rec, "SELECT recovered FROM incident") == [(True,)]
    # No checkpoint anywhere: the only state file of the job is its final save,
    # and the only model-state file any traced process opened (the recording's
    # file_open) outside Watcher's own run directory is that save.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "w.pt", "w.pt.sha256"]
    assert query(rec, f"SELECT path, writes, count(*) FROM file_open WHERE regexp_matches(path, "
                      f"'[.](pt|pth|ckpt|safetensors|bin)$') AND path NOT LIKE '{run}/%' "
                      f"AND path NOT LIKE '%/site-packages/%' GROUP BY ALL") == [(str(tmp_path / "w.pt"), True, 1)]


@needs_bpf
def test_a_fault_between_snapshots_is_replayed_from_the_newest_state_copy(tmp_path, plain_reference):
    # Forks at 8 and 16, state copies every 2 steps in between: the fault at
    # step 13 replays from the copy of step 10 (the newest with a step to
    # check it against before the failure), not from the fork at 8.
    p = run_with(tmp_path, dict(FAULT, step=13), *reference(tmp_path / "w.pt"), snapshot_interval=8,
                 copy_interval=2)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    run = tmp_path / "run"
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert (inc["classification"], inc["recovered"], inc["resumed_at_step"], inc["steps_lost"]) == \
        ("transient", True, 15, 0)
    assert inc["window"] == {"from_step": 10, "to_step": 14}
    assert inc["replay"]["state_copy"] == {"step": 10, "fork_step": 8}
    assert inc["replay"]["first_divergence"]["rank"] == 1 and inc["replay"]["first_divergence"]["step"] == 13
    assert inc["replay"]["per_rank"]["0"]["steps"] == 4  # steps 11..14
    assert json.loads((run / "incidents" / "inc-0001" / "plan.json").read_text())["state_copy"] == 10
    rec = run / "recording.duckdb"
    assert query(rec, "SELECT rank, count(DISTINCT step) FROM step GROUP BY 1 ORDER BY 1") == [(0, STEPS), (1, STEPS)]


@needs_bpf
def test_a_program_state_no_copy_carries_is_replayed_from_the_fork_instead(tmp_path):
    # The job scales its loss by its own loop counter, a local a state copy
    # does not hold: the copy's replay must be caught at its first step and
    # the window replayed from the fork, still recovering bit-identically.
    script = str(ROOT / "tests" / "workloads" / "loop_state.py")
    cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, "--steps=20"]
    plain([sys.executable, *cmd, f"--save={tmp_path / 'plain.sha'}"], tmp_path)
    p = run_with(tmp_path, dict(FAULT, step=13), sys.executable, *cmd, f"--save={tmp_path / 'w.sha'}",
                 snapshot_interval=8, copy_interval=2)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.sha").read_text() == (tmp_path / "plain.sha").read_text()
    inc = json.loads((tmp_path / "run" / "incidents" / "inc-0001.json").read_text())
    assert (inc["classification"], inc["recovered"], inc["steps_lost"]) == ("transient", True, 0)
    attempt = inc["replay"]["copy_attempt"]
    assert attempt["from_step"] == 10
    # Step 11, the first after the copy, already diverges: its gradients (the allreduce inputs) differ.
    assert attempt["rejected"] == "the first divergence is at step 11, the first step replayed from the copy"
    assert inc["window"] == {"from_step": 8, "to_step": 14}
    assert "state_copy" not in inc["replay"]


@needs_bpf
def test_a_merge_corrupted_twice_stops_cleanly_with_the_reason(tmp_path):
    faults = [FAULT, {"scenario": "merge_bitflip", "rank": 1, "step": 9, "times": 2}]
    p = run_with(tmp_path, faults, *reference(tmp_path / "w.pt"))
    assert p.returncode == 1, p.stderr  # torchrun's code for "a rank failed": both stopped by Watcher (75, below)
    inc = json.loads((tmp_path / "run" / "incidents" / "inc-0001.json").read_text())
    assert inc["classification"] == "transient" and inc["recovered"] is False
    assert inc["recovery"]["reason"].startswith("rank 1: merged parameters have checksum")
    assert [m["tries"] for m in inc["recovery"]["merged"]] == [1, 2]
    rec = tmp_path / "run" / "recording.duckdb"
    assert [(r, c) for r, _, c in query(rec, RANK_PROCESSES)] == [(0, 75), (1, 75)]
    assert not (tmp_path / "w.pt").exists()


@needs_bpf
def test_lightning_bitflip_recovers_bit_identically(tmp_path):
    plain([sys.executable, LIGHTNING, "--steps", "20", "--save", str(tmp_path / "plain.sha")], tmp_path)
    p = run_with(tmp_path, {"scenario": "grad_bitflip", "rank": 1, "step": 13},
                 sys.executable, LIGHTNING, "--steps", "20", "--save", str(tmp_path / "w.sha"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.sha").read_text() == (tmp_path / "plain.sha").read_text()
    inc = json.loads((tmp_path / "run" / "incidents" / "inc-0001.json").read_text())
    assert (inc["classification"], inc["recovered"], inc["steps_lost"]) == ("transient", True, 0)


@needs_bpf
def test_repeated_transients_on_one_rank_are_escalated_not_recovered_forever(tmp_path):
    faults = [FAULT, {"scenario": "grad_bitflip", "rank": 1, "step": 13}]
    p = run_with(tmp_path, faults, *reference(tmp_path / "w.pt"), detect={"transient_limit": 2})
    assert p.returncode == 1, p.stderr  # the second one stops the run (ranks exit 75)
    first, second = (json.loads((tmp_path / "run" / "incidents" / f"inc-000{i}.json").read_text()) for i in (1, 2))
    assert (first["detected_step"], first["classification"], first["recovered"]) == (9, "transient", True)
    assert (second["detected_step"], second["classification"], second["recovered"]) == (13, "persistent", False)
    assert second["replay"]["first_divergence"]["rank"] == 1
    assert second["escalated"]["rank"] == 1
    assert second["escalated"]["transients"] == ["inc-0001", "inc-0002"]
    assert "hardware suspect" in second["escalated"]["reason"]


@needs_bpf
def test_a_collective_stuck_on_a_silent_link_is_aborted_and_retried(tmp_path, plain_reference):
    """Every packet reaching rank 1's gloo connections is dropped from the
    step-9 allreduce on: nothing fails, both ranks wait inside it (gloo's own
    timeout is 30 min).  The per-operation timeout (2 s here) sees every
    member inside, aborts the collective on each rank, and the relink path
    rebuilds the transport and issues it again from the inputs as issued."""
    p = run_with(tmp_path, {"scenario": "net_blackhole", "rank": 1, "step": 9}, *reference(tmp_path / "w.pt"),
                 detect={"collective_timeout": 2.0})
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    incidents = sorted((tmp_path / "run" / "incidents").glob("inc-*.json"))
    # neither the hang detector (300 s) nor the stall report (the ranks waited inside a collective)
    assert len(incidents) == 1, [json.loads(f.read_text())["kind"] for f in incidents]
    inc = json.loads(incidents[0].read_text())
    assert (inc["kind"], inc["detected_step"], inc["classification"], inc["transient_cause"]) == \
        ("collective_error", 9, "transient", "communication")
    assert (inc["recovered"], inc["resumed_at_step"], inc["steps_lost"]) == (True, 9, 0)
    assert 2.0 <= inc["detail"]["stalled_s"] < 10
    assert "every member inside it" in inc["detail"]["error"]
    rec = tmp_path / "run" / "recording.duckdb"
    assert [(r, c) for r, _, c in query(rec, RANK_PROCESSES)] == [(0, 0), (1, 0)]  # the same pids, no restart
    assert query(rec, "SELECT count(*), count(DISTINCT out_sum) FROM collective_io WHERE op = 'allreduce' "
                      "AND step = 9") == [(2, 1)]


@needs_bpf
def test_a_reset_link_is_rebuilt_and_the_collective_retried(tmp_path, plain_reference):
    """The network drops rank 1's gloo connections before the step-9 allreduce:
    without Watcher both ranks raise and the job dies.  Watcher rebuilds the
    transport on the job's own store and retries; training never notices."""
    p = run_with(tmp_path, {"scenario": "link_reset", "rank": 1, "step": 9}, *reference(tmp_path / "w.pt"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    inc = json.loads((tmp_path / "run" / "incidents" / "inc-0001.json").read_text())
    assert (inc["kind"], inc["detected_step"], inc["classification"], inc["transient_cause"]) == \
        ("collective_error", 9, "transient", "communication")
    assert (inc["recovered"], inc["resumed_at_step"], inc["steps_lost"]) == (True, 9, 0)
    assert inc["recovery"]["collective"]["op"] == "allreduce"
    assert "Connection closed by peer" in inc["detail"]["error"]
    rec = tmp_path / "run" / "recording.duckdb"
    assert [(r, c) for r, _, c in query(rec, RANK_PROCESSES)] == [(0, 0), (1, 0)]
    assert query(rec, "SELECT rank, count(DISTINCT step) FROM step GROUP BY 1 ORDER BY 1") == [(0, STEPS), (1, STEPS)]
    # the retried allreduce is recorded once, with the same checksums on both ranks
    assert query(rec, "SELECT count(*), count(DISTINCT out_sum) FROM collective_io WHERE op = 'allreduce' "
                      "AND step = 9") == [(2, 1)]
