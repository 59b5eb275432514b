"""An incident reads the ranks' step logs back only as far as it needs: a long
run's whole history would take seconds to parse on the recovery's critical
path.  Ground truth: a log the test writes, with a recovery's re-logged steps
and a torn last line."""

from __future__ import annotations

import json

from watcher.rundir import read_steps


def write_log(run_dir, steps: int) -> None:
    (run_dir / "runtime").mkdir()
    with open(run_dir / "runtime" / "rank0.steps.jsonl", "w") as f:
        for k in range(steps):
            f.write(json.dumps({"step": k, "loss": float(k), "pad": "x" * 300}) + "\n")
        for k in range(steps - 10, steps - 5):  # a recovery logs its replayed steps again
            f.write(json.dumps({"step": k, "loss": -1.0, "recovered": True}) + "\n")
        f.write('{"step": 7')                    # a line still being written


def test_the_tail_holds_every_step_since_and_the_last_line_of_each(tmp_path):
    write_log(tmp_path, 60000)
    full = read_steps(tmp_path, 0)
    tail = read_steps(tmp_path, 0, since=59000)
    assert len(full) == 60000
    assert set(range(59000, 60000)) <= set(tail) and len(tail) < 5000
    assert all(tail[k] == full[k] for k in tail)
    assert tail[59992] == {"step": 59992, "loss": -1.0, "recovered": True}
    assert read_steps(tmp_path, 0, since=3) == full
    assert read_steps(tmp_path, 1, since=3) == {}
