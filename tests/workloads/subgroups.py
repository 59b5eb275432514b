"""A hand-written data-parallel loop with the user's own collectives, no DDP.

Gradients are averaged with dist.all_reduce on a subgroup from new_group (both
ranks), the loss is all_gathered on the default group, and rank 0 broadcasts
a random scale every step.  Rank 0 writes the final parameters' sha256 to --save.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

from watcher.workloads.teardown import end_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    for prm in model.parameters():
        dist.broadcast(prm.data, src=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(32, 8, generator=g)
        y = x[:, :1] * 2
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad, group=pair)
            prm.grad /= world
        scale = torch.rand(1) if rank == 0 else torch.zeros(1)
        dist.broadcast(scale, src=0)
        losses = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(losses, loss.detach().reshape(1))
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (0.5 + scale.item())
        opt.step()
    if rank == 0:
        h = hashlib.sha256()
        for _, t in sorted(model.state_dict().items()):
            h.update(t.contiguous().numpy().tobytes())
        with open(args.save, "w") as f:
            f.write(h.hexdigest() + "\n")
    end_process_group()  # barrier, then teardown without the gloo exit deadlock


if __name__ == "__main__":
    main()
