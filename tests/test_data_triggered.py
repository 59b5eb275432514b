"""A software bug that only some data sets off (tests/workloads/masked_mean.py):
a masked mean over tokens divides 0/0 for the one sample whose mask is all
zeros.  The data is finite; the division is the bug; the sample its trigger.
Track B must say so (software: the op and its Python line, triggered by these
samples), prescribe guarding the op and skipping the samples meanwhile, and
under --policy apply skip them and finish the run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from .conftest import ROOT, needs_bpf, query, watcher
from .test_run import plain

WORKLOAD = ROOT / "tests" / "workloads" / "masked_mean.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKLOAD)]
# Rank 1 trains on samples 1, 3, 5, ... in batches of 8: sample 103 is row 3 of
# its batch at step 6, and again at step 22 (the next epoch).
BAD_SAMPLE, STEP, ROW = 103, 6, 3
DIVISION = next(i + 1 for i, line in enumerate(WORKLOAD.read_text().splitlines()) if line.strip().startswith("per_sample = "))


@needs_bpf
def test_a_division_the_data_sets_off_is_software_with_its_samples_skipped(tmp_path):
    plain(TORCHRUN + ["--zero-mask", str(BAD_SAMPLE), "--skip-empty", "--save", str(tmp_path / "plain.sha")], tmp_path)
    run = tmp_path / "run"
    p = watcher("run", "--out", str(run), "--policy", "apply", "--snapshot-interval", "4", "--copy-interval", "0",
                "--audit-budget", "0", "--", *TORCHRUN, "--zero-mask", str(BAD_SAMPLE),
                "--save", str(tmp_path / "w.sha"), timeout=600)
    assert p.returncode == 0, p.stderr
    [path] = sorted((run / "incidents").glob("inc-*.json"))
    inc = json.loads(path.read_text())
    assert (inc["kind"], inc["detected_step"], inc["classification"]) == ("non_finite", STEP, "persistent")
    assert inc["attribution"]["cause"] == "software"
    replays = inc["diagnosis"]["replays"]
    assert replays["drop_rows"]["clean"] and replays["swap_batch"]["clean"] and not replays["trace"]["clean"]
    assert not replays["lr_low"]["clean"] and not replays["float64"]["clean"]
    op, trigger = inc["causal_chain"][:2]
    assert (op["kind"], op["op"], op["rank"], op["step"]) == ("op", "aten::div.Tensor", 1, STEP)
    assert (op["line"]["file"], op["line"]["line"]) == (str(WORKLOAD), DIVISION)
    assert "turned finite inputs into 1 non-finite value(s), in the rows of rank 1 samples [3] only" in op["evidence"]
    assert (trigger["kind"], trigger["rank"], trigger["step"], trigger["samples"]) == ("batch", 1, STEP, [ROW])
    pre = inc["prescription"]
    [batch] = pre["batches"]
    digest = batch.pop("digests")
    assert batch == {"rank": 1, "step": STEP, "batch_index": STEP, "samples": [ROW]}
    assert (pre["action"], pre["verified_by"], pre["applied"]) == ("skip_batch", "drop_rows", True)
    assert (pre["fix"]["op"], pre["fix"]["line"]["line"]) == ("aten::div.Tensor", DIVISION)
    assert pre["fix"]["advice"].startswith("guard the division against a zero denominator")
    # Applied: the window's state without the sample merged, and the sample kept
    # out when it came back in the next epoch; the run is the one that never had it.
    assert (inc["recovered"], inc["steps_lost"]) == (True, 0)
    skipped = [json.loads(x) for x in (run / "runtime" / "rank1.skipped.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rows"], s["digests"]) for s in skipped] == [(STEP + 16, [ROW], digest)]
    assert (tmp_path / "w.sha").read_text() == (tmp_path / "plain.sha").read_text()
    assert query(run / "recording.duckdb", "SELECT attribution, prescription, prescription_applied FROM incident") == \
        [("software", "skip_batch", True)]
    # The reproducer runs without Watcher and shows the division's NaN.
    shutil.copytree(run / "incidents" / "inc-0001" / "diagnosis" / "reproducer", tmp_path / "repro")
    r = subprocess.run([sys.executable, "-I", str(tmp_path / "repro" / "repro.py")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "reproduced" in r.stdout and "aten::div.Tensor" in r.stdout, r.stdout + r.stderr
    # `watcher report` says what to fix, where.
    rep = watcher("report", str(run))
    assert f"fix aten::div.Tensor at {WORKLOAD}:{DIVISION}: guard the division" in rep.stdout
