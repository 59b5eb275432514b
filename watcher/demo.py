"""`watcher demo`: record the bundled reference workload (2-rank DDP over gloo
on CPU) and show what a recording answers."""

from __future__ import annotations

import sys
from pathlib import Path

from .query import format_rows, summarise
from .session import Session, SessionConfig
from .store import Recordings

SAMPLE_QUERY = """\
SELECT p.rank, s.name, count(*) AS calls, sum(s.dur) / 1e6 AS ms
FROM syscall s JOIN process p USING (upid)
WHERE p.rank IS NOT NULL
GROUP BY ALL ORDER BY ms DESC LIMIT 8"""


def reference_command(steps: int, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "watcher.workloads.ddp_lm", f"--steps={steps}"]


def run_demo(steps: int, out: Path) -> int:
    result = Session(SessionConfig(out=out)).record(reference_command(steps))
    with Recordings([result.out]) as recs:
        print(summarise(recs))
        print("Sample query: time in syscalls per rank\n")
        print(SAMPLE_QUERY + "\n")
        cols, rows = recs.query(SAMPLE_QUERY)
        print(format_rows(cols, rows, "table"))
    print(f"Query it yourself: watcher sql {result.out} \"SELECT * FROM top_syscall\"")
    return result.target_exit or 0
