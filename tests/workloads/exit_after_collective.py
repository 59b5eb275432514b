"""A rank that leaves the moment its last collective completes.

Three optimizer steps of a hand-written data-parallel loop, then one more
all_reduce whose work the rank waits on, and the interpreter exits at once:
no destroy_process_group, nothing in between.  Whoever completes a
collective on gloo's thread must be done with Python before the interpreter
finalizes.  Exits 0 when training ends normally.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
        opt.step()
    dist.all_reduce(torch.ones(4), async_op=True).wait()


if __name__ == "__main__":
    main()
