"""The background SDC audit (watcher/runtime/audit.py) on real 2-rank torchrun
jobs: a bit flipped in one rank's gradient before its allreduce is averaged
into both replicas, so they agree and no detector fires; the audit's
re-execution of the window catches it.  Ground truth: the drill's own fault
(rank 1, step 10, bit 23), and runs of the same job without Watcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from watcher import health

from .conftest import ROOT, needs_bpf, query
from .test_run import plain, reference

# The lowest exponent bit: one gradient element doubled or halved.  The loss
# hardly moves, the replicas agree: silent.  Step 10 lies in the first window
# the drill budget orders (rank 0 orders it at the first step end, forking at
# step 2): later windows may leave gaps while the replays catch up.
FLIP = {"scenario": "grad_bitflip", "rank": 1, "step": 10, "bit": 23}
STEPS = 60
LONG = 150  # long enough for the replays (nice 19, on the two cores the ranks use) to catch up with training
# Above 100%: every window the audit can fit is audited (the budget a drill uses).
DRILL_BUDGET = 1000


def audited(tmp: Path, steps: int, budget: float, fault=None) -> subprocess.CompletedProcess:
    """`watcher run` through the library API (the only way to inject a drill fault)."""
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), snapshot_interval=4, copy_interval=0, "
            "audit_budget=a['budget'], inject=a['fault'], detect=a['detect'])); sys.exit(r.exit_code)")
    # At the drill budget the audits' forks and replays take CPU from the ranks
    # (2 cores, 2 ranks): the straggler report is off, it would name them.
    arg = json.dumps({"cmd": reference(tmp / "w.pt", steps), "out": str(tmp / "run"), "budget": budget,
                      "fault": fault, "detect": {"straggler": False}})
    return subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=900, cwd=ROOT)


def audit_lines(run: Path) -> list[dict]:
    lines = []
    for p in sorted((run / "runtime").glob("rank*.audits.jsonl")):
        lines += [json.loads(x) for x in p.read_text().splitlines()]
    return lines


def windows(lines: list[dict]) -> list[tuple[int, int]]:
    return sorted({(e["from_step"], e["to_step"]) for e in lines})


@pytest.fixture(scope="module")
def plain_hashes(tmp_path_factory) -> dict:
    out = {}
    for steps in (STEPS, LONG, 200):
        d = tmp_path_factory.mktemp(f"plain{steps}")
        plain(reference(d / "p.pt", steps), d)
        out[steps] = (d / "p.pt.sha256").read_text()
    return out


@needs_bpf
def test_without_the_audit_the_flip_goes_unseen(tmp_path, plain_hashes):
    p = audited(tmp_path, STEPS, 0, FLIP)
    assert p.returncode == 0, p.stderr
    assert list((tmp_path / "run" / "incidents").glob("inc-*.json")) == []
    assert audit_lines(tmp_path / "run") == []
    # ...and it changed the result: this is the corruption the audit is for.
    assert (tmp_path / "w.pt.sha256").read_text() != plain_hashes[STEPS]


@needs_bpf
def test_an_audit_catches_the_flip_and_the_run_ends_as_if_it_never_happened(tmp_path, plain_hashes):
    p = audited(tmp_path, LONG, DRILL_BUDGET, FLIP)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    assert (tmp_path / "w.pt.sha256").read_text() == plain_hashes[LONG]
    incs = [json.loads(x.read_text()) for x in sorted((run / "incidents").glob("inc-*.json"))]
    assert [(i["incident_id"], i["kind"]) for i in incs] == [("inc-0001", "sdc")]
    inc = incs[0]
    assert (inc["detected_step"], inc["classification"], inc["transient_cause"]) == (FLIP["step"], "transient", "bit_flip")
    div = inc["replay"]["first_divergence"]
    assert (div["rank"], div["step"], div["collective"]["op"], div["where"]) == (1, FLIP["step"], "allreduce", "compute")
    assert (inc["recovered"], inc["steps_lost"]) == (True, 0)
    found = inc["detail"]
    assert found["found_by"] == "audit" and found["window"][0] <= FLIP["step"] <= found["window"][1]
    assert found["device"]["kind"] == "cpu" and found["detected_after_steps"] >= found["window"][1] - FLIP["step"]
    # Both ranks re-executed the window of the finding, and both saw the flipped step depart from the record
    # (rank 1's own gradient, rank 0 the reduction it fed); every other window matched.
    lines = audit_lines(run)
    flagged = [e for e in lines if e["status"] == "mismatch"]
    assert sorted(e["rank"] for e in flagged) == [0, 1]
    assert {(e["from_step"] + 1, e["to_step"]) for e in flagged} == {tuple(found["window"])}
    assert all(e["mismatched_steps"][0] == FLIP["step"] for e in flagged)
    assert {e["status"] for e in lines} <= {"clean", "mismatch", "skipped"}
    summary = json.loads((run / "audit.json").read_text())
    assert (summary["mismatched"], summary["steps_run"], summary["ranks_audited"]) == (1, LONG, [0, 1])
    assert "1 departed from the record" in p.stderr
    # The device: the core rank 1 ran the flipped step on (its step line), entered in the health ledger.
    cpu = json.loads(next(x for x in (run / "runtime" / "rank1.steps.jsonl").read_text().splitlines()
                          if '"seq"' not in x and json.loads(x)["step"] == FLIP["step"]))["cpu"]
    assert div["device"] == health.cpu_device(cpu)
    assert query(run / "recording.duckdb", "SELECT device, rank, step, incident_id FROM health_event "
                 "WHERE kind = 'failure'") == [(div["device"], 1, FLIP["step"], "inc-0001")]


@needs_bpf
def test_a_healthy_job_audited_for_200_steps_has_no_mismatch(tmp_path, plain_hashes):
    p = audited(tmp_path, 200, DRILL_BUDGET)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    assert (tmp_path / "w.pt.sha256").read_text() == plain_hashes[200]  # the audits left training alone
    assert list((run / "incidents").glob("inc-*.json")) == []  # no finding, and no stall while the exit drained them
    lines = audit_lines(run)
    done = [e for e in lines if e["status"] != "skipped"]
    assert done and all(e["status"] == "clean" for e in done), [e for e in done if e["status"] != "clean"]
    ws = windows(done)
    # Every window re-executed on both ranks, every step of it, and no step twice.
    assert sorted((e["rank"], e["from_step"], e["to_step"]) for e in done) == \
        sorted((r, *w) for w in ws for r in (0, 1))
    assert all(e["steps"] == e["to_step"] - e["from_step"] for e in done)
    assert all(a[1] <= b[0] for a, b in zip(ws, ws[1:])), ws
    assert ws[-1][1] <= 199
    summary = json.loads((run / "audit.json").read_text())
    assert (summary["audits"] - summary["skipped"], summary["clean"], summary["mismatched"], summary["failed"]) == \
        (len(ws), len(ws), 0, 0)
    assert summary["steps_audited"] == sum(b - a for a, b in ws) and summary["steps_run"] == 200
    # The same account in the recording, for SQL.
    assert query(run / "recording.duckdb", "SELECT rank, from_step, to_step, steps FROM audit WHERE status = 'clean' "
                                           "ORDER BY ALL") == sorted((e["rank"], e["from_step"], e["to_step"], e["steps"])
                                                                     for e in done)
