"""`watcher run --rescue`: a rank that dies is replaced while the job runs.

The ground truth is a fault-free run of the same job: after a rank is
killed from outside (SIGKILL, as the OOM killer or an operator would), the
job must finish under the same launcher with bit-identical parameters, and
no checkpoint is ever opened (the reference job here has none)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import ROOT, needs_bpf, query
from .test_run import LIGHTNING, plain, plain_reference, reference  # noqa: F401,F811 (fixture)

STEPS = 200
# The processes the launcher started, one per rank, are the ranks' supervisors:
# they never die while their rank is replaced, and the recording labels their
# live child, not them, as the rank.
LAUNCHED = "SELECT count(*), max(exit_code), max(exit_signal) FROM process WHERE name = 'w-supervisor'"
# Each rank's processes in order: the first (the supervisor's child) and the snapshot that took it over.
RANK_PROCESSES = "SELECT rank, pid, exit_code, exit_signal FROM process WHERE rank IS NOT NULL ORDER BY rank, start_ts"


def _logged_step(run: Path, rank: int) -> int:
    try:
        lines = (run / "runtime" / f"rank{rank}.steps.jsonl").read_text().splitlines()
    except OSError:
        return -1
    steps = [json.loads(x)["step"] for x in lines[-50:] if x.startswith("{") and '"seq"' not in x and x.endswith("}")]
    return max(steps, default=-1)


def _start(tmp: Path, cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "watcher.cli", "run", "--rescue", "--out", str(tmp / "run"),
                             "--snapshot-interval", "4", "--copy-interval", "0", "--", *cmd],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_rank(proc: subprocess.Popen, run: Path, rank: int, at_step: int) -> int:
    """SIGKILL rank `rank`'s process from outside once it has logged `at_step`; its pid."""
    _wait_for_step(proc, run, rank, at_step)
    victim = json.loads((run / "runtime" / f"rank{rank}.process.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    return victim


def _the_rescue(run: Path, victim: int, died_after: int) -> dict:
    """The one incident: the death, replaced from a snapshot, judged transient."""
    incidents = sorted((run / "incidents").glob("inc-*.json"))
    assert len(incidents) == 1, [json.loads(p.read_text())["kind"] for p in incidents]
    inc = json.loads(incidents[0].read_text())
    assert (inc["kind"], inc["detected_rank"], inc["detail"]["exit_signal"], inc["detail"]["pid"]) == \
        ("crash", 1, signal.SIGKILL, victim)
    assert (inc["classification"], inc["recovered"], inc["steps_lost"], inc["replay"]["reproduced"]) == \
        ("transient", True, 0, False)
    died, start = inc["detected_step"], inc["window"]["from_step"]
    assert died > died_after and start % 4 == 0 and died - 8 <= start < died
    assert inc["resumed_at_step"] == start + 1
    # Every rank was replaced by its own snapshot at that step: new processes, the launcher's untouched.
    for r in (0, 1):
        p = json.loads((run / "runtime" / f"rank{r}.process.json").read_text())
        assert p["rescue"] == 1 and p["pid"] != victim
    return inc


def _wait_for_step(proc: subprocess.Popen, run: Path, rank: int, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _logged_step(run, rank) < step:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"rank {rank} never reached step {step}"
        time.sleep(0.01)


@needs_bpf
def test_a_rank_killed_from_outside_is_replaced_and_the_job_ends_as_if_it_never_died(tmp_path):
    plain(reference(tmp_path / "p.pt", STEPS), tmp_path)
    run = tmp_path / "run"
    proc = _start(tmp_path, reference(tmp_path / "w.pt", STEPS))
    _wait_for_step(proc, run, 1, 60)
    # The supervisor split from its rank before torch was imported: it never
    # holds torch (the rank it stands for does).
    victim = json.loads((run / "runtime" / "rank1.process.json").read_text())["pid"]
    sup = int(Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert Path(f"/proc/{sup}/comm").read_text().strip() == "w-supervisor"
    assert "libtorch_cpu" in Path(f"/proc/{victim}/maps").read_text()
    assert "libtorch" not in Path(f"/proc/{sup}/maps").read_text()
    assert _kill_rank(proc, run, 1, 60) == victim
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (tmp_path / "w.pt.sha256").read_text() == (tmp_path / "p.pt.sha256").read_text()
    inc = _the_rescue(run, victim, 60)
    assert f"every rank resumed from step {inc['window']['from_step']}" in err
    rec = run / "recording.duckdb"
    assert query(rec, LAUNCHED) == [(2, 0, None)]
    ranks = query(rec, RANK_PROCESSES)
    assert [(r, code, sig) for r, _, code, sig in ranks] == \
        [(0, None, signal.SIGKILL), (0, 0, None), (1, None, signal.SIGKILL), (1, 0, None)]  # the rescuer ended rank 0
    resumed = json.loads((run / "runtime" / "rank1.process.json").read_text())["pid"]
    assert (ranks[2][1], ranks[3][1]) == (victim, resumed)
    assert query(rec, "SELECT count(*) FROM process WHERE cmdline LIKE '%torch.distributed.run%'") == [(1,)]
    # Each step is in the record once per rank, the re-executed ones as they ran the second time.
    assert query(rec, "SELECT rank, count(DISTINCT step), max(step) FROM step GROUP BY 1 ORDER BY 1") == \
        [(0, STEPS, STEPS - 1), (1, STEPS, STEPS - 1)]


@needs_bpf
def test_a_native_crash_that_happens_once_is_rescued_bit_identically(tmp_path, plain_reference):
    """Rank 1 writes through a null pointer at step 12, once (the drill's
    `segv_once`): the ranks resume from their step-8 snapshots, step 12 passes
    the second time, and the job ends as the fault-free one did."""
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True, snapshot_interval=4,
                        copy_interval=0, rescue=True, inject={"scenario": "segv_once", "rank": 1, "step": 12}))
    assert res.exit_code == 0
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    (inc,) = res.incidents
    assert (inc["kind"], inc["detected_rank"], inc["detected_step"], inc["window"]["from_step"]) == ("crash", 1, 12, 8)
    assert (inc["classification"], inc["recovered"], inc["resumed_at_step"]) == ("transient", True, 9)
    assert inc["detail"]["exit_signal"] == signal.SIGSEGV


@needs_bpf
def test_a_native_crash_that_comes_back_after_a_rescue_is_persistent_and_not_rescued_twice(tmp_path):
    """The same null write at step 12, every time: the rescued ranks die there
    again the same way, so the death is let go (one rescue, not two) and the
    crash is replayed and diagnosed after the job, as without --rescue."""
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True, snapshot_interval=4,
                        copy_interval=0, rescue=True, inject={"scenario": "segv", "rank": 1, "step": 12}))
    assert res.exit_code != 0
    first, second = sorted(res.incidents, key=lambda i: i["incident_id"])
    assert (first["kind"], first["detected_step"], first["classification"], first["replay"]["reproduced"]) == \
        ("crash", 12, "persistent", True)
    assert first["recovery"]["rescue"] == 1
    assert (second["kind"], second["detected_rank"], second["detected_step"], second["classification"]) == \
        ("crash", 1, 12, "persistent")
    assert (second["replay"]["crashed_again"], second["replay"]["replay_signal"]) == (True, "SIGSEGV")
    assert (second["attribution"]["cause"], second["prescription"]["action"]) == ("software", "fix_kernel")
    # The crash judged after the job is the last death, of the process that took rank 1 over, not the rescued one.
    last = json.loads((tmp_path / "run" / "runtime" / "rank1.process.json").read_text())["pid"]
    assert second["detail"]["pid"] == last != first["detail"]["pid"]
    fates = sorted(p.name for p in (tmp_path / "run" / "runtime" / "rescue").glob("fate.rank1.*"))
    assert len(fates) == 2  # replaced once, let go once


