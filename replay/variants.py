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
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.samples import batch_size, fields, map_fields, row_digests, without_rows
from ..runtime.seam import Rank
from ..runtime.training import optimizer_params
from .optrace import OpTrace

EXTREME_NORM = 100.0  # a sample this many times the batch's median norm is anomalous


def setup(rt: Rank, state, variant: dict) -> None:
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
                torch.nn.utils.clip_grad_norm_(optimizer_params(o), limit)
        hooks.append(clip)
    if hooks:
        # Registered after any the program made, so they see its final word.
        for h in hooks:
            register_optimizer_step_pre_hook(h)
    if variant.get("trace"):
        k = int(variant["trace"]["failing_step"])
        current = lambda: rt.step + 1  # the step being run
        tracer = OpTrace(current, lambda: k - 1 <= current() <= k,
                         lambda: sum(1 for c in state.colls if c["step"] == current()), k)
        tracer.hook_modules()
        tracer.__enter__()  # for the rest of this child's life
        state.tracer = tracer


def batch(rt: Rank, state, variant: dict, idx: int, b):
    """The batch step rt.step + 1 trains on, under the variant."""
    step, window = rt.step + 1, state.window.batches
    trace = variant.get("trace")
    if trace and step == int(trace["failing_step"]):
        found = anomalies(b, embedding_sizes(rt))
        state.extra["batch_anomalies"] = found
        state.extra["batch_index"] = idx
        bad = {a["sample"] for a in found}
        digests = row_digests(b)
        state.extra["sample_digests"] = {i: d for i, d in enumerate(digests) if i in bad}
        # Every row's: a bug the data triggers names its samples by the rows its first bad op spoiled.
        state.extra["row_digests"] = [str(d) for d in digests]
    swap = variant.get("swap_batch")
    if swap and step == swap["step"] and rt.rank in swap["ranks"]:
        other = idx - 1 if (idx - 1) in window else idx + 1
        if other in window and not isinstance(window[other], str):
            state.extra["swapped"] = {"step": step, "batch_index": idx, "with_batch_index": other}
            b = map_fields(window[other], lambda t: t.clone())
    if variant.get("float64"):
        b = map_fields(b, lambda t: t.double() if t.is_floating_point() else t)
    drop = variant.get("drop_rows")
    rows = (drop or {}).get("rows", {}).get(str(rt.rank)) if drop and step == drop["step"] else None
    if rows:
        b = without_rows(b, rows)
        state.extra["dropped"] = {"step": step, "batch_index": idx, "rows": rows}
    return b


def to_float64(rt: Rank, opt) -> None:
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

    def average(o, args, kwargs):
        if o is not opt:
            return
        grads = [p.grad for p in optimizer_params(o) if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for t, part in zip(grads, flat.split([t.numel() for t in grads])):
            t.copy_(part.view_as(t))
    return average


def embedding_sizes(rt: Rank) -> list[int]:
    return sorted({m.num_embeddings for m in (rt.modules or {}).values() if isinstance(m, torch.nn.Embedding)})


def anomalies(b, vocab: list[int]) -> list[dict]:
    """Per field, the samples (rows along dim 0) that are unusable as data:
    non-finite values, integer ids outside every embedding table, or a norm
    EXTREME_NORM times the batch median."""
    n = batch_size(b)
    found = []
    for name, t in fields(b):
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
