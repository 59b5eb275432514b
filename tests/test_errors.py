"""Every bad input: one line on stderr, a nonzero exit, nothing half-written."""

import os
import shutil
import subprocess
import sys

import duckdb
import pytest

from .conftest import BPF_SKIP, ROOT, needs_bpf, record, watcher


def one_line_error(proc, code: int, *needles: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("watcher: ")
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def good_recording(tmp_path_factory):
    if BPF_SKIP:
        pytest.skip(BPF_SKIP)
    out = tmp_path_factory.mktemp("rec") / "good.duckdb"
    assert record(out, sys.executable, "-c", "import os; [os.getppid() for _ in range(100)]").returncode == 0
    return out


@needs_bpf
def test_nonexistent_pid(tmp_path):
    proc = watcher("attach", "--pid", "999999999", "--out", str(tmp_path / "x.duckdb"))
    one_line_error(proc, 3, "no process with pid 999999999")
    assert not (tmp_path / "x.duckdb").exists()


@needs_bpf
def test_command_that_cannot_run(tmp_path):
    proc = record(tmp_path / "x.duckdb", "/nonexistent/binary")
    one_line_error(proc, 3, "cannot run /nonexistent/binary")
    assert not (tmp_path / "x.duckdb").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop privileges")
def test_missing_privileges_name_the_fix(tmp_path):
    # Root with every capability dropped (and root's automatic ones disabled):
    # what an unprivileged user or a locked-down container sees, while the
    # checkout, wherever CI cloned it, stays readable.
    proc = subprocess.run(
        ["setpriv", "--securebits", "+noroot,+noroot_locked", "--bounding-set", "-all", "--inh-caps", "-all",
         sys.executable, "-m", "watcher.cli", "attach", "--pid", str(os.getpid()),
         "--out", str(tmp_path / "x.duckdb")],
        capture_output=True, text=True, cwd=ROOT, timeout=60)
    one_line_error(proc, 4, "needs root or CAP_BPF and CAP_PERFMON", "sudo")
    assert not (tmp_path / "x.duckdb").exists()


def test_bcc_missing_names_the_fix(tmp_path):
    code = "import sys; sys.modules['bcc'] = None; from watcher.cli import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "attach", "--pid", str(os.getpid()),
                           "--out", str(tmp_path / "x.duckdb")],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    one_line_error(proc, 5, "bcc is not importable", "scripts/setup")


def test_unwritable_output_path(tmp_path):
    proc = watcher("attach", "--pid", str(os.getpid()), "--out", "/nonexistent-dir/x.duckdb")
    one_line_error(proc, 6, "cannot write /nonexistent-dir/x.duckdb")


def test_existing_output_is_never_overwritten(tmp_path):
    out = tmp_path / "x.duckdb"
    out.write_text("precious")
    proc = watcher("attach", "--pid", str(os.getpid()), "--out", str(out))
    one_line_error(proc, 6, "already exists")
    assert out.read_text() == "precious"


def test_bad_option_combination():
    proc = watcher("attach", "--pid", str(os.getpid()), "--ring-minutes", "5", "--max-size", "100M")
    one_line_error(proc, 2, "cannot be combined")
    proc = watcher("attach", "--pid", str(os.getpid()), "--probes", "syscall,bogus")
    one_line_error(proc, 2, "unknown probe 'bogus'")
    proc = watcher("attach", "--pid", str(os.getpid()), "--max-size", "lots")
    one_line_error(proc, 2, "bad size")


def test_missing_pid_option():
    proc = watcher("attach")
    assert proc.returncode == 2
    assert "--pid" in proc.stderr and "Traceback" not in proc.stderr


def test_corrupt_recording(tmp_path):
    bad = tmp_path / "bad.duckdb"
    bad.write_bytes(os.urandom(20000))
    one_line_error(watcher("sql", str(bad), "SELECT 1"), 6, "not a Watcher recording")
    one_line_error(watcher("info", str(bad)), 6, "not a Watcher recording")


def test_missing_recording(tmp_path):
    one_line_error(watcher("info", str(tmp_path / "nope.duckdb")), 6, "no such recording")


def test_truncated_recording(tmp_path, good_recording):
    cut = tmp_path / "cut.duckdb"
    data = good_recording.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    one_line_error(watcher("sql", str(cut), "SELECT count(*) FROM syscall"), 6, "truncated recording")


def test_unknown_schema_version(tmp_path, good_recording):
    future = tmp_path / "future.duckdb"
    shutil.copyfile(good_recording, future)
    con = duckdb.connect(str(future))
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.close()
    one_line_error(watcher("info", str(future)), 6, "unknown schema version 999")


def test_sql_error(good_recording):
    one_line_error(watcher("sql", str(good_recording), "SELEC nonsense"), 7, "SQL error")
    one_line_error(watcher("sql", str(good_recording), "SELECT no_such_column FROM syscall"), 7, "SQL error")


def test_bad_format(good_recording):
    one_line_error(watcher("sql", str(good_recording), "SELECT 1", "--format", "xml"), 2, "unknown --format")
