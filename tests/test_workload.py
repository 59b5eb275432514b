"""The bundled DDP reference workload must be bit-for-bit reproducible.

Replay and diagnosis tests compare against it, so if two identical runs ever
diverge those tests would blame Watcher for the workload's own noise.
"""

import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300


def run_workload(out: Path, seed: int, steps: int = 8) -> str:
    save = out / "model.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        # --standalone picks a free rendezvous port, so parallel runs don't clash.
        "--standalone", "--nproc_per_node=2",
        "-m", "watcher.workloads.ddp_lm",
        "--steps", str(steps), "--seed", str(seed), "--save", str(save),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=Path(__file__).resolve().parents[1])
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
