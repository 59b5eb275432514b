"""The background SDC audit (watcher/runtime/audit.py) on real 2-rank torchrun
jobs: a bit flipped in one rank's gradient before its allreduce is averaged
into both replicas, so they agree and no detector fires; the audit's
re-execution of the window catches it.  Ground truth: the drill's own fault
(rank 1, step 20, bit 23), and runs of the same job without Watcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, needs_bpf
from .test_run import plain, reference

# The lowest exponent bit: one gradient element doubled or halved.  The loss
# hardly moves, the replicas agree: silent.
FLIP = {"scenario": "grad_bitflip", "rank": 1, "step": 20, "bit": 23}
STEPS = 60


def audited(tmp: Path, steps: int, budget: float, fault=None) -> subprocess.CompletedProcess:
    """`watcher run` through the library API (the only way to inject a drill fault)."""
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), snapshot_interval=4, copy_interval=0, "
            "audit_budget=a['budget'], inject=a['fault'])); sys.exit(r.exit_code)")
    arg = json.dumps({"cmd": reference(tmp / "w.pt", steps), "out": str(tmp / "run"), "budget": budget,
                      "fault": fault})
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
    for steps in (STEPS, 200):
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
    p = audited(tmp_path, STEPS, 100, FLIP)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    assert (tmp_path / "w.pt.sha256").read_text() == plain_hashes[STEPS]
    incs = sorted((run / "incidents").glob("inc-*.json"))
    assert [x.name for x in incs] == ["inc-0001.json"]
    inc = json.loads(incs[0].read_text())
    assert (inc["kind"], inc["detected_step"], inc["classification"], inc["transient_cause"]) == \
        ("sdc", 20, "transient", "bit_flip")
    div = inc["replay"]["first_divergence"]
    assert (div["rank"], div["step"], div["collective"]["op"], div["where"]) == (1, 20, "allreduce", "compute")
    assert (inc["recovered"], inc["steps_lost"]) == (True, 0)
    found = inc["detail"]
    assert found["found_by"] == "audit" and found["window"][0] <= 20 <= found["window"][1]
    # At this budget the windows before the finding follow each other with no gap.
    lines = audit_lines(run)
    before = [w for w in windows(lines) if w[1] <= found["window"][1]]
    assert before[0][0] == 4 and all(a[1] == b[0] for a, b in zip(before, before[1:])), before
    # Both ranks re-executed the finding's window; only it departed from the record.
    flagged = [e for e in lines if e["status"] == "mismatch"]
    assert sorted(e["rank"] for e in flagged) == [0, 1]
    assert {(e["from_step"], e["to_step"]) for e in flagged} == {(found["window"][0] - 1, found["window"][1])}
    assert all(e["mismatched_steps"] == [20] for e in flagged)
    summary = json.loads((run / "audit.json").read_text())
    assert (summary["mismatched"], summary["steps_run"]) == (1, STEPS)
    assert "1 departed from the record" in p.stderr


@needs_bpf
def test_a_healthy_job_audited_for_200_steps_has_no_mismatch(tmp_path, plain_hashes):
    p = audited(tmp_path, 200, 100)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "run"
    assert (tmp_path / "w.pt.sha256").read_text() == plain_hashes[200]  # the audits left training alone
    assert list((run / "incidents").glob("inc-*.json")) == []
    lines = audit_lines(run)
    assert lines and all(e["status"] == "clean" for e in lines), [e for e in lines if e["status"] != "clean"]
    ws = windows(lines)
    # Every window re-executed on both ranks, end to end, one after the other from the first snapshot.
    assert sorted((e["rank"], e["from_step"]) for e in lines) == sorted((r, w[0]) for w in ws for r in (0, 1))
    assert ws[0][0] == 4 and all(a[1] == b[0] for a, b in zip(ws, ws[1:])), ws
    assert all(e["steps"] == e["to_step"] - e["from_step"] for e in lines)
    summary = json.loads((run / "audit.json").read_text())
    assert (summary["audits"], summary["clean"], summary["mismatched"], summary["failed"]) == (len(ws), len(ws), 0, 0)
    assert summary["steps_audited"] == ws[-1][1] - 4 and summary["steps_run"] == 200
