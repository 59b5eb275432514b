"""Reductions computed the way the backend computes them, bit for bit.

A float sum depends on the order of its terms.  gloo (CPU) reduces with its
ring algorithm (gloo/allreduce.cc): the buffer is cut into segments, a
multiple of the world size of them (at least two per rank, at most 1 MiB
each); segment s belongs to rank c = s // segments_per_rank, and its sum
starts at rank c-1 and travels down the ring, each rank combining its own
value with what it received: f(x[c-2], x[c-1]), then f(x[c-3], that), ...,
ending with rank c's own.  With two ranks that is the plain sum; with three
or more, a rank-order sum differs in the last bits (measured here at 3 and 4
ranks on every size from 1 to 700k elements, and for allreduce_coalesced,
reduce_scatter and _reduce_scatter_base, which torch's gloo backend runs as
ring allreduces: over the flattened inputs, per input, and over the whole
input respectively).

`ring_reduce` reproduces that order, so a replay that recomputes a reduction
from the replayed inputs of every rank gets exactly the bits the live ranks
got, at any world size.
"""

from __future__ import annotations

import torch

MAX_SEGMENT_BYTES = 1 << 20  # gloo's AllreduceOptions::kMaxSegmentSize
COMPUTED_OPS = ("SUM", "PRODUCT", "MAX", "MIN")  # the reduce ops replayed here; others keep their outputs


def _combine(op: str, mine: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """gloo's reduce function f(a=this rank's value, b=the running result)."""
    if op == "SUM":
        return mine + received
    if op == "PRODUCT":
        return mine * received
    if op == "MAX":  # std::max(a, b): b only when a < b
        return torch.where(mine < received, received, mine)
    if op == "MIN":  # std::min(a, b): b only when b < a
        return torch.where(received < mine, received, mine)
    raise ValueError(f"reduce op {op} is not computed in replay")


def segments(n: int, elem: int, world: int) -> tuple[int, int]:
    """(number of segments, elements per segment) of gloo's ring for n elements."""
    total = n * elem
    max_seg = elem * max(1, MAX_SEGMENT_BYTES // elem)
    count = max(-(-total // max_seg), 2 * world)
    count = -(-count // world) * world
    seg_bytes = -(-(-(-total // count)) // elem) * elem
    return count, seg_bytes // elem


def ring_reduce(inputs: list[torch.Tensor], op: str = "SUM") -> torch.Tensor:
    """Every rank's flat input (by group rank) reduced in gloo's ring order."""
    world = len(inputs)
    flat = [t.reshape(-1) for t in inputs]
    n = flat[0].numel()
    out = torch.empty_like(flat[0])
    if world == 1:
        return out.copy_(flat[0])
    count, per = segments(n, flat[0].element_size(), world)
    per_rank = count // world
    for s in range(count):
        lo, hi = s * per, min((s + 1) * per, n)
        if lo >= hi:
            break
        owner = s // per_rank
        acc = flat[(owner - 1) % world][lo:hi]
        for k in range(2, world + 1):
            acc = _combine(op, flat[(owner - k) % world][lo:hi], acc)
        out[lo:hi] = acc
    return out


def ring_reduce_into(outs: list[torch.Tensor], inputs: list[list[torch.Tensor]], op: str) -> None:
    """Coalesced: every rank's tensors flattened into one buffer, reduced as one."""
    flat = ring_reduce([torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1)
                        for ts in inputs], op)
    at = 0
    for o in outs:
        o.view(-1).copy_(flat[at:at + o.numel()])
        at += o.numel()
