"""Counterfactual replays: what one replay changes, inside the replay child.

A variant is a small dict in the replay order (built by diagnose.py), for
example `{"name": "lr_hold", "lr_factor": 1.0}`.  Its keys:

  trace       {"failing_step": k}: op-level tracing of steps k-1 and k (optrace.py), and the
              failing step's batch scanned for anomalies
  swap_batch  {"step": k, "ranks": [r]}: those ranks train step k on another recorded batch
  drop_rows   {"step": k, "rows": {r: [i, ...]}}: those samples removed from step k's batch
  lr_factor   f: every param group's learning rate capped at f x its value at the snapshot
  clip        x: gradients clipped to total norm x before every optimizer step
  cpus        {r: [cpu, ...]}: rank r replays pinned to those CPUs (another core set)
  float64     true: the float64 reference: parameters, optimizer state and the batches' float
              fields in double precision (DDP still reduces gradients in its float32 buckets)

Everything else in the replay is as recorded, so a failure that disappears
under a variant is explained by what the variant changed.
"""

from __future__ import annotations

import os

import torch

EXTREME_NORM = 100.0  # a sample this many times the batch's median norm is anomalous


def setup(rt, state, variant: dict) -> None:
    """Before the replayed steps run (the sandbox is up; nothing here needs it down)."""
    cpus = (variant.get("cpus") or {}).get(str(rt.rank))
    if cpus:
        os.sched_setaffinity(0, cpus)
    opt = rt.main_opt
    if opt is None:
        return
    hooks = []
    if variant.get("float64"):
        to_float64(rt, opt)
        if rt.replicated and rt.world > 1:
            hooks.append(_average_gradients(opt))
    if variant.get("lr_factor") is not None:
        cap = [g["lr"] * float(variant["lr_factor"]) for g in opt.param_groups]

        def hold_lr(o, args, kwargs):
            if o is opt:
                for g, c in zip(o.param_groups, cap):
                    g["lr"] = min(g["lr"], c)
        hooks.append(hold_lr)
    if variant.get("clip") is not None:
        limit = float(variant["clip"])

        def clip(o, args, kwargs):
            if o is opt:
                torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], limit)
        hooks.append(clip)
    if hooks:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # Registered after any the program made, so they see its final word.
        for h in hooks:
            register_optimizer_step_pre_hook(h)
    if variant.get("trace"):
        from .optrace import OpTrace

        k = int(variant["trace"]["failing_step"])
        current = lambda: rt.step + 1  # the step being run
        tracer = OpTrace(current, lambda: k - 1 <= current() <= k,
                         lambda: sum(1 for c in state.colls if c["step"] == current()), k)
        tracer.hook_modules()
        tracer.__enter__()  # for the rest of this child's life
        state.tracer = tracer


def batch(rt, state, variant: dict, idx: int, b):
    """The batch step rt.step + 1 trains on, under the variant."""
    step, window = rt.step + 1, state.window.batches
    trace = variant.get("trace")
    if trace and step == int(trace["failing_step"]):
        found = anomalies(b, embedding_sizes(rt))
        state.extra["batch_anomalies"] = found
        state.extra["batch_index"] = idx
        bad = {a["sample"] for a in found}
        state.extra["sample_digests"] = {i: d for i, d in enumerate(row_digests(b)) if i in bad}
    swap = variant.get("swap_batch")
    if swap and step == swap["step"] and rt.rank in swap["ranks"]:
        other = idx - 1 if (idx - 1) in window else idx + 1
        if other in window and not isinstance(window[other], str):
            state.extra["swapped"] = {"step": step, "batch_index": idx, "with_batch_index": other}
            b = _map(window[other], lambda t: t.clone())
    if variant.get("float64"):
        b = _map(b, lambda t: t.double() if t.is_floating_point() else t)
    drop = variant.get("drop_rows")
    rows = (drop or {}).get("rows", {}).get(str(rt.rank)) if drop and step == drop["step"] else None
    if rows:
        b = without_rows(b, rows)
        state.extra["dropped"] = {"step": step, "batch_index": idx, "rows": rows}
    return b


