"""A small 2-rank job (gloo, CPU) whose numerics a preflight should question.

--half           the model in float16, with no gradient scaler
--rank1-dtype D  rank 1 builds its model in dtype D (rank 0 in float32): ranks that disagree

No DDP (a DDP over mismatched dtypes fails at construction): each rank trains
its own copy and the ranks average the loss value (float32 on every rank).
"""

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from watcher.workloads.teardown import end_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--half", action="store_true")
    p.add_argument("--rank1-dtype", default="float32")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtype = torch.float16 if args.half else getattr(torch, args.rank1_dtype) if rank == 1 else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    step = 0
    while step < args.steps:
        for x, y in DataLoader(data, batch_size=16):
            if step >= args.steps:
                break
            loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))
            opt.zero_grad()
            loss.backward()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            opt.step()
            step += 1
    end_process_group()  # barrier, then teardown without the gloo exit deadlock


if __name__ == "__main__":
    main()
