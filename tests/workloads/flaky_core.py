"""A 2-rank DDP job (gloo, CPU) on a machine with one flaky core.

--core C          rank 1 pins itself to core C (as jobs pinning ranks to cores do)
--flip-steps S,T  at those steps, while rank 1 runs on core C, one element of its
                  first gradient gets its top exponent bit flipped before DDP's
                  allreduce: the core's fault.  It strikes once per step (a marker
                  file in --markers says it did), so a replay of the step is clean:
                  each failure alone looks transient.  Off core C nothing happens.
--always          the core fails every time, replays included (no marker): a
                  persistent fault, until the rank leaves the core
--affinity PATH   each rank writes the CPUs it may run on at start to PATH.rank<r>
--save PATH       rank 0 writes the sha256 of its final parameters to PATH

The fault is the workload's own (sched_getcpu), not Watcher's: what Watcher sees
is what a real bad core would show.
"""

import argparse
import ctypes
import hashlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from watcher.workloads.teardown import end_process_group

LIBC = ctypes.CDLL(None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--core", type=int)
    p.add_argument("--flip-steps", default="")
    p.add_argument("--markers")
    p.add_argument("--always", action="store_true")
    p.add_argument("--affinity")
    p.add_argument("--save")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.affinity:
        with open(f"{args.affinity}.rank{rank}", "w") as f:
            f.write(",".join(map(str, sorted(os.sched_getaffinity(0)))))
    if rank == 1 and args.core is not None:
        os.sched_setaffinity(0, {args.core})
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    flips = {int(s) for s in args.flip_steps.split(",") if s}
    step = {"n": 0}

    def faulty_core(grad: torch.Tensor) -> torch.Tensor:
        k = step["n"] + 1
        if rank == 1 and k in flips and LIBC.sched_getcpu() == args.core:
            marker = os.path.join(args.markers, f"struck.{k}")
            if args.always or not os.path.exists(marker):
                if not args.always:
                    open(marker, "w").close()
                grad = grad.clone()
                grad.view(-1)[:1].view(torch.int32)[0] ^= 1 << 30
        return grad
    next(model.parameters()).register_hook(faulty_core)

    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(args.steps):
        x = torch.randn(16, 32, generator=gen)
        y = x[:, :1].sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step["n"] += 1
    if rank == 0 and args.save:
        h = hashlib.sha256()
        for t in model.module.state_dict().values():
            h.update(t.detach().contiguous().numpy().tobytes())
        with open(args.save, "w") as f:
            f.write(h.hexdigest())
    end_process_group()


if __name__ == "__main__":
    main()