@needs_bpf
def test_a_lightning_rank_killed_from_outside_is_replaced_and_the_fit_ends_as_if_it_never_died(tmp_path):
    """Lightning's launcher is rank 0 itself, and it watches the rank it
    started (a child that dies takes the job down): both stay up while
    every rank resumes from its snapshot."""
    steps = 160
    plain([sys.executable, LIGHTNING, "--steps", str(steps), "--save", str(tmp_path / "plain.sha")], tmp_path)
    run = tmp_path / "run"
    proc = _start(tmp_path, [sys.executable, LIGHTNING, "--steps", str(steps), "--save", str(tmp_path / "w.sha")])
    victim = _kill_rank(proc, run, 1, 30)  # well before the end: the fit's 160 steps take a few seconds
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (tmp_path / "w.sha").read_text() == (tmp_path / "plain.sha").read_text()
    _the_rescue(run, victim, 30)
    assert query(run / "recording.duckdb", "SELECT rank, count(DISTINCT step), max(step) FROM step GROUP BY 1 "
                                           "ORDER BY 1") == [(0, steps, steps - 1), (1, steps, steps - 1)]


@needs_bpf
def test_a_rank_stuck_in_a_read_once_is_replaced_and_the_job_ends_as_if_it_never_hung(tmp_path, plain_reference):
    """Rank 1 blocks at step 12 in a read that never returns, once (the
    drill's `hang_pipe_once`): the hang's replay runs past it (transient), so
    the stuck rank is ended and replaced like a crashed one, and the job
    ends as the fault-free one did."""
    from watcher.run import RunConfig, run

    res = run(RunConfig(cmd=reference(tmp_path / "w.pt"), out=tmp_path / "run", quiet=True, snapshot_interval=4,
                        copy_interval=0, rescue=True, detect={"hang_seconds": 3.0},
                        inject={"scenario": "hang_pipe_once", "rank": 1, "step": 12}))
    assert res.exit_code == 0
    assert (tmp_path / "w.pt.sha256").read_text() == plain_reference
    by_kind = {i["kind"]: i for i in res.incidents}
    assert sorted(by_kind) == ["crash", "hang", "stall"], [i["kind"] for i in res.incidents]
    hang, crash = by_kind["hang"], by_kind["crash"]
    assert (hang["classification"], hang["recovered"], hang["recovery"]["replaced_by"]) == \
        ("transient", True, crash["incident_id"])
    assert crash["detail"]["ended_by_watcher"]["incident_id"] == hang["incident_id"]
    assert (crash["detected_rank"], crash["detected_step"], crash["classification"], crash["recovered"]) == \
        (1, 12, "transient", True)


