"""A rank leaving right after its last collective exits as it would without Watcher.

Watcher records each collective when gloo's thread completes it, from a Python
callback.  If that thread still holds the callback when the interpreter
finalizes, it is ended inside C++ and the rank dies of SIGABRT ("terminate
called without an active exception").  The runtime waits at exit until gloo's
threads have let the callbacks go.  The race is rare under Watcher (its own
exit work usually covers it), so the workload exits the moment its last
collective completes, on 4 ranks, twice.  The runtime runs here without the
recorder: the race is between the rank's threads only.
"""

from __future__ import annotations

import subprocess
import sys

from watcher.rundir import read_colls

from .conftest import ROOT

WORKLOAD = str(ROOT / "tests" / "workloads" / "exit_after_collective.py")


def test_rank_exiting_right_after_its_last_collective_exits_zero(tmp_path):
    from watcher.run import RunConfig

    for launch in range(2):
        out = tmp_path / f"run{launch}"
        out.mkdir()
        env = RunConfig(cmd=[WORKLOAD], out=out).env()
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                            WORKLOAD], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "terminate called" not in p.stderr
        for rank in range(4):
            colls = list(read_colls(out, rank).values())
            # 3 steps x 2 gradient all_reduces, then the last one: logged at exit, under the step that never ended
            assert [(c["op"], c["step"]) for c in colls] == \
                [("allreduce", s) for s in (0, 0, 1, 1, 2, 2, 3)], colls
