"""Shared fixtures.  Tests that load eBPF programs need root (or CAP_BPF and
CAP_PERFMON) and bcc; they skip with the reason only when those are absent.
CI runs as root, so there they run, and with WATCHER_TESTS_NO_SKIP=1 (set by
.ci/run) any test that would skip fails instead: a machine that cannot run
a test never passes CI by skipping it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bpf_unavailable() -> str | None:
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable (run scripts/setup)"
    from watcher.errors import PermissionProblem
    from watcher.privileges import require_bpf_privileges

    try:
        require_bpf_privileges()
    except PermissionProblem as e:
        return f"no BPF privileges: {e}"
    return None


BPF_SKIP = _bpf_unavailable()
needs_bpf = pytest.mark.skipif(BPF_SKIP is not None, reason=BPF_SKIP or "")
NO_SKIP = os.environ.get("WATCHER_TESTS_NO_SKIP") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if NO_SKIP and rep.skipped and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"would skip, and WATCHER_TESTS_NO_SKIP=1 forbids it: {reason}"


def watcher(*args: str, timeout: float = 300, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run the real `watcher` CLI in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", "watcher.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"watcher {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def record(out: Path, *cmd: str, extra: tuple[str, ...] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    return watcher("record", "--out", str(out), *extra, "--", *cmd, timeout=timeout)


def query(path: Path, sql: str, params=None):
    """Read a finished recording directly with DuckDB (not through watcher)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


@pytest.fixture
def py() -> str:
    return sys.executable


# Every process a test starts inherits this mark, so whatever a module leaves
# running (a stopped snapshot, a rank of a job that went wrong) can be found
# afterwards: it is reported and killed before the next module starts, where
# it could only take CPU from, or otherwise disturb, tests that do not expect it.
SESSION_MARK = f"WATCHER_TEST_SESSION={os.getpid()}".encode()
os.environ["WATCHER_TEST_SESSION"] = str(os.getpid())


def _marked_processes() -> list[tuple[int, str, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if SESSION_MARK not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        found.append((int(entry), comm, cmd))
    return found


@pytest.fixture(autouse=True, scope="module")
def no_leftover_processes(request):
    yield
    import signal
    import time
    import warnings

    deadline = time.monotonic() + 5  # processes on their way out get a moment
    left = _marked_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _marked_processes()
    for pid, comm, cmd in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        # An orphaned snapshot (retained for `watcher diagnose`, or waiting
        # for a crash replay) outlives its run by design: not worth a warning.
        if not comm.startswith("w-snap-"):
            warnings.warn(f"{request.module.__name__} left pid {pid} running ({cmd[:200]}); killed it")
