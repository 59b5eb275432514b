"""Library-call rows: api_call for every probe hit, collective for c10d calls.

Decoding is per row in Python: the default probe set fires at collective and
CUDA-API rates (hundreds to thousands a second), not per instruction.
"""

from __future__ import annotations

import numpy as np

from .uprobes.decode import deref_value, detail, ret_name
from .uprobes.python_frames import FrameResolver, user_frame

# Stacks waiting for their call's row: a call's stack is read at entry and
# can reach the collector a flush before the call returns.
MAX_WAITING_STACKS = 50_000
# Distinct argument texts and stacks remembered (each cache starts over when full).
MAX_REMEMBERED = 20_000


class LibraryCallWriter:
    def __init__(self, prober, model, writer):
        self.prober = prober
        self.model = model
        self.writer = writer
        self.next_id = 0
        self._group_index: dict[tuple[int, int], int] = {}
        self._groups_per_process: dict[int, int] = {}
        self._seq: dict[tuple[int, int], int] = {}
        self.frames = FrameResolver()
        self._stacks: dict[tuple[int, int], list[str]] = {}
        # A training loop repeats the same calls with the same arguments from
        # the same lines: their texts are made once (a row costs ~10 us, not ~60).
        self._details: dict[tuple, str] = {}
        self._stack_texts: dict[tuple[str, ...], tuple[str, str | None]] = {}

    def add_stacks(self, ev: np.ndarray) -> None:
        """Python stacks read at call entries (ring `pystack`), named now."""
        for e in ev:
            self._stacks[(int(e["tid"]), int(e["ts"]))] = self.frames.describe(e)
        if len(self._stacks) > MAX_WAITING_STACKS:  # calls never seen (dropped): keep the newest
            for key in list(self._stacks)[:len(self._stacks) - MAX_WAITING_STACKS]:
                del self._stacks[key]

    def write(self, ev: np.ndarray, utids: np.ndarray, upids: np.ndarray, entered: bool = False) -> None:
        calls, colls = [], []
        # Columns as Python lists first: a numpy record's fields cost ~1 us a read.
        slots, tss, tids = ev["slot"].tolist(), ev["ts"].tolist(), ev["tid"].tolist()
        durs, rets, flagss = ev["dur"].tolist(), ev["ret"].tolist(), ev["flags"].tolist()
        argss, derefs, tensors = ev["args"].tolist(), ev["deref"].tolist(), ev["tensor"].tolist()
        utids, upids = utids.tolist(), upids.tolist()
        probes = self.prober.slots
        for i, slot in enumerate(slots):
            if slot >= len(probes):
                continue
            probe = probes[slot]
            spec = probe.spec
            args, flags, ts = argss[i], flagss[i], tss[i]
            dval = deref_value(spec.deref.type, tuple(derefs[i]), bool(flags & 1)) if spec.deref else None
            ret = None if entered else rets[i]
            dur = None if entered else durs[i]
            cid = self.next_id
            self.next_id += 1
            utid, upid = utids[i], upids[i]
            key = (tids[i], ts)
            # A call still in progress keeps its stack for the row written when it returns.
            stack = self._stacks.get(key) if entered else self._stacks.pop(key, None)
            text, site = self._stack_text(stack) if stack else (None, None)
            calls.append((cid, ts, dur, utid, upid, spec.library,
                          spec.name, probe.display, ret, None if entered else ret_name(spec.ret, ret),
                          *args, dval, self._detail(slot, spec, args, dval), probe.path, text, site))
            if spec.collective:
                pg_index = spec.arg_index("pg")
                pg = args[pg_index] if pg_index is not None else 0
                key = (upid, pg)
                if key not in self._group_index:
                    self._group_index[key] = self._groups_per_process.get(upid, 0)
                    self._groups_per_process[upid] = self._group_index[key] + 1
                seq = self._seq.get(key, 0)
                self._seq[key] = seq + 1
                numel = dtype = nbytes = None
                layout = self.prober.tensor_layouts.get(probe.path)
                if layout and flags & 2:
                    numel = tensors[i][0]
                    name_size = layout["dtypes"].get(tensors[i][1])
                    if name_size:
                        dtype, nbytes = name_size[0], numel * name_size[1]
                colls.append((cid, ts, dur, utid, upid,
                              self.model.processes[upid].rank, spec.name.split(".", 1)[0], pg,
                              self._group_index[key], seq, spec.collective,
                              dval if spec.deref and spec.deref.type == "tensor_vector" else None,
                              numel, dtype, nbytes, "entered" if entered else "returned"))
        self.writer.append_rows("api_call", calls)
        self.writer.append_rows("collective", colls)

    def _detail(self, slot: int, spec, args: list[int], dval) -> str:
        key = (slot, *args, dval)
        text = self._details.get(key)
        if text is None:
            if len(self._details) >= MAX_REMEMBERED:
                self._details.clear()
            text = self._details[key] = detail(spec, args, dval)
        return text

    def _stack_text(self, stack: list[str]) -> tuple[str, str | None]:
        """The stack as stored (one frame a line) and its user frame."""
        key = tuple(stack)
        got = self._stack_texts.get(key)
        if got is None:
            if len(self._stack_texts) >= MAX_REMEMBERED:
                self._stack_texts.clear()
            got = self._stack_texts[key] = ("\n".join(stack), user_frame(stack))
        return got
