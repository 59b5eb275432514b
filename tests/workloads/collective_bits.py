"""Every collective the replay computes, run for real over gloo, against
replay/exchange.compute_outputs fed with every rank's inputs (gathered with
a real all_gather).  Writes, per rank, the ops checked and which matched bit
for bit (OUT.rank<r>.json)."""

import json
import sys

import torch
import torch.distributed as dist

from watcher.replay.exchange import compute_outputs

out_path = sys.argv[1]
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(100 + r)


def rand(n):  # values over many magnitudes: rounding depends on the order of the sum
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)


def everyone(ts):
    """Every rank's tensors, by rank (a real all_gather per tensor)."""
    got = [[None] * len(ts) for _ in range(w)]
    for i, t in enumerate(ts):
        parts = [torch.empty_like(t) for _ in range(w)]
        dist.all_gather(parts, t.contiguous())
        for q in range(w):
            got[q][i] = parts[q]
    return got


results = []


def check(name, meta, ins, outs):
    peers = everyone(ins)
    want = [torch.empty_like(o) for o in outs]
    ok = compute_outputs(meta, peers, want, r)
    row = {"op": name, "computed": ok, "same": ok and all(torch.equal(a, b) for a, b in zip(want, outs))}
    if meta["op"] == "allreduce" and meta["reduce_op"] == "SUM":
        row["rank_order_same"] = bool(torch.equal(_rank_order(peers), outs[0]))
    results.append(row)


def _rank_order(peers):
    acc = peers[0][0].clone()
    for p in peers[1:]:
        acc += p[0]
    return acc


for n in (1, 5, 1000, 300_001, 600_000):
    for red, op in (("SUM", dist.ReduceOp.SUM), ("MAX", dist.ReduceOp.MAX), ("PRODUCT", dist.ReduceOp.PRODUCT)):
        x = rand(n) if red != "PRODUCT" else 1 + rand(n) * 1e-3
        y = x.clone()
        dist.all_reduce(y, op=op)
        check(f"allreduce/{red}/{n}", {"op": "allreduce", "reduce_op": red}, [x], [y])
xs = [rand(n) for n in (7, 1000, 70_000)]
ys = [t.clone() for t in xs]
dist.all_reduce_coalesced(ys)
check("allreduce_coalesced", {"op": "allreduce_coalesced", "reduce_op": "SUM"}, xs, ys)
for m in (3, 1001, 70_001):
    x = rand(m * w)
    y = torch.empty(m)
    dist.reduce_scatter_tensor(y, x)
    check(f"_reduce_scatter_base/{m}", {"op": "_reduce_scatter_base", "reduce_op": "SUM"}, [x], [y])
    parts = [t.clone() for t in x.chunk(w)]
    y = torch.empty(m)
    dist.reduce_scatter(y, parts)
    check(f"reduce_scatter/{m}", {"op": "reduce_scatter", "reduce_op": "SUM"}, parts, [y])
    x = rand(m * w)
    y = torch.empty(m * w)
    dist.all_to_all_single(y, x)
    check(f"alltoall_base/{m}", {"op": "alltoall_base"}, [x], [y])
    ins = [rand(m) for _ in range(w)]
    outs = [torch.empty(m) for _ in range(w)]
    dist.all_to_all(outs, ins)
    check(f"alltoall/{m}", {"op": "alltoall"}, ins, outs)
    x = rand(m)
    y = x.clone()
    dist.broadcast(y, src=w - 1)
    check(f"broadcast/{m}", {"op": "broadcast", "root": w - 1}, [x], [y])
with open(f"{out_path}.rank{r}.json", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
