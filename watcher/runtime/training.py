"""The training objects a rank's runtime tracks: the main optimizer's
parameters, the modules that own them and the LR schedulers that drive it.

Snapshots, state copies, merges and counterfactual replays all address the
training state through these, in the same order in every fork of a rank.
"""

from __future__ import annotations

import gc
import warnings

import torch


def optimizer_params(opt) -> list:
    """Every parameter of the optimizer, in its param groups' order."""
    return [p for g in opt.param_groups for p in g["params"]]


def modules_holding(params: list) -> dict[int, torch.nn.Module]:
    """Every module that owns one of these parameters, by id."""
    return scan_training_objects(params, None)[0]


def scan_training_objects(params: list, opt) -> tuple[dict[int, torch.nn.Module], list]:
    """Every module that owns one of these parameters (by id), and the LR
    schedulers driving `opt` (state copies carry their counters).  A scan of
    every object (~100 ms in a rank), so the runtime does it once, before its
    first snapshot: replays forked later inherit the answer."""
    want = {id(p) for p in params}
    found, schedulers = {}, []
    sched = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or torch.optim.lr_scheduler._LRScheduler
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.nn.Module):
                if any(id(p) in want for p in obj.parameters(recurse=False)):
                    found[id(obj)] = obj
            elif opt is not None and isinstance(obj, sched) and getattr(obj, "optimizer", None) is opt:
                schedulers.append(obj)
    return found, schedulers
