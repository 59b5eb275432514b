"""Ending a gloo process group without a deadlock at exit.

Gloo's worker thread drops its last reference to a finished collective's work
after the caller has been told it is done, and that work's thread-local state
holds a Python object: its release takes the GIL.  If the main thread is by
then destroying the process group (destroy_process_group, or the DDP reducer
holding the group's last reference, freed when the training function
returns), it joins that very thread while holding the GIL: both wait for ever
(seen here as py-spy stacks: ~ProcessGroupGloo in std::thread::join on the
main thread, ~AsyncBarrierWork in gil_scoped_acquire on gloo's thread).
Sleeping a moment releases the GIL so the worker thread can let go first."""

from __future__ import annotations

import time

import torch.distributed as dist

SETTLE_S = 0.2


def end_process_group() -> None:
    """Wait for every rank, let gloo's threads release their last work, tear down."""
    dist.barrier()
    time.sleep(SETTLE_S)
    dist.destroy_process_group()
