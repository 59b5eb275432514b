"""The bundled DDP reference workload must be bit-for-bit reproducible.

Replay and diagnosis tests compare against it, so if two identical runs ever
diverge those tests would blame Watcher for the workload's own noise.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A run takes ~10 s here.  One launch in hundreds has hung before the first
# step with plain torch (no Watcher in the process): such a launch is
# stopped, its Python stacks are printed, and it is launched once more.
TIMEOUT_S = 150


def _descendants(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids + [d for k in kids for d in _descendants(k)]


def _launch(cmd: list[str]) -> subprocess.CompletedProcess | str:
    """The finished launch, or (after a hang) the ranks' Python stacks."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")  # SIGABRT then prints every thread's stack
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1], start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return f"launch hung for {TIMEOUT_S} s; the ranks' stacks:\n{out}\n{err[-20000:]}"


def run_workload(out: Path, seed: int, steps: int = 8) -> str:
    save = out / "model.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        # --standalone picks a free rendezvous port, so parallel runs don't clash.
        "--standalone", "--nproc_per_node=2",
        "-m", "watcher.workloads.ddp_lm",
        "--steps", str(steps), "--seed", str(seed), "--save", str(save),
    ]
    proc = _launch(cmd)
    if isinstance(proc, str):
        print(proc, file=sys.stderr)  # shown with the test's output if the second launch fails too
        proc = _launch(cmd)
        assert not isinstance(proc, str), proc
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert save.exists()
    return (out / "model.pt.sha256").read_text().strip()


def test_same_seed_gives_identical_parameters(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    hash_a = run_workload(a, seed=0)
    hash_b = run_workload(b, seed=0)
    assert len(hash_a) == 64
    assert hash_a == hash_b


def test_different_seeds_give_different_parameters(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert run_workload(a, seed=0) != run_workload(b, seed=1)
