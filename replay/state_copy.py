"""State copies: the training state at a step, in memory a fork snapshot shares.

A fork snapshot is a full image of the rank, but it costs a fork plus the
copy-on-write faults of the next step (~25-40 ms here), so at a 1% budget one
is taken every 64-128 steps, and a replay from it re-executes that many steps.
A state copy holds only what a step changes (parameters, optimizer state,
hyperparameters, module buffers, LR scheduler state, the RNG, and the
runtime's own counters), written into a shared mapping made before the first
fork: ~0.5 ms for the reference model, so one can be taken every few steps.

A replay then wakes the newest fork snapshot before the copy, loads the copy
into it, and re-executes only the steps after the copy.  What the copy cannot
carry is the program's other Python state (its loop counter, its own
variables), which stays as it was at the fork.  So a replay from a copy is
trusted only after it has re-executed at least one step exactly as recorded
(replay/coordinator.py), and otherwise is done again from the fork.

Layout: `SLOTS` slots, each a header, a pickled description (META_CAP bytes at
most) and the tensor bytes back to back.  A slot's header names its step last,
after its bytes are written, so a rank killed mid-copy leaves that slot
invalid, never half-valid.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import pickle
import struct
import time

import torch

from ..runtime.control import AGREE_EVERY
from ..runtime.seam import Rank
from ..runtime.training import optimizer_params, scan_training_objects
from ..runtime.wordsum import LIB

SLOTS = 2
HEADER = struct.Struct("<IqQQ")  # magic, step (-1: none), description bytes, tensor bytes
MAGIC = 0x57435059
HEADER_BYTES = 64
META_CAP = 1 << 18
MAX_MB = float(os.environ.get("WATCHER_STATE_COPY_MAX_MB", "2048"))


class CopyUnusable(Exception):
    """This copy cannot be loaded into this process (its tensors differ)."""


def _tensors(rt: Rank) -> list:
    """Every tensor a step changes, in an order both forks of a process agree
    on: parameters, their optimizer state (in the state dict's own order), and
    the buffers of the modules holding them."""
    opt = rt.main_opt
    params = optimizer_params(opt)
    tensors = list(params)
    state = opt.state
    for p in params:
        st = state.get(p)
        if st:
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    for mod in rt.modules.values() if rt.modules else ():
        tensors.extend(b for b in mod._buffers.values() if b is not None)
    return tensors


def _describe(rt: Rank, tensors: list) -> list:
    """What each tensor is and holds, for the other side to check it holds the same."""
    opt = rt.main_opt
    params = optimizer_params(opt)
    names = [("param", i) for i in range(len(params))]
    for i, p in enumerate(params):
        names.extend(("opt", i, k) for k, v in (opt.state.get(p) or {}).items() if isinstance(v, torch.Tensor))
    for mid, mod in (rt.modules or {}).items():
        names.extend(("buffer", mid, n) for n, b in mod._buffers.items() if b is not None)
    return [n + (str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in zip(names, tensors)]


def _python_state(rt: Rank, schedulers: list, other: list) -> dict:
    """The non-tensor part, small enough to pickle at every copy.  `other`:
    (parameter index, key) of the optimizer state that is not a tensor."""
    opt = rt.main_opt
    params = optimizer_params(opt) if other else ()
    hyper = [{k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
              for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {**rt.counters(),
            "rng": torch.get_rng_state().numpy().tobytes(), "hyper": hyper,
            "opt_other": [(i, k, opt.state[params[i]].get(k)) for i, k in other],
            "schedulers": [s.state_dict() for s in schedulers]}


class StateCopies:
    """The shared slots, made in the live rank before its first fork snapshot."""

    def __init__(self, rt: Rank):
        tensors = _tensors(rt)
        need = sum(t.numel() * t.element_size() for t in tensors)
        self.capacity = int(need * 1.25) + (1 << 20)  # room for state created later (a new param's moments)
        self.slot_bytes = HEADER_BYTES + META_CAP + self.capacity
        self.mm = mmap.mmap(-1, SLOTS * self.slot_bytes)  # MAP_SHARED: every later fork sees the writes
        self._base = ctypes.c_ubyte.from_buffer(self.mm)   # keeps the mapping's address for wordsum.c
        self.addr = ctypes.addressof(self._base)
        # Touch every page now (a few ms, once, at the first snapshot): a
        # slot's first copy would otherwise pay its page faults, ~10x a copy,
        # and the interval would adapt to that.
        ctypes.memset(self.addr, 0, len(self.mm))
        for s in range(SLOTS):
            self._header(s, -1, 0, 0)
        # LR schedulers hold counters a copy must carry; the runtime found
        # them in its one scan of every object (runtime/training.py).
        self.schedulers = rt.schedulers
        if self.schedulers is None:
            self.schedulers = scan_training_objects(optimizer_params(rt.main_opt), rt.main_opt)[1]
        self.steps = [-1] * SLOTS      # what each slot holds, as the live rank wrote it
        self.next_slot = 0
        self.cost_ns: list[int] = []
        self.n_costs = 0               # costs measured so far (CopyPolicy works the interval out on a new one)
        self.off_reason = None if need <= MAX_MB * (1 << 20) else f"training state over {MAX_MB:.0f} MB"
        self._key = None              # what the cached description below was made for
        self._ptrs = self._sizes = None
        self._desc = self._desc_bytes = None
        self._other: list = []
        self._size = 0
        self._relayout_ns = None
        self.last_ns = 0

    def _header(self, slot: int, step: int, meta_len: int, data_len: int) -> None:
        self.mm[slot * self.slot_bytes: slot * self.slot_bytes + HEADER.size] = HEADER.pack(MAGIC, step, meta_len,
                                                                                            data_len)

    def held(self) -> list[int]:
        return sorted(s for s in self.steps if s >= 0)

    def forget(self) -> None:
        """After a recovery the copies hold the faulty run's state."""
        for s in range(SLOTS):
            self._header(s, -1, 0, 0)
        self.steps = [-1] * SLOTS

    def _layout(self, rt, tensors: list) -> bool:
        """Describe the tensors again when any of them moved or changed size."""
        key = [(t.data_ptr(), t.numel()) for t in tensors]
        self._relayout_ns = None
        if key == self._key:
            return True
        self._relayout_ns = time.perf_counter_ns()
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            self.off_reason = "the training state is not contiguous CPU memory"
            return False
        self._key = key
        self._desc = _describe(rt, tensors)
        self._desc_bytes = pickle.dumps(self._desc, protocol=5)
        self._size = sum(d[-1] for d in self._desc)
        self._ptrs = (ctypes.c_uint64 * len(key))(*(p for p, _ in key))
        self._sizes = (ctypes.c_uint64 * len(key))(*(d[-1] for d in self._desc))
        opt = rt.main_opt
        params = optimizer_params(opt)
        self._other = [(i, k) for i, p in enumerate(params) for k, v in (opt.state.get(p) or {}).items()
                       if not isinstance(v, torch.Tensor)]
        return True

    def take(self, rt, k: int) -> bool:
        """Copy the state at the end of step k into the next slot; False if it does not fit."""
        t0 = time.perf_counter_ns()
        tensors = _tensors(rt)
        if not self._layout(rt, tensors):
            return False
        if self._size > self.capacity:
            self.off_reason = "the training state outgrew its copy slots"
            return False
        py = pickle.dumps(_python_state(rt, self.schedulers, self._other), protocol=5)
        meta = len(self._desc_bytes).to_bytes(8, "little") + self._desc_bytes + py
        if len(meta) > META_CAP:
            self.off_reason = f"the non-tensor state is over {META_CAP >> 10} KB"
            return False
        slot = self.next_slot
        self.next_slot = (slot + 1) % SLOTS
        base = slot * self.slot_bytes
        self._header(slot, -1, 0, 0)
        self.steps[slot] = -1
        data = base + HEADER_BYTES + META_CAP
        if LIB is not None:
            LIB.ws_gather(self.addr + data, self._ptrs, self._sizes, len(tensors))
        else:
            buf = torch.frombuffer(self.mm, dtype=torch.uint8, count=self._size, offset=data)
            off = 0
            with torch.no_grad():
                for t, d in zip(tensors, self._desc):
                    n = d[-1]
                    buf[off:off + n].copy_(t.detach().reshape(-1).view(torch.uint8))
                    off += n
        self.mm[base + HEADER_BYTES: base + HEADER_BYTES + len(meta)] = meta
        self._header(slot, k, len(meta), self._size)
        self.steps[slot] = k
        self.last_ns = time.perf_counter_ns() - t0
        if self._relayout_ns is None:  # a copy that described the tensors anew costs more: not the usual cost
            self.cost_ns.append(self.last_ns)
            self.n_costs += 1
        if len(self.cost_ns) > 16:
            del self.cost_ns[:8]
        return True

    # -- in a replay child (a fork of the rank that made the slots) ---------------------------
    @torch.no_grad()
    def load(self, rt: Rank, step: int) -> None:
        """Overwrite this process's training state with the copy of `step`."""
        for slot in range(SLOTS):
            base = slot * self.slot_bytes
            magic, held, meta_len, size = HEADER.unpack_from(self.mm, base)
            if magic == MAGIC and held == step:
                break
        else:
            raise CopyUnusable(f"no state copy of step {step} is held")
        raw = self.mm[base + HEADER_BYTES: base + HEADER_BYTES + meta_len]
        n = int.from_bytes(raw[:8], "little")
        desc, py = pickle.loads(raw[8:8 + n]), pickle.loads(raw[8 + n:])
        tensors = _tensors(rt)
        if [tuple(d) for d in desc] != [tuple(d) for d in _describe(rt, tensors)]:
            raise CopyUnusable(f"the copy of step {step} holds other tensors than the snapshot it is loaded into")
        if len(py["seqs"]) != len(rt.groups) or len(py["schedulers"]) != len(self.schedulers):
            raise CopyUnusable("process groups or LR schedulers were created after the snapshot")
        buf = torch.frombuffer(self.mm, dtype=torch.uint8, count=size, offset=base + HEADER_BYTES + META_CAP)
        off = 0
        for t, d in zip(tensors, desc):
            n = d[-1]
            t.view(-1).view(torch.uint8).copy_(buf[off:off + n])
            off += n
        opt = rt.main_opt
        params = optimizer_params(opt)
        for i, k, v in py["opt_other"]:
            opt.state[params[i]][k] = v
        for g, hyper in zip(opt.param_groups, py["hyper"]):
            for k, v in hyper.items():
                if isinstance(g.get(k), torch.Tensor):
                    g[k].fill_(v)
                else:
                    g[k] = v
        for s, sd in zip(self.schedulers, py["schedulers"]):
            s.load_state_dict(sd)
        torch.set_rng_state(torch.frombuffer(bytearray(py["rng"]), dtype=torch.uint8))
        rt.restore_counters({k: py[k] for k in ("step", "fetch_idx", "seqs")})


class CopyPolicy:
    """Copy every `interval` steps (a power of two, so ranks agree on the
    steps), chosen so the copies' cost stays within `budget` of step time."""

    def __init__(self, budget: float):
        self.budget = max(budget, 1e-5)
        forced = os.environ.get("WATCHER_COPY_INTERVAL")
        self.forced = int(forced) if forced else None
        self.interval = self.forced or 2
        self._seen = 0  # copies.n_costs when the interval was last worked out

    def due(self, k: int, rt: Rank, copies: StateCopies) -> bool:
        # Worked out again only when a copy's cost came in, or every
        # AGREE_EVERY steps (a peer's wish may have grown): not every step.
        fresh = copies.n_costs != self._seen or k % AGREE_EVERY == 0
        if fresh and not self.forced and copies.cost_ns and len(rt.step_ns) >= 3:
            self._seen = copies.n_costs
            med = sorted(rt.step_ns)[len(rt.step_ns) // 2]
            cost = sorted(copies.cost_ns)[len(copies.cost_ns) // 2]
            want = math.ceil(cost / max(self.budget * med, 1))
            self.interval = 1 << max(1, (max(want, 1) - 1).bit_length())
            ctl = getattr(rt, "ctl", None)
            if ctl is not None:
                self.interval = ctl.agree_interval(rt.rank, rt.world, self.interval)
        return k % self.interval == 0
