"""The samples of a batch: rows along dim 0 of every field of the batch's size.

A skip_batch prescription (runtime/remedies.py) keeps samples out by their
digest, wherever they come back; a counterfactual replay (replay/variants.py)
removes them and scans them for anomalies.
"""

from __future__ import annotations

import torch


def map_fields(b, fn):
    if isinstance(b, torch.Tensor):
        return fn(b)
    if isinstance(b, (list, tuple)):
        return type(b)(map_fields(x, fn) for x in b)
    if isinstance(b, dict):
        return {k: map_fields(v, fn) for k, v in b.items()}
    return b


def fields(b, prefix=""):
    if isinstance(b, torch.Tensor):
        yield prefix or "0", b
    elif isinstance(b, (list, tuple)):
        for i, x in enumerate(b):
            yield from fields(x, f"{prefix}{i}" if not prefix else f"{prefix}.{i}")
    elif isinstance(b, dict):
        for k, x in b.items():
            yield from fields(x, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")


def row_digests(b) -> list[int]:
    """One digest per sample (row along dim 0 of every field of the batch's
    size), over the raw bits: the same sample met again, in another epoch or
    on another rank, has the same digest."""
    n = batch_size(b)
    out = [0] * n
    for _, t in fields(b):
        if not t.dim() or t.shape[0] != n or t.numel() == 0:
            continue
        rows = t.detach().reshape(n, -1).contiguous()
        if rows.dtype == torch.bool:
            rows = rows.view(torch.uint8)
        words = rows.view(torch.int32) if rows.element_size() in (4, 8) else rows.view(torch.uint8).to(torch.int32)
        sums = words.to(torch.int64).sum(dim=1).tolist()
        out = [(d * 1000003 + s * 31 + words.shape[1]) & ((1 << 63) - 1) for d, s in zip(out, sums)]
    return out


def without_rows(b, rows):
    """The batch with those samples removed."""
    n = batch_size(b)
    keep = torch.tensor([i for i in range(n) if i not in set(rows)], dtype=torch.long)
    return map_fields(b, lambda t: t.index_select(0, keep) if t.dim() and t.shape[0] == n else t)


def batch_size(b) -> int:
    sizes = [t.shape[0] for _, t in fields(b) if t.dim()]
    return max(set(sizes), key=sizes.count) if sizes else 0
