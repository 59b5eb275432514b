"""A 2-rank gloo job issuing a known sequence of collectives (test ground truth).

    torchrun --nproc_per_node=2 tests/workloads/collectives.py MODE

MODE normal: 5 all_reduce (one tensor of 1000 float32), 3 broadcast, 2
all_gather, 1 barrier.  MODE hang: rank 1 skips the 4th all_reduce and sleeps,
so rank 0 waits in it.  MODE crash: rank 1 kills itself with SIGSEGV 0.5 s
after the 3rd all_reduce (time for the recorder to name the code of its Python
stacks; see README "Known limits").
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "normal"
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.ones(1000)
    for i in range(5):
        if mode == "hang" and rank == 1 and i == 3:
            time.sleep(float(os.environ.get("HANG_S", "8")))
            os._exit(3)
        dist.all_reduce(t)
        if mode == "crash" and rank == 1 and i == 2:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGSEGV)
    for _ in range(3):
        dist.broadcast(t, src=0)
    out = [torch.zeros(1000) for _ in range(2)]
    for _ in range(2):
        dist.all_gather(out, t)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
