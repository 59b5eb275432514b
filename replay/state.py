"""What a replay child does in place of the live rank's I/O.

Batches and collective outputs come from the recorded window; every replayed
collective input and step fingerprint is compared with the record.  At the
target step (or when the record runs out, or on an exception) the child
writes its result and exits without running any of the program's exit code.
"""

from __future__ import annotations

import math
import os
import time
import traceback

import torch

from ..runtime.collectives import _done_work
from ..runtime.window import END_OF_DATA

COMPARED = ("loss", "grad_norm", "param_sum", "batch_sum", "rng")


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


class ReplayState:
    def __init__(self, rt, window, order: dict, result_file):
        self.rank = rt.rank
        self.window = window
        self.to_step = order["to_step"]
        self.suspects = {tuple(s) for s in order.get("suspects", [])}
        self.result_file = result_file
        self.steps: dict[int, dict] = {}
        self.colls: list[dict] = []
        self.first_divergence = None
        self.inputs: dict = {}
        self.from_step = rt.step
        self.t0 = time.monotonic_ns()
        self.inherited_fds: list[int] = []

    def batch(self, idx, it, orig):
        if idx not in self.window.batches:
            self.finish("record_exhausted", f"batch {idx} is not in the window")
        b = self.window.batches[idx]
        if isinstance(b, str) and b == END_OF_DATA:
            raise StopIteration
        return b

    def collective(self, rt, meta: dict, ins: list, outs: list):
        key = (meta["group"], meta["seq"])
        rec = self.window.colls.get(key)
        if rec is None:
            self.finish("record_exhausted", f"collective {key} is not in the window")
        ok = rec["in_sum"] == meta["in_sum"] and rec["op"] == meta["op"]
        self.colls.append({"group": key[0], "seq": key[1], "op": meta["op"], "step": meta["step"],
                           "in_sum": meta["in_sum"], "recorded_in_sum": rec["in_sum"], "match": ok})
        if not ok and self.first_divergence is None:
            self.first_divergence = {"rank": self.rank, "step": meta["step"],
                                     "collective": {"group": key[0], "seq": key[1], "op": meta["op"]},
                                     "where": "compute"}
        if key in self.suspects:
            self.inputs[key] = [t.detach().clone() for t in ins]
        for o, r in zip(outs, self.window.outputs[key]):
            o.copy_(r)
        return _done_work(outs)

    def step_end(self, rt, fp: dict) -> None:
        fp.pop("_colls", None)
        k = fp["step"]
        rec = self.window.steps.get(k)
        diff = [f for f in COMPARED if rec is None or not same_value(fp.get(f), rec.get(f))]
        fp["match"] = not diff
        fp["diff"] = diff
        self.steps[k] = fp
        if k >= self.to_step:
            self.finish("done")

    def on_exception(self, etype, value, tb) -> None:
        self.finish("exception", "".join(traceback.format_exception(etype, value, tb))[-4000:])

    def finish(self, status: str, error: str | None = None):
        result = {"rank": self.rank, "status": status, "error": error, "from_step": self.from_step,
                  "to_step": self.to_step, "steps": self.steps, "colls": self.colls,
                  "first_divergence": self.first_divergence, "inputs": self.inputs,
                  "wall_ns": time.monotonic_ns() - self.t0}
        try:
            torch.save(result, self.result_file)
            self.result_file.flush()
        finally:
            os._exit(0 if status == "done" else 1)
