"""Op-level tracing of a replayed step (replay children only; never live).

A TorchDispatchMode sees every aten op the step runs, forward and backward;
global module hooks keep the stack of modules being called, so each op gets
the module path the user knows (`blocks.0.mlp.1`).  Per op it keeps the name,
module, phase, output shape, non-finite count and norm, which is enough to
find where a failure starts:

- the first op whose output is non-finite (and whether its inputs were), or
- for a spike without NaN, the first op of the failing step whose output
  norm is DEPART_RATIO times off the same op's in the step before (or, for
  an op the step before did not run, off its own input's).

The culprit op's inputs are kept, so a standalone reproducer can call it again.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEPART_RATIO = 10.0   # an op's output norm changing this much between two steps is a departure
MAX_OPS = 20000       # per step: a runaway loop cannot exhaust the replay's memory
# Ops that move, view or copy values without computing any: a non-finite value
# passing through them was made elsewhere, so none of them is ever the culprit.
# Frames in these trees are not the training program's own: the Python line
# of an op is the innermost frame outside them (outside installed packages
# too, when there is one: a Trainer's loop is not where the bug is).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_THE_PROGRAM = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, contextlib)) + tuple(
    os.path.join(_ROOT, d) + os.sep for d in ("watcher", "replay", "analysis", "uprobes"))
PROGRAMS_OF_OURS = os.path.join(_ROOT, "watcher", "workloads") + os.sep  # the bundled workloads are programs


def program_line() -> dict | None:
    """The innermost frame of the training program on the stack: file, line, function, source."""
    frames = []
    for fr in traceback.extract_stack():
        f = os.path.abspath(fr.filename)
        if not fr.filename.startswith("<") and (f.startswith(PROGRAMS_OF_OURS) or not f.startswith(NOT_THE_PROGRAM)):
            frames.append((f, fr))
    mine = [x for x in frames if "-packages" + os.sep not in x[0]] or frames
    if not mine:
        return None
    f, fr = mine[-1]
    return {"file": f, "line": fr.lineno, "function": fr.name, "source": (fr.line or "").strip()}


PASS_THROUGH = {"detach", "alias", "view", "_unsafe_view", "reshape", "clone", "_to_copy", "copy_", "lift_fresh",
                "lift_fresh_copy", "t", "transpose", "permute", "expand", "slice", "select", "as_strided",
                "contiguous", "split", "split_with_sizes", "unbind", "unsqueeze", "squeeze", "index_select",
                "cat", "stack", "empty_like", "zeros_like", "ones_like", "new_empty", "new_zeros", "_reshape_alias",
                "view_as", "expand_as", "narrow", "chunk", "flatten"}


@contextlib.contextmanager
def untraced():
    """Watcher's own work in a traced replay (checksums, the exchange, scans)
    runs outside the trace: only the program's ops may be blamed."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def module_names() -> dict[int, str]:
    """Every module's path, named from the outermost module that holds it
    (DDP's `module.` prefix dropped: users know their model's names)."""
    mods = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
    children = {id(c) for m in mods for c in m.children()}
    names: dict[int, str] = {}
    for root in sorted((m for m in mods if id(m) not in children), key=lambda m: -sum(1 for _ in m.modules())):
        strip = "module." if type(root).__name__ == "DistributedDataParallel" else None
        for name, m in root.named_modules():
            if strip and name.startswith(strip):
                name = name[len(strip):]
            elif strip and name == "module":
                name = ""
            names.setdefault(id(m), name or type(m).__name__)
    return names


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _nonfinite(t: torch.Tensor) -> int:
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


