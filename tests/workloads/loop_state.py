"""DDP training whose numerics depend on the training loop's own Python state.

The loss is scaled by a warm-up factor computed from the loop's step counter,
a plain local variable, as hand-written warm-ups do.  A state copy (which
carries tensors, optimizer, schedulers and RNG, not the program's locals)
therefore cannot stand in for this job's state: a replay from one diverges
at its first step, and Watcher must notice and replay from the fork snapshot
instead.  Run under torchrun (gloo); rank 0 writes the sha256 of the final
parameters to --save.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from watcher.workloads.teardown import end_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(1024, 32)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = 0
    for xb, yb in loader:
        if step >= args.steps:
            break
        warmup = min(1.0, (step + 1) / 50)  # the program's own state, outside any tensor
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(xb), yb) * warmup
        loss.backward()
        opt.step()
        step += 1
    if dist.get_rank() == 0:
        h = hashlib.sha256()
        for _, t in sorted(model.module.state_dict().items()):
            h.update(t.contiguous().numpy().tobytes())
        with open(args.save, "w") as f:
            f.write(h.hexdigest() + "\n")
    end_process_group()  # barrier, then teardown without the gloo exit deadlock


if __name__ == "__main__":
    main()