def test_a_supervisor_let_go_ends_exactly_as_its_rank_did():
    """The launcher must read the rank's own death from the supervisor: the
    same signal (SIGKILL too, which has no handler to reset) or exit code."""
    from watcher.runtime.supervisor import _end_like

    for sig in (signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM):
        rank = os.fork()
        if rank == 0:
            try:
                faulthandler.disable()  # pytest's, which would print a fatal error for the rank's own SIGSEGV
                if sig != signal.SIGKILL:
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            finally:
                os._exit(99)
        _, status = os.waitpid(rank, 0)
        sup = os.fork()
        if sup == 0:
            try:
                faulthandler.disable()
                _end_like(status)
            finally:
                os._exit(98)
        _, ended = os.waitpid(sup, 0)
        assert os.WIFSIGNALED(ended) and os.WTERMSIG(ended) == sig
    sup = os.fork()
    if sup == 0:
        try:
            _end_like(3 << 8)  # a rank that exited 3
        finally:
            os._exit(98)
    _, ended = os.waitpid(sup, 0)
    assert os.waitstatus_to_exitcode(ended) == 3


def test_a_ctrl_c_at_the_terminal_is_not_passed_on_twice():
    """A Ctrl-C at the terminal reaches the whole foreground group, the rank
    included: its supervisor passes on only what the terminal did not send
    (a launcher's SIGINT, from outside the group)."""
    import pty

    from watcher.runtime.supervisor import terminal_sent_it

    pid, fd = pty.fork()  # the child leads a session whose terminal is the pty: its foreground group
    if pid == 0:
        try:
            os.write(1, b"yes\n" if terminal_sent_it() else b"no\n")
        finally:
            os._exit(0)
    out = b""
    while not out.endswith(b"\n"):
        try:
            chunk = os.read(fd, 64)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    os.close(fd)
    assert out.strip() == b"yes"
    with open(os.devnull) as null:  # no terminal: everything is passed on
        saved = os.dup(0)
        os.dup2(null.fileno(), 0)
        try:
            assert terminal_sent_it() is False
        finally:
            os.dup2(saved, 0)
            os.close(saved)
