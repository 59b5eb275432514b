"""What a replay child does in place of the live rank's I/O.

Batches come from the recorded window.  Collective outputs come either from
the record (a rank replayed alone, e.g. after a crash) or, in a coordinated
replay (the order names an exchange directory), are computed from every
rank's replayed inputs (see exchange.py).  Every replayed collective input and
step fingerprint is compared with the record.  At the target step (or when
the record runs out, or on an exception) the child writes its result (with,
in a coordinated replay, the training state for a merge into the live rank)
and exits without running any of the program's exit code.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback

import torch

from ..runtime.checksum import tensors_sum
from ..runtime.collectives import computed_in_replay, done_work
from ..runtime.seam import Rank
from ..runtime.window import END_OF_DATA
from . import variants
from .exchange import PeerEnded, compute_outputs
from .merge import training_state
from .optrace import untraced

COMPARED = ("loss", "grad_norm", "param_sum", "batch_sum", "rng")


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


class ReplayState:
    def __init__(self, rt: Rank, window, order: dict, result_file):
        self.rank = rt.rank
        self.window = window
        self.to_step = order["to_step"]
        self.result_file = result_file
        self.steps: dict[int, dict] = {}
        self.colls: list[dict] = []
        self.first_divergence = None
        self.from_step = rt.step
        self.t0 = time.monotonic_ns()
        self.inherited_fds: list[int] = []
        self.setup_ms: dict = {}
        self.rt = rt
        self.exchange = None          # set for a coordinated replay
        self.from_record: list = []   # collectives answered from the record in a coordinated replay
        self.exchange_timeout_s = float(order.get("exchange_timeout_s", 120.0))
        self.variant = order.get("variant") or {}  # a counterfactual replay (variants.py)
        self.extra: dict = {}                        # what the variant observed, for the result
        self.tracer = None

    def untraced(self):
        """Around Watcher's own work while the op trace of a counterfactual runs."""
        if self.tracer is None:
            return contextlib.nullcontext()
        return untraced()

    def batch(self, idx, it, orig):
        if idx not in self.window.batches:
            self.finish("record_exhausted", f"batch {idx} is not in the window")
        b = self.window.batches[idx]
        if isinstance(b, str) and b == END_OF_DATA:
            raise StopIteration
        if self.variant:
            with self.untraced():
                b = variants.batch(self.rt, self, self.variant, idx, b)
        return b

    def collective(self, rt, meta: dict, ins: list, outs: list, members: list[int]):
        with self.untraced():
            return self._collective(rt, meta, ins, outs, members)

    def _collective(self, rt, meta: dict, ins: list, outs: list, members: list[int]):
        key = (meta["group"], meta["seq"])
        rec = self.window.colls.get(key)
        if rec is None:
            if not self._unrecorded(meta):
                self.finish("record_exhausted", f"collective {key} is not in the window")
            # The step a crashed rank died in: its collectives went down with
            # it.  Computed from the peers' inputs all the same, compared with nothing.
            rec = {"in_sum": None, "op": meta["op"], "out_sum": None}
        ok = None if rec["in_sum"] is None else rec["in_sum"] == meta["in_sum"] and rec["op"] == meta["op"]
        entry = {"group": key[0], "seq": key[1], "op": meta["op"], "step": meta["step"],
                 "in_sum": meta["in_sum"], "recorded_in_sum": rec["in_sum"], "match": ok}
        self.colls.append(entry)
        where = "compute" if ok is False else None
        recorded = self.window.outputs.get(key)  # None: only the checksum was kept
        if self.exchange is not None and computed_in_replay(meta):
            try:
                got = self.exchange.gather(key, {"in_match": ok, "ins": [t.detach() for t in ins]},
                                           members, self.exchange_timeout_s)
            except PeerEnded as e:
                self.finish("peer_ended", str(e))
            if not compute_outputs(meta, [g["ins"] for g in got], outs, members.index(self.rank)):
                self.finish("needs_peers", f"collective {key} ({meta['op']}) cannot be computed in a replay")
            if self.variant:  # where non-finite values crossed ranks, for a causal chain
                entry["in_nonfinite"] = any(bool((~torch.isfinite(t)).any()) for t in ins if t.is_floating_point())
                entry["out_nonfinite"] = any(bool((~torch.isfinite(t)).any()) for t in outs if t.is_floating_point())
            # The inputs of every rank are as recorded, yet this rank received
            # something else: the live transfer corrupted it.  (Checksums
            # compare bits, so NaN outputs can match.)
            out_sum = rt.grad_norm.out_sum(meta, outs)  # as the live rank summed them
            entry["out_match"] = None if ok is None else \
                out_sum == (rec.get("out_sum") if recorded is None else tensors_sum(recorded))
            if where is None and all(g["in_match"] for g in got) and not entry["out_match"]:
                where = "communication"
        elif recorded is None:
            self.finish("needs_peers", f"collective {key} ({meta['op']}) can only be replayed with every rank")
        else:
            if self.exchange is not None:
                self.from_record.append(list(key))
            for o, r in zip(outs, recorded):
                o.copy_(r)
        if where and self.first_divergence is None:
            self.first_divergence = {"rank": self.rank, "step": meta["step"],
                                     "collective": {"group": key[0], "seq": key[1], "op": meta["op"]},
                                     "where": where}
        return done_work(outs)

    def _unrecorded(self, meta: dict) -> bool:
        """Is this a reduction of the step after the last one the record
        holds, replayed with every rank (a crash replay reaching the step the
        rank died in)?  Its record, written at step end, never came."""
        return (self.exchange is not None and computed_in_replay(meta)
                and meta["step"] > max(self.window.steps, default=self.from_step))

    def step_end(self, rt, fp: dict) -> None:
        fp.pop("_colls", None)
        k = fp["step"]
        rec = self.window.steps.get(k)
        diff = [f for f in COMPARED if rec is None or not same_value(fp.get(f), rec.get(f))]
        fp["match"] = not diff
        fp["diff"] = diff
        fp["lr"] = [g.get("lr") for g in rt.main_opt.param_groups] if rt.main_opt is not None else None
        if k >= self.to_step:  # the state a recovery merges is compared across ranks whole
            fp["param_sum_full"] = rt.param_sum(rt.params())
        self.steps[k] = fp
        if k >= self.to_step:
            self.finish("done")

    def on_exception(self, etype, value, tb) -> None:
        self.finish("exception", "".join(traceback.format_exception(etype, value, tb))[-4000:])

    def finish(self, status: str, error: str | None = None):
        result = {"rank": self.rank, "status": status, "error": error, "from_step": self.from_step,
                  "to_step": self.to_step, "steps": self.steps, "colls": self.colls,
                  "first_divergence": self.first_divergence,
                  "coordinated": self.exchange is not None, "from_record": self.from_record,
                  "exchange_ms": None if self.exchange is None else
                  {"publish": round(self.exchange.publish_ns / 1e6, 1), "wait": round(self.exchange.wait_ns / 1e6, 1)},
                  "wall_ns": time.monotonic_ns() - self.t0, "variant": self.variant.get("name"),
                  # CPU of this process alone (a fork starts its counts at zero): what an audit costs
                  "cpu_s": round(time.process_time(), 4)}
        try:
            result.update(self.extra)
            if self.tracer is not None:
                result["trace"] = self.tracer.summary()
            if self.exchange is not None:
                self.exchange.end(status)
                if status == "done":
                    result["state"] = training_state(self.rt)
            result["setup_ms"] = dict(self.setup_ms, state=round((time.monotonic_ns() - self.t0 - result["wall_ns"]) / 1e6, 1))
            torch.save(result, self.result_file)
            self.result_file.flush()
        finally:
            os._exit(0 if status == "done" else 1)
