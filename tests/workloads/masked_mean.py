"""A 2-rank DDP job (gloo, CPU) with a bug that only some data sets off.

Each sample is a sequence of T tokens with a mask of the ones that count; the
loss is the masked mean over tokens, (err * mask).sum(1) / mask.sum(1): 0/0,
NaN, for a sample whose mask is all zeros.  The data is finite; the division
is the bug.

--zero-mask I   dataset sample I gets an all-zero mask (the data the bug needs)
--skip-empty    leave rows with an all-zero mask out of each batch (what the
                run should become once those samples are skipped: the baseline)
--save PATH     rank 0 writes the sha256 of its final parameters to PATH

A DistributedSampler without shuffling: rank r trains on samples r, r+2, ...
in batches of 8, 16 steps an epoch; the bad sample comes back every epoch.
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from watcher.workloads.teardown import end_process_group

N, T, D = 256, 8, 16


def data(zero_mask: int | None) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, T, D, generator=g)
    y = x[..., :1].squeeze(-1).tanh()
    mask = (torch.rand(N, T, generator=g) < 0.7).float()
    mask[:, 0] = 1.0  # every sample has a token that counts...
    if zero_mask is not None:
        mask[zero_mask] = 0.0  # ...but this one
    return TensorDataset(x, mask, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--zero-mask", type=int)
    p.add_argument("--skip-empty", action="store_true")
    p.add_argument("--save")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=5e-2)
    ds = data(args.zero_mask)
    sampler = DistributedSampler(ds, shuffle=False)
    step = 0
    while step < args.steps:
        for x, mask, y in DataLoader(ds, batch_size=8, sampler=sampler):
            if step >= args.steps:
                break
            if args.skip_empty:
                keep = mask.sum(1) > 0
                x, mask, y = x[keep], mask[keep], y[keep]
            err = (model(x).squeeze(-1) - y) ** 2
            per_sample = (err * mask).sum(1) / mask.sum(1)
            loss = per_sample.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    if rank == 0 and args.save:
        h = hashlib.sha256()
        for t in model.module.state_dict().values():
            h.update(t.detach().contiguous().numpy().tobytes())
        with open(args.save, "w") as f:
            f.write(h.hexdigest())
    end_process_group()


if __name__ == "__main__":
    main()
