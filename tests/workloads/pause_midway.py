"""DDP training that pauses Watcher for steps [--pause-from, --pause-to) through
the run's control block, as `just bench run` does from outside, but at known
steps.  Rank 0 sets and clears the `paused` word at the start of those steps;
both ranks read it at their step ends.  Run under `watcher run` and torchrun (gloo)."""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from watcher.runtime.control import PAUSE_RECORDER, PAUSE_RUNTIME, Control

from watcher.workloads.teardown import end_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--pause-from", type=int, default=40)
    p.add_argument("--pause-to", type=int, default=60)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctl = Control(Path(os.environ["WATCHER_RUN_DIR"]) / "runtime") if rank == 0 else None
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):  # the runtime numbers steps the same way: the first ends step 0
        if ctl is not None and step == args.pause_from:
            ctl.paused = PAUSE_RUNTIME | PAUSE_RECORDER
        if ctl is not None and step == args.pause_to:
            ctl.paused = 0
        x = torch.randn(16, 32, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    end_process_group()  # barrier, then teardown without the gloo exit deadlock


if __name__ == "__main__":
    main()
