"""Always-on use: --max-size pruning, the --ring-minutes flight recorder, --live,
and several recordings queried as one database."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from .conftest import ROOT, needs_bpf, query, record, watcher

pytestmark = needs_bpf

# Four phases of getppid storms, 0.6 s apart, so pruning has a time span to cut.
PHASED_STORM = textwrap.dedent("""
    import os, time
    for phase in range(4):
        for _ in range(60_000):
            os.getppid()
        time.sleep(0.6)
""")



def _line_with(text: str, stream, max_lines: int = 50) -> str:
    """The first line of stream that contains text ('' if it never comes)."""
    for _ in range(max_lines):
        line = stream.readline()
        if not line or text in line:
            return line if line and text in line else ""
    return ""

def test_max_size_prunes_oldest_first_and_records_what_was_pruned(tmp_path, py):
    out = tmp_path / "capped.duckdb"
    proc = record(out, py, "-c", PHASED_STORM, extra=("--max-size", "1M"))
    assert proc.returncode == 0, proc.stderr
    [(kept,)] = query(out, "SELECT count(*) FROM syscall WHERE name = 'getppid'")
    [(count,)] = query(out, "SELECT sum(count) FROM syscall_stat WHERE name = 'getppid'")
    assert count == 240_000            # the exact counters are never pruned
    pruned = query(out, "SELECT table_name, before_ts, rows FROM prune WHERE table_name = 'syscall'")
    assert pruned, "nothing was pruned"
    assert kept + sum(r for _, _, r in pruned) >= 240_000
    assert kept < 240_000
    # oldest first: nothing left is older than the last cut
    [(oldest,)] = query(out, "SELECT min(ts) FROM syscall")
    assert oldest >= max(b for _, b, _ in pruned)
    assert dict(query(out, "SELECT key, value FROM meta"))["pruned_rows"] != "0"


def test_ring_mode_keeps_the_window_in_memory_and_dumps_on_sigusr1_and_exit(tmp_path, py):
    out = tmp_path / "ring.duckdb"
    script = textwrap.dedent("""
        import os, sys, time
        for _ in range(1000):
            os.getppid()
        print("ready", flush=True)
        sys.stdin.readline()
        for _ in range(2000):
            os.getppid()
    """)
    w = subprocess.Popen([sys.executable, "-m", "watcher.cli", "record", "--out", str(out),
                          "--ring-minutes", "5", "--", py, "-c", script], cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Probe notes (one line per library attached) may come first.
        assert _line_with("Recording", w.stderr)
        assert w.stdout.readline() == "ready\n"  # its first 1000 made
        time.sleep(1.0)
        assert not out.exists()          # nothing on disk until asked
        w.send_signal(signal.SIGUSR1)
        line = _line_with("Wrote the last 5 min", w.stderr)
        assert str(out) in line
        [(first,)] = query(out, "SELECT count(*) FROM syscall WHERE name = 'getppid'")
        assert first == 1000
        w.stdin.write("go\n")
        w.stdin.close()
        assert w.wait(60) == 0
        rest = w.stderr.read()
    finally:
        w.kill()
    dumps = sorted(tmp_path.glob("ring*.duckdb"))
    assert len(dumps) == 2, rest
    final = [d for d in dumps if d != out][0]
    [(total,)] = query(final, "SELECT count(*) FROM syscall WHERE name = 'getppid'")
    assert total == 3000
    assert (final.stat().st_mode & 0o777) == 0o600


def test_live_view_shows_rates_top_syscalls_and_drops(tmp_path, py):
    out = tmp_path / "live.duckdb"
    proc = record(out, py, "-c", "import os, time\nfor _ in range(3):\n    [os.getppid() for _ in range(20000)]\n    time.sleep(0.7)",
                  extra=("--live",))
    assert proc.returncode == 0, proc.stderr
    assert "watcher live" in proc.stderr
    assert "events  syscall" in proc.stderr
    assert "getppid" in proc.stderr and "drops" in proc.stderr


def test_several_recordings_query_as_one_database(tmp_path, py):
    a, b = tmp_path / "node0.duckdb", tmp_path / "node1.duckdb"
    assert record(a, py, "-c", "import os\nfor _ in range(111): os.getppid()").returncode == 0
    assert record(b, py, "-c", "import os\nfor _ in range(222): os.getppid()").returncode == 0
    res = watcher("sql", str(a), str(b),
                  "SELECT recording, count(*) AS n, count(DISTINCT upid) AS procs FROM syscall "
                  "WHERE name = 'getppid' GROUP BY recording ORDER BY recording", "--format", "json",
                  check=True)
    assert json.loads(res.stdout) == [{"recording": 0, "n": 111, "procs": 1},
                                      {"recording": 1, "n": 222, "procs": 1}]
    # joins through surrogate ids never mix the two recordings
    res = watcher("sql", str(a), str(b),
                  "SELECT count(*) FROM syscall s JOIN process p USING (upid) WHERE s.name = 'getppid'",
                  "--format", "csv", check=True)
    assert res.stdout.splitlines()[1] == "333"
    # and the directory holding them works too
    res = watcher("sql", str(tmp_path), "SELECT count(*) FROM process", "--format", "csv", check=True)
    assert res.stdout.splitlines()[1] == "2"
