"""Moving the training state from a replay child into the live rank (Track A).

The replay child and the live rank are forks of one process, so they hold
the same optimizer, parameters and modules: tensors are matched by their
position in the main optimizer (parameters, gradients, optimizer state,
hyperparameters) and modules by identity (their ids are equal in both
processes, the snapshot being a fork taken after the model was built), and
the child's values are copied into the live tensors in place.  Nothing the
training script holds is replaced, only overwritten.
"""

from __future__ import annotations

import torch

from ..runtime.checksum import params_sum
from ..runtime.seam import Rank
from ..runtime.training import optimizer_params


def training_state(rt: Rank) -> dict:
    """What one step of training changes, as of now (in the replay child)."""
    opt = rt.main_opt
    params = optimizer_params(opt)
    state = []
    for p in params:
        st = opt.state.get(p, {})
        state.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()})
    buffers = {}
    for mid, mod in (rt.modules or {}).items():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None:
                buffers[f"{mid}:{name}"] = b.detach().clone()
    return {"params": [p.detach().clone() for p in params],
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
            "opt_state": state,
            "hyper": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "buffers": buffers, "rng": torch.get_rng_state(), "param_sum": params_sum(params)}


@torch.no_grad()
def merge_state(rt, st: dict) -> int:
    """Overwrite the live rank's training state with `st`; returns the
    parameter checksum it then holds (the caller compares it with st's)."""
    opt = rt.main_opt
    params = optimizer_params(opt)
    if len(params) != len(st["params"]):
        raise ValueError(f"the replay holds {len(st['params'])} parameters, the live rank {len(params)}")
    for p, v, g in zip(params, st["params"], st["grads"]):
        p.copy_(v)
        if g is None:
            p.grad = None
        elif p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    for p, saved in zip(params, st["opt_state"]):
        live = opt.state.setdefault(p, {})
        for k, v in saved.items():
            cur = live.get(k)
            if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape \
                    and cur.dtype == v.dtype:
                cur.copy_(v)
            else:
                live[k] = v
    for g, hyper in zip(opt.param_groups, st["hyper"]):
        for k, v in hyper.items():
            if isinstance(g.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                g[k].copy_(v)
            else:
                g[k] = v
    if st["buffers"]:
        mods = rt.modules or {}
        for key, v in st["buffers"].items():
            mid, name = key.split(":", 1)
            mod = mods.get(int(mid))
            b = getattr(mod, name, None) if mod is not None else None
            if isinstance(b, torch.Tensor):
                b.copy_(v)
    torch.set_rng_state(st["rng"])
    for stage, fn in rt.fault_hooks:  # drills only: a fault during the merge itself
        if stage == "after_merge":
            fn(rt, params)
    return params_sum(params)