class OpTrace(TorchDispatchMode):
    """Trace ops while `active()` says so; `step_of()` names the step being run."""

    def __init__(self, step_of, active, colls_of, failing_step: int):
        super().__init__()
        self.step_of, self.active, self.colls_of = step_of, active, colls_of
        self.failing_step = failing_step
        self.first_departure = None
        self.seen: dict[int, dict] = {}
        self.by_key: dict[tuple, dict] = {}
        self.names = module_names()
        self.stack: list[str] = []
        self.ops: dict[int, list] = {}
        self.first_nonfinite = None
        self.culprit_inputs = None
        self._hooks = []

    # -- module stack ----------------------------------------------------------------------------
    def hook_modules(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            self.stack.append(self.names.get(id(module), type(module).__name__))

        def post(module, args, output):
            if self.stack:
                self.stack.pop()
        self._hooks = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]

    # -- ops ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active():
            return out
        step = self.step_of()
        ops = self.ops.setdefault(step, [])
        if len(ops) >= MAX_OPS:
            return out
        outs = [t for t in _tensors(out) if t.is_floating_point()]
        if not outs:
            return out
        bad = sum(_nonfinite(t) for t in outs)
        node = torch._C._current_autograd_node()
        phase = "backward" if node is not None else "forward"
        module = self.stack[-1] if self.stack and phase == "forward" else (node.name() if node is not None else "")
        with torch.no_grad():
            norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in outs if _nonfinite(t) == 0) or 0.0)
        rec = {"i": len(ops), "op": str(func.name()), "module": module, "phase": phase,
               "shape": list(outs[0].shape), "nonfinite": bad, "norm": norm, "colls_before": self.colls_of()}
        # Ops are matched across steps by (phase, module, op, occurrence), so
        # an op inserted in one step does not shift every comparison after it.
        seen = self.seen.setdefault(step, {})
        key = (phase, module, rec["op"])
        rec["n"] = seen[key] = seen.get(key, -1) + 1
        ops.append(rec)
        computes = rec["op"].split("::")[-1].split(".")[0] not in PASS_THROUGH
        if computes and step == self.failing_step and self.first_departure is None and not bad and rec["norm"]:
            before = self.by_key.get((step - 1, *key, rec["n"]))
            if before is not None:
                ref, what = before["norm"], "the same op the step before"
            else:  # an op the step before did not run: judge it by what it did to its input
                first = next((t for t in _tensors(args) if t.is_floating_point() and t.shape == outs[0].shape), None)
                ref = float(first.detach().double().norm()) if first is not None and _nonfinite(first) == 0 else 0.0
                what = "its own input (an op the step before did not run)"
            if ref:
                ratio = rec["norm"] / ref
                if ratio > DEPART_RATIO or ratio < 1 / DEPART_RATIO:
                    self.first_departure = dict(rec, step=step, before_norm=ref, ratio=ratio, compared_with=what)
                    if self.culprit_inputs is None:
                        self.culprit_inputs = _inputs_of(func, args, kwargs)
        self.by_key[(step, *key, rec["n"])] = rec
        if bad and computes and self.first_nonfinite is None:
            ins = list(_tensors((args, kwargs)))
            rec = dict(rec, step=step, inputs_finite=all(_nonfinite(t) == 0 for t in ins),
                       input_shapes=[list(t.shape) for t in ins],
                       line=program_line() if phase == "forward" else None)
            if len(outs[0].shape) >= 1:
                # Which rows (samples, when dim 0 is the batch) went bad first.
                flat = outs[0].detach().reshape(outs[0].shape[0], -1)
                rec["bad_rows"] = [int(i) for i in (~torch.isfinite(flat)).any(dim=1).nonzero().flatten()[:64]]
            self.first_nonfinite = rec
            # A non-finite output outranks a departure as the culprit.
            self.culprit_inputs = _inputs_of(func, args, kwargs)
        return out

    def summary(self) -> dict:
        return {"first_nonfinite": self.first_nonfinite, "departure": self.first_departure,
                "ops_per_step": {k: len(v) for k, v in self.ops.items()},
                "culprit_inputs": self.culprit_inputs}


def _inputs_of(func, args, kwargs) -> dict:
    return {"op": str(func.name()), "args": _clone(args), "kwargs": _clone(kwargs)}
