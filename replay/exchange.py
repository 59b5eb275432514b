"""Collectives in a coordinated replay: the replay children are the network.

In a coordinated replay every rank's child re-executes the window at once.
At each collective a child appends its replayed inputs to its own exchange
file (opened before the sandbox closed, the one file it may write), reads the
same collective's inputs from its peers' files, and computes the outputs
itself, reductions in the backend's own order (reduction.py).  Every child
computes the same outputs from the same inputs, so the replay needs no
process to reduce for it, and the outputs are the reduction of the
*replayed* inputs: a corrupted contribution or a corrupted transfer of the
live run does not come back, and a faithful replay gets the live bits at any
world size.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from ..runtime.window import decode, encode, framed
from .reduction import COMPUTED_OPS, ring_reduce, ring_reduce_into

TAG = 0x5843  # exchange files are never recycled; any fixed tag does


class PeerLog:
    """Records a peer child has appended so far, read as they arrive."""

    def __init__(self, path: Path):
        self.path = path
        self.f = None
        self.records: dict = {}
        self.ended = None

    def poll(self) -> None:
        if self.f is None:
            try:
                self.f = open(self.path, "rb")
            except FileNotFoundError:
                return
        while True:
            pos = self.f.tell()
            try:
                rec = decode(self.f, TAG)
            except Exception:
                rec = None
            if rec is None:  # nothing more yet, or a record still being written
                self.f.seek(pos)
                return
            if rec[0] == "end":
                self.ended = rec[1]
            else:
                self.records[rec[1]] = rec[2]


class Exchange:
    def __init__(self, directory: Path, rank: int, world: int, fd: int):
        self.rank, self.world = rank, world
        self.fd = fd
        self.peers = {r: PeerLog(exchange_path(directory, r)) for r in range(world) if r != rank}
        self.publish_ns = 0   # writing this replay's inputs
        self.wait_ns = 0      # waiting for and reading the peers'

    def publish(self, key, payload: dict) -> None:
        os.writev(self.fd, framed(encode(("x", key, payload)), TAG))

    def end(self, status: str) -> None:
        try:
            os.writev(self.fd, framed(encode(("end", status)), TAG))
        except OSError:
            pass

    def gather(self, key, mine: dict, members: list[int], timeout_s: float) -> list[dict]:
        """The payload for `key` of every member of its group (global ranks, in group-rank order)."""
        t0 = time.monotonic_ns()
        self.publish(key, mine)
        t1 = time.monotonic_ns()
        self.publish_ns += t1 - t0
        try:
            return self._collect(key, mine, members, timeout_s)
        finally:
            self.wait_ns += time.monotonic_ns() - t1

    def _collect(self, key, mine: dict, members: list[int], timeout_s: float) -> list[dict]:
        peers = {r: self.peers[r] for r in members if r != self.rank}
        deadline = time.monotonic() + timeout_s
        delay = 0.0002
        while True:
            for p in peers.values():
                p.poll()
            if all(key in p.records for p in peers.values()):
                return [mine if r == self.rank else peers[r].records.pop(key) for r in members]
            gone = [r for r, p in peers.items() if p.ended is not None and key not in p.records]
            if gone:
                raise PeerEnded(f"rank {gone[0]}'s replay ended ({self.peers[gone[0]].ended}) before collective {key}")
            if time.monotonic() > deadline:
                raise PeerEnded(f"no replayed inputs for collective {key} from every rank in {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.001)  # peers replay in lockstep: waits are short


def end_for(directory, rank: int, status: str) -> None:
    """Append an end record to `rank`'s exchange file (from its supervisor)."""
    try:
        fd = os.open(exchange_path(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    try:
        os.writev(fd, framed(encode(("end", status)), TAG))
    finally:
        os.close(fd)


class PeerEnded(RuntimeError):
    pass


def exchange_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.xchg"


def compute_outputs(meta: dict, inputs: list[list[torch.Tensor]], outs: list[torch.Tensor], me: int) -> bool:
    """Write into `outs` what the collective delivers to group rank `me`,
    given every member's inputs (by group rank, flattened as the wrapper
    flattens them: runtime/collectives.py).  False for a call this module
    cannot compute."""
    op, world = meta["op"], len(inputs)
    red = meta.get("reduce_op") or "SUM"
    if red not in COMPUTED_OPS:
        return False
    if op == "barrier":
        return True
    if op in ("allreduce", "allreduce_coalesced"):
        ring_reduce_into(outs, inputs, red)
        return True
    if op == "reduce_scatter":
        # One ring allreduce per input position; this rank keeps its own position's.
        for i, o in enumerate(outs):
            o.view(-1).copy_(ring_reduce([inputs[r][i * world + me] for r in range(world)], red))
        return True
    if op == "_reduce_scatter_base":
        n = outs[0].numel()
        outs[0].view(-1).copy_(ring_reduce([inputs[r][0] for r in range(world)], red)[me * n:(me + 1) * n])
        return True
    if op == "broadcast":
        root = meta.get("root")
        if root is None:
            return False
        for o, t in zip(outs, inputs[root]):
            o.copy_(t)
        return True
    if op == "allgather":
        # outputs flattened as [input 0 from ranks 0..n-1, input 1 from ranks 0..n-1, ...]
        for i, o in enumerate(outs):
            o.copy_(inputs[i % world][i // world])
        return True
    if op == "_allgather_base":
        outs[0].copy_(torch.cat([inputs[r][0].reshape(-1) for r in range(world)]).view_as(outs[0]))
        return True
    if op == "alltoall":
        for j, o in enumerate(outs):
            o.copy_(inputs[j][me])
        return True
    if op == "alltoall_base" and not meta.get("splits"):
        # Even splits along dim 0: from rank j, the j-th part of this rank's output.
        parts = outs[0].chunk(world)
        for j, part in enumerate(parts):
            part.copy_(inputs[j][0].chunk(world)[me])
        return True
    return False
