"""Cheap, exact checksums of tensors.

sha256 over every collective input cost about 6 ms a step; summing the raw
bits as 32-bit words, wrapping, is one vectorised pass (0.02 ms for 1 MB here,
7x faster than widening to int64).  A flipped bit changes the sum by a power
of two below 2^32, so any single-bit corruption is caught, and equal tensors
always give equal sums (the check is over bits: -0.0 and 0.0 differ, NaNs compare).
"""

from __future__ import annotations

import ctypes
import math
import zlib

import torch

from .wordsum import LIB

_MASK = (1 << 63) - 1
_FLT_MAX = 3.4028234663852886e38
_WORD = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Dtypes whose memory is whole 32-bit words: summed by wordsum.c in one pass when it is loaded.
_WORDS = {torch.float32: 1, torch.int32: 1, torch.float64: 2, torch.int64: 2}


def _words(t: torch.Tensor) -> int | None:
    """How many 32-bit words `t` is, when wordsum.c can read it directly."""
    # is_cpu, not device.type: the latter builds a string (~0.5 us a call here).
    if LIB is None or not t.is_cpu or t.layout != torch.strided or not t.is_contiguous():
        return None
    per = _WORDS.get(t.dtype)
    return t.numel() * per if per else None


def tensor_sum(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    n = _words(t)
    if n is not None:  # reads memory only: no detached view needed
        return (LIB.ws_sum(t.data_ptr(), n) * 31 + t.numel()) & _MASK
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    word = _WORD.get(flat.element_size(), torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        word = _WORD.get(flat.element_size(), torch.uint8)
    acc = torch.int32 if word == torch.int32 else torch.int64
    return ((int(torch.sum(flat.view(word), dtype=acc)) & 0xFFFFFFFF) * 31 + t.numel()) & _MASK


def tensors_sum(ts) -> int:
    acc = 0
    for t in ts:
        acc = (acc * 1000003 + tensor_sum(t)) & _MASK
    return acc


def tensors_sum_sumsq(ts) -> tuple[int, float | None, int]:
    """`tensors_sum(ts)`, and for float32 tensors their sum of squares and
    count, read in the same pass (wordsum.c): a reduced gradient's checksum
    and its part of the gradient norm (see ReducedGradNorm).  The sum of
    squares is None where the tensors are not all float32 or wordsum.c is
    not loaded."""
    if LIB is None or not ts or any(t.dtype != torch.float32 for t in ts):
        return tensors_sum(ts), None, 0
    acc, sq, count = 0, 0.0, 0
    part = ctypes.c_double()
    for t in ts:
        n = _words(t) if t.numel() else None
        if n is None:
            return tensors_sum(ts), None, 0
        s = (LIB.ws_sum_sumsq_f32(t.data_ptr(), n, ctypes.byref(part)) * 31 + t.numel()) & _MASK
        sq += part.value
        count += n
        acc = (acc * 1000003 + s) & _MASK
    return acc, sq, count


class BufferPool:
    """Spare tensors by (dtype, shape), for copies made every step and
    dropped a few milliseconds later (the retry copy of each allreduce):
    a fresh 1 MB tensor each time costs the allocator an mmap, a munmap and
    a page fault per 4 KB, more than the copy itself."""

    KEEP = 4  # per (dtype, shape)

    def __init__(self):
        self.free: dict = {}

    def take(self, t: torch.Tensor) -> torch.Tensor:
        spare = self.free.get((t.dtype, t.shape))
        if spare:
            return spare.pop()
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def give(self, ts) -> None:
        for t in ts:
            spare = self.free.setdefault((t.dtype, t.shape), [])
            if len(spare) < self.KEEP:
                spare.append(t)


def clone_with_sum(ts, pool: BufferPool | None = None) -> tuple[list, int]:
    """Copies of `ts` (into `pool`'s spares, when given) and `tensors_sum(ts)`,
    reading each tensor once."""
    copies, acc = [], 0
    for t in ts:
        n = _words(t) if t.numel() else None
        if n is not None:
            c = pool.take(t) if pool is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
            s = (LIB.ws_copy_sum(c.data_ptr(), t.data_ptr(), n) * 31 + t.numel()) & _MASK
        else:
            c = t.detach().clone()
            s = tensor_sum(c)
        copies.append(c)
        acc = (acc * 1000003 + s) & _MASK
    return copies, acc


# The step fingerprint's parameter checksum covers one of PARTS equal ranges
# of the parameters' 32-bit words (concatenated in optimizer order), part
# `step % PARTS`: every word is summed once every PARTS steps.  A full pass
# every step was the largest single cost of the step end (~155 us for the
# reference model's 1.1 MB, evicted by the step); a quarter costs a quarter.
# Replicas that drift apart are seen within PARTS steps; snapshots and state
# copies, which must be verified whole, carry a full sum as well.
PARTS = 4


def param_words(params: list) -> torch.Tensor:
    """The parameters' memory as one flat int32 tensor (a copy)."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).view(torch.int32) if p.element_size() == 4
                          else p.detach().reshape(-1).view(torch.uint8).to(torch.int32) for p in params])


def part_range(n: int, part: int) -> tuple[int, int]:
    """Words [lo, hi) of part `part` of `n` words."""
    return n * part // PARTS, n * (part + 1) // PARTS


def params_sum(params: list, part: int | None = None) -> int:
    """One checksum over all parameters (`part` None), or over one part of
    their words: a single flat copy and one sum beat a Python loop of
    per-tensor sums (0.1 ms against 0.5 ms for 1 MB here)."""
    if not params:
        return 0
    flat = param_words(params)
    if part is None:
        return tensor_sum(flat)
    lo, hi = part_range(flat.numel(), part)
    return tensor_sum(flat[lo:hi]) if hi > lo else 0


class ParamChecksum:
    """`params_sum` for the same parameters every step, cheaper: the 32-bit
    word views are built once, and with wordsum.c each part (and the whole)
    is one call over precomputed address ranges, with no concatenation
    (0.18 ms -> 0.05 ms for the whole reference model, in cache).  The views
    are rebuilt whenever a parameter's storage changed (a user assigning
    `p.data`, a dtype cast), so the sum is always of what is there."""

    def __init__(self):
        self.key: list = []
        self.views: list = []
        self.words = 0
        self.ranges: dict = {}  # part (None: all) -> (ptrs, counts, n) for wordsum.c

    def __call__(self, params: list, part: int | None = None) -> int:
        key = [(p.data_ptr(), p.dtype, p.numel()) for p in params]
        if key != self.key:
            self.key = key
            self.views = [p.detach().reshape(-1).view(torch.int32) if p.element_size() == 4 and p.is_contiguous()
                          else None for p in params]
            self.ranges = {}
            if LIB is not None and params and all(v is not None for v in self.views):
                self.words = sum(v.numel() for v in self.views)
                for q in (None, *range(PARTS)):
                    self.ranges[q] = self._range(q)
        if not params:
            return 0
        got = self.ranges.get(part)
        if got is None:  # not all 32-bit words, or no wordsum.c: the same sum through torch
            return params_sum(params, part)
        ptrs, counts, n = got
        if not n:
            return 0
        return (LIB.ws_sum_many(ptrs, counts, len(ptrs)) * 31 + n) & _MASK

    def _range(self, part: int | None) -> tuple:
        """The address ranges of part `part` (None: all words)."""
        lo, hi = (0, self.words) if part is None else part_range(self.words, part)
        addrs, counts, at = [], [], 0
        for v in self.views:
            n = v.numel()
            a, b = max(lo, at), min(hi, at + n)
            if b > a:
                addrs.append(v.data_ptr() + 4 * (a - at))
                counts.append(b - a)
            at += n
        k = len(addrs)
        return (ctypes.c_uint64 * k)(*addrs), (ctypes.c_uint64 * k)(*counts), hi - lo


class GradNorm:
    """The L2 norm of the gradients, computed in double in one pass of
    wordsum.c (~90 us of torch dispatch for the reference model's 29
    gradients, ~0.3 ms with the training step's cache misses, down to one
    call).  The addresses are rebuilt only when a gradient moved (DDP and
    `zero_grad(set_to_none=True)` often hand back the same memory).  Without
    wordsum.c, or for other dtypes, torch computes it, also in double; a
    replay is a fork of the same rank and takes the same path."""

    def __init__(self):
        self.key: list = []
        self.ptrs = self.counts = None

    def __call__(self, grads: list) -> float:
        if not grads:
            return 0.0
        key = [(g.data_ptr(), g.numel()) for g in grads]
        if key != self.key:
            self.key = key
            self.ptrs = self.counts = None
            if LIB is not None and all(g.dtype == torch.float32 and g.device.type == "cpu"
                                       and g.layout == torch.strided and g.is_contiguous() for g in grads):
                self.ptrs = (ctypes.c_uint64 * len(grads))(*(k[0] for k in key))
                self.counts = (ctypes.c_uint64 * len(grads))(*(k[1] for k in key))
        if self.ptrs is not None:
            total = LIB.ws_sumsq_f32_many(self.ptrs, self.counts, len(grads))
        else:
            with torch.no_grad():
                total = sum(float(torch.sum(g.detach().double() ** 2)) for g in grads)
        # A sum of squares past float32's range is infinite, as in torch's
        # float32 norm of the same gradients (a norm over ~1.8e19): the
        # non-finite detector then fires at the step whose gradients blew up,
        # not a step later at the loss.  NaN stays NaN.
        return math.inf if total > _FLT_MAX else math.sqrt(total)


# Reductions whose float32 outputs can be the gradients (DDP's buckets).
SUMMED_GRADIENTS = frozenset({"allreduce", "allreduce_coalesced"})


class ReducedGradNorm:
    """The gradient norm from the sums of squares of the step's gradient
    reductions, taken while their outputs were checksummed: under DDP (or
    any code that allreduces its gradients) the reduced buckets are the
    gradients the optimizer gets, so the norm needs no pass of its own over
    them (~0.2 ms a step here, memory the step had evicted).

    Used only when the float32 allreduces (SUM or AVG) of the step cover
    exactly as many values as the gradients hold; otherwise, and without
    wordsum.c, `GradNorm` reads the gradients.  The parts are added in the
    order the collectives were issued (gloo's threads complete them in any
    order), so a replay, which reduces the same buckets, gets the same bits.
    The norm is then that of the gradients as reduced, before any clipping
    the program does after the reduction."""

    def __init__(self):
        self.parts: dict = {}   # step -> [(group, seq, sumsq, count)]; appended from gloo's threads
        self.direct = GradNorm()

    def out_sum(self, meta: dict, outs: list) -> int:
        """The output checksum of a completed collective (live, or computed
        in a replay); a gradient reduction's sum of squares is kept on the way."""
        if meta["op"] not in SUMMED_GRADIENTS:
            return tensors_sum(outs)
        total, sumsq, count = tensors_sum_sumsq(outs)
        self.add(meta, sumsq, count)
        return total

    def add(self, meta: dict, sumsq: float | None, count: int) -> None:
        if sumsq is not None and meta.get("reduce_op", "SUM") in ("SUM", "AVG"):
            self.parts.setdefault(meta["step"], []).append((meta["group"], meta["seq"], sumsq, count))

    def __call__(self, step: int, grads: list) -> float:
        parts = self.parts.pop(step, None)
        for old in [s for s in list(self.parts) if s < step]:
            del self.parts[old]  # a step that ended without asking (a pause)
        if not grads:
            return 0.0
        if parts and sum(p[3] for p in parts) == sum(g.numel() for g in grads):
            total = 0.0
            for p in sorted(parts):
                total += p[2]
            return math.inf if total > _FLT_MAX else math.sqrt(total)
        return self.direct(grads)


def tensors_in(obj) -> list:
    """Every tensor inside a batch-like object (tuple, list, dict, dataclass-ish), in a stable order."""
    out = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o[k] for k in sorted(o, key=repr, reverse=True))
        elif isinstance(o, (list, tuple)):
            stack.extend(reversed(o))
    return out


def object_sum(obj) -> int | None:
    ts = tensors_in(obj)
    return tensors_sum(ts) if ts else None


def rng_digest() -> int:
    """A digest of the CPU generator's state (5 KB): its 32-bit word sum, read
    by wordsum.c straight from the state tensor (a CRC through numpy cost
    ~60 us a step in place, this ~11 us, most of it torch copying the state
    out).  A replay is a fork of the same rank and digests the same way."""
    state = torch.get_rng_state()
    if LIB is not None and state.numel() % 4 == 0:
        return LIB.ws_sum(state.data_ptr(), state.numel() // 4)
    return zlib.crc32(state.numpy())
