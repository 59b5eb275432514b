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

    def add_stacks(self, ev: np.ndarray) -> None:
        """Python stacks read at call entries (ring `pystack`), named now."""
        for e in ev:
            self._stacks[(int(e["tid"]), int(e["ts"]))] = self.frames.describe(e)
        if len(self._stacks) > MAX_WAITING_STACKS:  # calls never seen (dropped): keep the newest
            for key in list(self._stacks)[:len(self._stacks) - MAX_WAITING_STACKS]:
                del self._stacks[key]

    def write(self, ev: np.ndarray, utids: np.ndarray, upids: np.ndarray, entered: bool = False) -> None:
        calls, colls = [], []
        for i in range(len(ev)):
            e = ev[i]
            slot = int(e["slot"])
            if slot >= len(self.prober.slots):
                continue
            probe = self.prober.slots[slot]
            spec = probe.spec
            args = [int(a) for a in e["args"]]
            dval = deref_value(spec.deref.type, (int(e["deref"][0]), int(e["deref"][1])),
                               bool(int(e["flags"]) & 1)) if spec.deref else None
            ret = None if entered else int(e["ret"])
            cid = self.next_id
            self.next_id += 1
            utid, upid = int(utids[i]), int(upids[i])
            key = (int(e["tid"]), int(e["ts"]))
            # A call still in progress keeps its stack for the row written when it returns.
            stack = self._stacks.get(key) if entered else self._stacks.pop(key, None)
            calls.append((cid, int(e["ts"]), None if entered else int(e["dur"]), utid, upid, spec.library,
                          spec.name, probe.display, ret, None if entered else ret_name(spec.ret, ret),
                          *args, dval, detail(spec, args, dval), probe.path,
                          "\n".join(stack) if stack else None, user_frame(stack) if stack else None))
            if spec.collective:
                pg = args[spec.arg_index("pg")] if spec.arg_index("pg") is not None else 0
                key = (upid, pg)
                if key not in self._group_index:
                    self._group_index[key] = self._groups_per_process.get(upid, 0)
                    self._groups_per_process[upid] = self._group_index[key] + 1
                seq = self._seq.get(key, 0)
                self._seq[key] = seq + 1
                numel = dtype = nbytes = None
                layout = self.prober.tensor_layouts.get(probe.path)
                if layout and int(e["flags"]) & 2:
                    numel = int(e["tensor"][0])
                    name_size = layout["dtypes"].get(int(e["tensor"][1]))
                    if name_size:
                        dtype, nbytes = name_size[0], numel * name_size[1]
                colls.append((cid, int(e["ts"]), None if entered else int(e["dur"]), utid, upid,
                              self.model.processes[upid].rank, spec.name.split(".", 1)[0], pg,
                              self._group_index[key], seq, spec.collective,
                              dval if spec.deref and spec.deref.type == "tensor_vector" else None,
                              numel, dtype, nbytes, "entered" if entered else "returned"))
        self.writer.append_rows("api_call", calls)
        self.writer.append_rows("collective", colls)