def to_float64(rt, opt) -> None:
    """The model and its optimizer in double precision, in place: the
    Parameter objects stay the ones the optimizer and DDP hold."""
    for m in (rt.modules or {}).values():
        m.double()
    for st in opt.state.values():
        for key, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim():
                st[key] = v.double()


def _average_gradients(opt):
    """DDP's gradient hooks stay with the float32 parameters the cast
    replaced, so replicas would train on their own gradients: average them
    here, in one collective.  Gradients that are already averaged (DDP did
    it, or the program's own all_reduce) come out the same."""
    import torch.distributed as dist

    def average(o, args, kwargs):
        if o is not opt:
            return
        grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for t, part in zip(grads, flat.split([t.numel() for t in grads])):
            t.copy_(part.view_as(t))
    return average


def _map(b, fn):
    if isinstance(b, torch.Tensor):
        return fn(b)
    if isinstance(b, (list, tuple)):
        return type(b)(_map(x, fn) for x in b)
    if isinstance(b, dict):
        return {k: _map(v, fn) for k, v in b.items()}
    return b


def _fields(b, prefix=""):
    if isinstance(b, torch.Tensor):
        yield prefix or "0", b
    elif isinstance(b, (list, tuple)):
        for i, x in enumerate(b):
            yield from _fields(x, f"{prefix}{i}" if not prefix else f"{prefix}.{i}")
    elif isinstance(b, dict):
        for k, x in b.items():
            yield from _fields(x, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")


def row_digests(b) -> list[int]:
    """One digest per sample (row along dim 0 of every field of the batch's
    size), over the raw bits: the same sample met again, in another epoch or
    on another rank, has the same digest."""
    n = batch_size(b)
    out = [0] * n
    for _, t in _fields(b):
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
    return _map(b, lambda t: t.index_select(0, keep) if t.dim() and t.shape[0] == n else t)


def batch_size(b) -> int:
    sizes = [t.shape[0] for _, t in _fields(b) if t.dim()]
    return max(set(sizes), key=sizes.count) if sizes else 0


def embedding_sizes(rt) -> list[int]:
    return sorted({m.num_embeddings for m in (rt.modules or {}).values() if isinstance(m, torch.nn.Embedding)})


def anomalies(b, vocab: list[int]) -> list[dict]:
    """Per field, the samples (rows along dim 0) that are unusable as data:
    non-finite values, integer ids outside every embedding table, or a norm
    EXTREME_NORM times the batch median."""
    n = batch_size(b)
    found = []
    for name, t in _fields(b):
        if not t.dim() or t.shape[0] != n or t.numel() == 0:
            continue
        rows = t.detach().reshape(n, -1)
        desc = f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"
        if t.is_floating_point():
            bad = (~torch.isfinite(rows)).sum(dim=1)
            for i in bad.nonzero().flatten().tolist():
                found.append({"field": name, "sample": i, "what": "non_finite", "count": int(bad[i]),
                              "evidence": f"sample {i} has {int(bad[i])} non-finite values in field {name} ({desc})"})
            norms = torch.nan_to_num(rows.double(), nan=0.0, posinf=0.0, neginf=0.0).norm(dim=1)
            med = float(norms.median())
            for i in ((norms > EXTREME_NORM * med) if med > 0 else torch.zeros(n, dtype=torch.bool)).nonzero().flatten().tolist():
                found.append({"field": name, "sample": i, "what": "extreme_norm", "norm": float(norms[i]),
                              "evidence": f"sample {i} of field {name} has norm {float(norms[i]):.3g}, "
                                          f"{float(norms[i]) / med:.0f}x the batch median"})
        elif vocab and not t.is_complex() and t.dtype != torch.bool:
            hi = max(vocab)
            out = ((rows < 0) | (rows >= hi)).sum(dim=1)
            for i in out.nonzero().flatten().tolist():
                found.append({"field": name, "sample": i, "what": "out_of_range", "count": int(out[i]),
                              "evidence": f"sample {i} has {int(out[i])} ids outside [0, {hi}) in field {name}"})
    return found
