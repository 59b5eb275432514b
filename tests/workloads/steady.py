"""A gloo job of identical steps: sleep STEP_S (the compute), one all_reduce.

    torchrun --nproc_per_node=2 tests/workloads/steady.py --steps 40 --step-s 0.05

Ground truth for the node agent's tests: every rank issues exactly STEPS
all_reduce calls (then the barrier of the teardown), one per step of about
STEP_S seconds.  --until FILE: keep stepping until FILE exists (a job that
runs as long as the test needs; at least one step, and every rank stops at
the same step).  --hang-rank R --hang-at S: rank R stops
before its all_reduce of step S (counting from 0), its peers block in theirs.  --tag: a word for the command line only.
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from watcher.workloads.teardown import end_process_group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--until", default=None)
    ap.add_argument("--hang-rank", type=int, default=None, help="this rank stops for good at --hang-at")
    ap.add_argument("--hang-at", type=int, default=None)
    ap.add_argument("--tag", default=None, help="ignored: lets a test pick its jobs by command line")
    a = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    t = torch.ones(1000)
    step = 0
    while step < a.steps or a.until:
        time.sleep(a.step_s)
        if step == a.hang_at and dist.get_rank() == a.hang_rank:
            time.sleep(3600)  # a hang: its peers wait in the next all_reduce
        # The ranks stop together: each one's sight of --until rides in the
        # all_reduce, so one that saw the file a moment before its peer does not
        # leave the peer alone in one more all_reduce.
        t[0] = 1.0 if a.until and os.path.exists(a.until) else 0.0
        dist.all_reduce(t)
        step += 1
        if step >= a.steps and a.until and t[0] > 0:
            break
    # One write: the ranks share the launcher's stdout, and print's text and newline may interleave.
    os.write(1, f"rank {dist.get_rank()} steps {step}\n".encode())
    end_process_group()


if __name__ == "__main__":
    main()
