"""A real 2-rank torchrun job recorded end to end: every rank found, identified by
RANK, with the tree, exit codes and gloo traffic in the recording."""

import sys

from .conftest import needs_bpf, query, record

pytestmark = needs_bpf


def test_torchrun_job_records_every_rank(tmp_path):
    out = tmp_path / "ddp.duckdb"
    proc = record(out, sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node=2", "-m", "watcher.workloads.ddp_lm", "--steps=6", timeout=600)
    assert proc.returncode == 0, proc.stderr
    ranks = query(out, "SELECT rank, exit_code, parent_upid FROM process WHERE rank IS NOT NULL ORDER BY rank")
    assert [r[0] for r in ranks] == [0, 1]
    assert query(out, "SELECT rank, local_rank, world_size FROM process WHERE rank IS NOT NULL ORDER BY rank") \
        == [(0, 0, 2), (1, 1, 2)]
    assert all(code == 0 for _, code, _ in ranks)
    [(launcher_upid,)] = query(out, "SELECT upid FROM process WHERE parent_upid IS NULL OR upid = 0 ORDER BY upid LIMIT 1")
    assert {r[2] for r in ranks} == {launcher_upid}   # both ranks are children of torchrun
    # gloo talks over sockets: each rank's transport threads received with
    # recvfrom, every call counted (quick ones are counted, not logged) ...
    io = dict(query(out, "SELECT p.rank, sum(s.count) FROM syscall_stat s JOIN process p USING (upid) "
                         "WHERE p.rank IS NOT NULL AND s.name = 'recvfrom' GROUP BY p.rank"))
    assert io.get(0, 0) > 0 and io.get(1, 0) > 0
    # ... and sent with writev, every call logged
    io = dict(query(out, "SELECT p.rank, count(*) FROM syscall s JOIN process p USING (upid) "
                         "WHERE p.rank IS NOT NULL AND s.name = 'writev' GROUP BY p.rank"))
    assert io.get(0, 0) > 0 and io.get(1, 0) > 0
    [(drops,)] = query(out, "SELECT coalesce(sum(drops), 0) FROM ring_drop")
    assert drops == 0
