"""`watcher demo`: `watcher run` on the bundled reference workload (2-rank DDP
over gloo on CPU), with a replay check near the end, then what the recording
answers."""

from __future__ import annotations

import sys
from pathlib import Path

from .query import format_rows, summarise
from .run import RunConfig, run
from .store import Recordings

SAMPLE_QUERY = """\
SELECT s.rank, count(*) AS steps, round(min(s.loss), 3) AS best_loss,
       round(median(s.dur) / 1e6, 1) AS median_step_ms, count(*) FILTER (WHERE s.snapshot) AS snapshots,
       (SELECT count(*) FROM collective_io c WHERE c.rank = s.rank) AS collectives
FROM step s GROUP BY 1 ORDER BY 1"""


def reference_command(steps: int, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "watcher.workloads.ddp_lm", f"--steps={steps}"]


def run_demo(steps: int, out: Path) -> int:
    result = run(RunConfig(cmd=reference_command(steps), out=out, policy="observe",
                           replay_check=max(steps - 3, 1)))
    rec = result.recording
    with Recordings([rec]) as recs:
        print(summarise(recs))
        print("Per rank, from the runtime's step capture:\n")
        print(SAMPLE_QUERY + "\n")
        cols, rows = recs.query(SAMPLE_QUERY)
        print(format_rows(cols, rows, "table"))
    print(f"Query it yourself: watcher sql {rec} \"SELECT * FROM incident\"")
    return result.exit_code
