"""`watcher attach` on a running process, and a SIGKILLed collector."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from .conftest import ROOT, needs_bpf, query, watcher

pytestmark = needs_bpf

# Waits for "go" on stdin, forks a child, and both do a known number of getppid.
TARGET = textwrap.dedent("""
    import os, sys
    sys.stdin.readline()
    pid = os.fork()
    n = 3000 if pid == 0 else 5000
    for _ in range(n):
        os.getppid()
    if pid == 0:
        os._exit(4)
    os.waitpid(pid, 0)
""")


def _start_watcher(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "watcher.cli", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _wait_for(stream, needle: str, timeout: float = 60) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        seen += line
        if needle in line:
            return seen
        if not line:
            break
    raise AssertionError(f"never saw {needle!r}; got {seen!r}")


def test_attach_records_process_and_future_children_then_ends_itself(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, text=True)
    out = tmp_path / "attach.duckdb"
    w = _start_watcher(["attach", "--pid", str(target.pid), "--out", str(out)])
    try:
        banner = _wait_for(w.stderr, "Ctrl-C to stop")
        assert f"Recording PID {target.pid}" in banner
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.wait(60) == 0
        # the target exiting ends the recording by itself
        assert w.wait(60) == 0
        summary = w.stderr.read()
        assert "Recorded" in summary and "0 dropped" in summary
    finally:
        target.kill()
        w.kill()
    rows = dict(query(out, "SELECT p.pid, count(*) FROM syscall s JOIN process p USING (upid) "
                           "WHERE s.name = 'getppid' GROUP BY p.pid"))
    child = [pid for pid in rows if pid != target.pid]
    assert rows[target.pid] == 5000
    assert len(child) == 1 and rows[child[0]] == 3000
    [(code,)] = query(out, f"SELECT exit_code FROM process WHERE pid = {child[0]}")
    assert code == 4
    assert dict(query(out, "SELECT key, value FROM meta"))["mode"] == "attach"


def test_sigkilled_collector_leaves_a_readable_recording_and_the_target_runs_on(tmp_path):
    done = tmp_path / "done"
    script = textwrap.dedent(f"""
        import os, time
        end = time.monotonic() + 4
        n = 0
        while time.monotonic() < end:
            os.getppid(); n += 1
            time.sleep(0.0005)
        open({str(done)!r}, "w").write(str(n))
    """)
    out = tmp_path / "killed.duckdb"
    w = _start_watcher(["record", "--out", str(out), "--", sys.executable, "-c", script],
                       start_new_session=True)
    _wait_for(w.stderr, "Recording")
    time.sleep(2.5)
    os.kill(w.pid, signal.SIGKILL)
    w.wait(10)
    # Fail open: the traced job is untouched and finishes its work.
    deadline = time.monotonic() + 30
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done.exists(), "the target did not survive the collector's death"
    # Readable, through watcher and directly, with at most the last flush lost.
    res = watcher("sql", str(out), "SELECT count(*) AS n FROM syscall WHERE name = 'getppid'",
                  "--format", "csv", check=True)
    n = int(res.stdout.splitlines()[1])
    assert n > 500
    info = watcher("info", str(out), check=True)
    assert "INCOMPLETE" in info.stdout


def test_sigterm_finalises_a_complete_recording(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", "import os, time\nwhile True:\n    os.getppid(); time.sleep(0.001)"])
    out = tmp_path / "term.duckdb"
    w = _start_watcher(["attach", "--pid", str(target.pid), "--out", str(out)])
    try:
        _wait_for(w.stderr, "Ctrl-C to stop")
        time.sleep(1.5)
        w.send_signal(signal.SIGTERM)
        assert w.wait(30) == 0
        assert "Recorded" in w.stderr.read()
        assert target.poll() is None          # the target is left running
    finally:
        target.kill()
        w.kill()
    meta = dict(query(out, "SELECT key, value FROM meta"))
    assert meta["complete"] == "true" and meta["interrupted"] == "true"
    [(n,)] = query(out, "SELECT count(*) FROM syscall WHERE name = 'getppid'")
    assert n > 100


def test_duration_ends_the_recording(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = tmp_path / "dur.duckdb"
    try:
        res = watcher("attach", "--pid", str(target.pid), "--out", str(out), "--duration", "1")
        assert res.returncode == 0, res.stderr
        assert target.poll() is None
    finally:
        target.kill()
    meta = dict(query(out, "SELECT key, value FROM meta"))
    assert 1.0 <= (int(meta["end_ts"]) - int(meta["start_ts"])) / 1e9 < 10


def test_target_exiting_during_attach(tmp_path):
    # Loading the probes takes longer than this target lives.
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.15)"])
    out = tmp_path / "gone.duckdb"
    res = watcher("attach", "--pid", str(target.pid), "--out", str(out))
    target.wait()
    assert res.returncode == 3, res.stderr
    assert res.stderr.strip().splitlines() == [f"watcher: pid {target.pid} exited during attach"] or \
        res.stderr.strip().startswith(f"watcher: no process with pid {target.pid}")
    assert not out.exists()


def test_sigterm_death_of_an_unreaped_process_is_recorded_as_sigterm(tmp_path):
    # The target's parent (this test) is not traced, so no wait4 is seen: the
    # status must come from the kernel's view of the signal, which turns a
    # fatal SIGTERM into SIGKILL for every thread.
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out = tmp_path / "term-target.duckdb"
    w = _start_watcher(["attach", "--pid", str(target.pid), "--out", str(out)])
    try:
        _wait_for(w.stderr, "Ctrl-C to stop")
        target.send_signal(signal.SIGTERM)
        assert target.wait(30) == -signal.SIGTERM
        assert w.wait(60) == 0
    finally:
        target.kill()
        w.kill()
    assert query(out, f"SELECT exit_code, exit_signal FROM process WHERE pid = {target.pid}") == [(None, 15)]
