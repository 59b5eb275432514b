"""A ProcessGroup that records every collective, or answers it from the record.

`WatchedGroup` is a Python subclass of c10d's ProcessGroup wrapping the real
group.  Installed as the default group (and so DDP's group) and around every
`new_group`, it sees the user's `dist.*` calls, DDP's gradient allreduces and
its buffer broadcasts alike.

- live: checksum the inputs, call the real group, and when the work completes
  checksum and keep a copy of the outputs (for the replay window).
- replay: never touch the network (gloo's threads do not survive fork anyway):
  compare the replayed inputs' checksum with the record, write the recorded
  outputs into the output tensors and return an already-completed work.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import relink
from .checksum import BufferPool, clone_with_sum, tensors_sum


def _flat(x) -> list:
    out = []
    for t in x:
        if isinstance(t, (list, tuple)):
            out.extend(_flat(t))
        elif isinstance(t, torch.Tensor):
            out.append(t)
    return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
         os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "replay") + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_LIBRARY_MARKS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep, "<frozen ")


_SKIP, _LIBRARY, _USER = 0, 1, 2
_FILE_KIND: dict[str, int] = {}  # source file -> which of the above; a rank runs a few hundred files


def _file_kind(name: str) -> int:
    """Classify a source file not seen before, and remember it."""
    if name.startswith(_TORCH_DIR) or name.startswith(_OURS):
        kind = _SKIP
    elif any(m in name for m in _LIBRARY_MARKS) or name.startswith(_STDLIB):
        kind = _LIBRARY
    else:
        kind = _USER
    _FILE_KIND[name] = kind
    return kind


def call_site() -> str | None:
    """file:line of the code that issued the collective: the innermost frame
    outside torch and Watcher, preferring the user's own code over libraries
    (Lightning's loop, for one).  DDP's allreduces are issued from autograd
    hooks, so theirs is the user's `backward()` line.  Each file is
    classified once: a frame then costs one dict lookup (the walk passes
    ten to twenty frames of torch, ~25 us a call with the step's cache
    misses when every frame's name was matched against the prefixes)."""
    f = sys._getframe(2)
    fallback = None
    kinds = _FILE_KIND
    while f is not None:
        name = f.f_code.co_filename
        kind = kinds.get(name)
        if kind is None:
            kind = _file_kind(name)
        if kind == _USER:
            return f"{name}:{f.f_lineno}"
        if kind == _LIBRARY and fallback is None:
            fallback = f"{name}:{f.f_lineno}"
        f = f.f_back
    return fallback


_NAMES: dict = {}  # dtype or reduce op -> its short name ("float32", "SUM"), made once


def _name(x) -> str:
    name = _NAMES.get(x)
    if name is None:
        name = _NAMES[x] = str(x).split(".")[-1]
    return name


class HandedWork(dist.Work):
    """A watched collective's work as training gets it, completed by Watcher
    once the outputs are recorded (or the collective was retried).  A failure
    must reach training as the failure it is: c10d's wrapper of a future
    neither raises it from wait() (a plain all_reduce would go on with
    unreduced tensors) nor fails in C++ (a Python future's exception is its
    value there, and DDP's reducer reads tensors out of it and crashes).  So
    `waited` completes the work's future through then(): a callback that
    raises fails the future in C++, and wait() raises it here."""

    def __init__(self, waited: torch.futures.Future):
        super().__init__()
        self.fut = waited.then(_unwrap)

    def wait(self, timeout=None) -> bool:
        self.fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.fut

    def is_completed(self) -> bool:
        return self.fut.done()

    def result(self):
        return self.fut.value()


def _unwrap(fut):
    return fut.value()  # raises the failure set on `waited`


def done_work(result):
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


# op name -> (inputs, outputs) picked from the call's arguments
_SIGNATURES = {
    "allreduce": lambda a: (a[0], a[0]),
    "allreduce_coalesced": lambda a: (a[0], a[0]),
    "broadcast": lambda a: (a[0], a[0]),
    "reduce": lambda a: (a[0], a[0]),
    "allgather": lambda a: (a[1], a[0]),
    "_allgather_base": lambda a: ([a[1]], [a[0]]),
    "allgather_into_tensor_coalesced": lambda a: (a[1], a[0]),
    "allgather_coalesced": lambda a: (a[1], a[0]),
    "reduce_scatter": lambda a: (a[1], a[0]),
    "_reduce_scatter_base": lambda a: ([a[1]], [a[0]]),
    "reduce_scatter_tensor_coalesced": lambda a: (a[1], a[0]),
    "alltoall": lambda a: (a[1], a[0]),
    "alltoall_base": lambda a: ([a[1]], [a[0]]),
    "gather": lambda a: (a[1], a[0]),
    "scatter": lambda a: (a[1], a[0]),
    "barrier": lambda a: ([], []),
    "send": lambda a: (a[0], []),
    "recv": lambda a: ([], a[0]),
    "recv_anysource": lambda a: ([], a[0]),
}


# Collectives whose outputs a coordinated replay computes from every rank's
# replayed inputs (replay/exchange.py): the window keeps only their output
# checksum.  Every other op's outputs are kept, to be served in a replay.
COMPUTED_IN_REPLAY = frozenset({"allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
                                "barrier", "reduce_scatter", "_reduce_scatter_base", "alltoall", "alltoall_base"})


def computed_in_replay(meta: dict) -> bool:
    """Does a replay compute this collective's outputs (replay/exchange.py),
    so the record keeps only their checksum?  An all-to-all with uneven
    splits keeps its outputs."""
    return (meta["op"] in COMPUTED_IN_REPLAY and not meta.get("splits")
            and meta.get("reduce_op", "SUM") in ("SUM", "PRODUCT", "MAX", "MIN"))


# Collectives whose transport overwrites their inputs as it goes.
REDUCED_IN_PLACE = frozenset({"allreduce", "allreduce_coalesced"})


class WatchedGroup(dist.ProcessGroup):
    def __init__(self, inner: dist.ProcessGroup, runtime, gid: str):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.rt = runtime
        self.gid = gid
        self.seq = 0
        self.ranks = list(range(inner.size()))  # global ranks by group rank; set by wrap()
        self.gloo = None                        # is the transport gloo (rebuildable)? see relink.py
        self.sockets: set[int] = set()          # the transport's socket inodes (transport.py)
        self.spares = BufferPool()              # for the retry copies of in-place reductions

    def _call(self, op: str, args: tuple):
        rt = self.rt
        if rt.disabled or (rt.mode == "live" and rt.is_paused()):
            return getattr(self.inner, op)(*args)
        t0 = time.perf_counter_ns()
        try:
            ins, outs = _SIGNATURES[op](args)
            ins, outs = _flat(ins), _flat(outs)
            for stage, fn in rt.fault_hooks:  # drills only
                if stage == "collective_input":
                    fn(rt, op, ins)
            # A reduction works in place: one aborted halfway (per-operation
            # timeout) has already summed part of its peers' data into its
            # inputs.  A copy taken now lets a retry start from what was issued
            # (~0.05 ms per MB here); the checksum is summed while copying.
            relinkable = relink.can_relink(rt, self)
            if relinkable and op in REDUCED_IN_PLACE:
                saved, in_sum = clone_with_sum(ins, self.spares)
            else:
                saved, in_sum = None, tensors_sum(ins)
            self.seq += 1
            some = ins or outs
            meta = {"group": self.gid, "seq": self.seq, "op": op, "step": rt.step + 1,
                    "numel": sum(t.numel() for t in some),
                    "dtype": _name(some[0].dtype) if some else None,
                    "in_sum": in_sum, "site": call_site(), "ts": time.monotonic_ns()}
            red = getattr(args[-1], "reduceOp", None) if args else None
            if red is not None:
                meta["reduce_op"] = _name(getattr(red, "op", red))
            root = getattr(args[-1], "rootRank", None) if args else None
            if root is not None:
                meta["root"] = root
            if op == "alltoall_base" and (args[2] or args[3]):
                meta["splits"] = True
        except Exception as e:
            rt.fail(e)
            return getattr(self.inner, op)(*args)
        if rt.mode == "replay":
            return rt.replay.collective(rt, meta, ins, outs, self.ranks)
        try:
            rt.before_collective(meta)
            rt.in_flight += 1
        except Exception as e:
            rt.fail(e)
        retry = None
        if relinkable:
            def retry(error, _op=op, _args=args, _meta=meta, _ins=ins, _saved=saved):
                return relink.relink(rt, self, _op, _args, _meta, _ins, error, _saved)
        rt.own_ns += time.perf_counter_ns() - t0
        try:
            work = getattr(self.inner, op)(*args)
        except RuntimeError as e:  # a transport already known dead fails at issue
            if retry is None:
                raise
            try:
                result = retry(e)  # raises e when the collective cannot be retried
            except Exception:
                raise e from None  # whatever happened in Watcher, training sees the real failure
            rt.track_collective(meta, outs, None, release=self._release(saved))
            return done_work(result)
        if rt.disabled:
            return work
        t0 = time.perf_counter_ns()
        try:
            if any(stage == "collective_output" for stage, _ in rt.fault_hooks):
                # Drills corrupting an output must do it before anyone reads it:
                # complete the work here and hand back a finished one.
                work.wait()
                rt.track_collective(meta, outs, None)
                return done_work(outs)
            return rt.track_collective(meta, outs, work, retry, group=self, release=self._release(saved))
        except Exception as e:
            rt.fail(e)
            return work
        finally:
            rt.own_ns += time.perf_counter_ns() - t0

    def _release(self, saved):
        """What hands a retry copy back to the spares once the collective is recorded (no retry can need it)."""
        return None if saved is None else (lambda: self.spares.give(saved))

    def replace_inner(self, new) -> None:
        """Put a rebuilt transport under this wrapper (see relink.py)."""
        self.inner = new
        try:
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, new)
        except Exception:
            pass  # c10d keeps the first registration; every collective goes through self.inner anyway

    def __repr__(self) -> str:
        return f"WatchedGroup({self.gid}, rank={self.rank()}, size={self.size()})"


def _method(op: str):
    def method(self, *args, **kwargs):
        # c10d passes trailing options by keyword (barrier(opts=...)).
        return self._call(op, args + tuple(kwargs.values()))
    method.__name__ = op
    return method


# Real methods on the class (not __getattr__ tricks): the C++ side (DDP's
# reducer) finds Python overrides by looking them up on the type.
for _op in _SIGNATURES:
    setattr(WatchedGroup, _op, _method(_op))


def wrap(inner: dist.ProcessGroup, runtime) -> WatchedGroup:
    """Wrap a real group and register the wrapper in c10d's world tables
    under the same name and ranks, so `dist.*` helpers accept it."""
    # c10d's group name is the same on every member rank, so it keys the record.
    w = WatchedGroup(inner, runtime, str(c10d._world.pg_names.get(inner, "?")))
    dev = torch.device("cpu")
    try:
        backend = inner._get_backend(dev)
        w._register_backend(dev, dist.ProcessGroup.BackendType.GLOO, backend)
        w._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    except Exception:
        pass  # not a gloo/CPU group: the wrapper still forwards every collective
    world = c10d._world
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag):
        if inner in table:
            table[w] = table[inner]
    group_ranks = world.pg_group_ranks.get(inner)  # {global rank: group rank}
    if group_ranks:
        w.ranks = sorted(group_ranks, key=group_ranks.get)
    return w
