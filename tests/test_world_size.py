"""Any world size on one node: replay, verdicts, Track A and Track B are as
exact at 3 and 4 ranks as at 2.  Ground truth: the faults the drills inject
(rank 1, step 12), fault-free runs of the same job, and a 3-rank window
replayed against its own record."""

from __future__ import annotations

import json
import sys

from .conftest import needs_bpf, watcher

STEPS = 45


@needs_bpf
def test_four_rank_drills_give_the_two_rank_verdicts(tmp_path):
    out = tmp_path / "drills.json"
    p = watcher("drill", "--ranks", "4", "--steps", "22", "--out", str(tmp_path / "d"), "--json", str(out),
                "--scenario", "grad_bitflip,allreduce_corrupt,bad_op", timeout=1500)
    card = json.loads(out.read_text())
    assert card["ranks"] == 4
    by = {row["scenario"]: row for row in card["scenarios"]}
    assert [r for r in card["scenarios"] if not r["pass"]] == [], p.stderr[-3000:]
    assert by["grad_bitflip"]["localised"] == "rank 1 step 12 allreduce compute"
    assert by["allreduce_corrupt"]["localised"] == "rank 1 step 12 allreduce communication"
    for name in ("grad_bitflip", "allreduce_corrupt"):
        row = by[name]
        # Recovered in place, and the 4-rank run ends bit-identical to the fault-free 4-rank run.
        assert (row["classification"], row["recovered"], row["steps_lost"], row["bit_identical"], row["exit_code"]) \
            == ("transient", True, 0, True, 0), row
    assert (by["bad_op"]["classification"], by["bad_op"]["attribution"]) == ("persistent", "software (fix_kernel)")
    assert by["bad_op"]["cause_named"] is True


@needs_bpf
def test_three_rank_replay_of_twenty_steps_matches_the_record_exactly(tmp_path):
    run = tmp_path / "run"
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
           "-m", "watcher.workloads.ddp_lm", f"--steps={STEPS}", f"--save={tmp_path / 'w.pt'}"]
    p = watcher("run", "--out", str(run), "--snapshot-interval", "20", "--copy-interval", "0",
                "--replay-check", "41", "--", *job, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    inc = json.loads((run / "incidents" / "inc-0001.json").read_text())
    assert inc["kind"] == "replay_check"
    assert inc["window"] == {"from_step": 20, "to_step": 41}
    assert inc["replay"]["exact"] is True and inc["replay"]["first_divergence"] is None
    assert sorted(inc["replay"]["per_rank"]) == ["0", "1", "2"]
    for r in ("0", "1", "2"):
        assert inc["replay"]["per_rank"][r]["status"] == "done"
        assert inc["replay"]["per_rank"][r]["steps"] == 21          # steps 21..41
        assert inc["replay"]["per_rank"][r]["collectives"] == 21    # one gradient allreduce a step
