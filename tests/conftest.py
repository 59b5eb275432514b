"""Shared fixtures.  Tests that load eBPF programs need root (or CAP_BPF and
CAP_PERFMON) and bcc; they skip with the reason only when those are absent.
CI runs as root, so there they run."""

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
