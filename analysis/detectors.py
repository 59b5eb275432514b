"""Failure detectors run by every rank at each step end, with their defaults.

| detector   | fires when                                                             | default |
|------------|------------------------------------------------------------------------|---------|
| non_finite | the step's loss or gradient norm is NaN or infinite                    | on      |
| loss_spike | loss > median + Z * 1.4826 * MAD over the last W steps (after M steps) | Z=8, W=32, M=8 |
| sdc        | replicas disagree: parameter checksums differ across ranks under DDP   | on      |
| stall      | a rank no collective of which waits on its peers makes no progress for max(S, F * median step time): reported (the rank, the step, its Python line and system call), never halted | S=2 s, F=10 |
| straggler  | a rank whose own time per step (the step minus its time inside collectives), median over the last W steps, is F times its peers' median and D ms more, at two checks in a row (every W/2 steps): reported with the ratio, never halted | F=1.5, D=10 ms, W=16 |
| hang       | no step end for max(T, K * median step time)                           | T=300 s, K=20 |
| crash      | a rank exits non-zero or by signal (seen by `watcher run`)             | on      |
| stuck collective | every member of a group inside the same collective for C seconds: aborted and retried on a new transport (`collective_timeout`, 0 = off) | C=600 s |
| repeated transients | the Nth transient on one rank within W steps is escalated to persistent (hardware suspect) instead of recovered again | N=3, W=1000 |

Each is set through WATCHER_DETECT (JSON), e.g. {"loss_spike_z": 12, "hang_seconds": 60},
which `watcher run --detect KEY=VALUE` fills in.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields


@dataclass
class Detectors:
    non_finite: bool = True
    loss_spike: bool = True
    loss_spike_z: float = 8.0
    loss_spike_window: int = 32
    loss_spike_min_steps: int = 8
    sdc: bool = True
    stall: bool = True
    stall_seconds: float = 2.0
    stall_factor: float = 10.0
    straggler: bool = True
    # 2x, not 1.5x: a healthy 2-rank job on a busy 2-core VM measured 1.50-1.66x for
    # minutes at a time (a 19-min reference run); a real straggler is far past that.
    straggler_factor: float = 2.0
    straggler_min_ms: float = 10.0
    straggler_window: int = 16
    hang_seconds: float = 300.0
    hang_factor: float = 20.0
    collective_timeout: float = 600.0
    transient_limit: int = 3
    transient_window: int = 1000
    history: list = field(default_factory=list, repr=False)

    @classmethod
    def from_env(cls) -> "Detectors":
        raw = os.environ.get("WATCHER_DETECT")
        return cls.from_dict(json.loads(raw) if raw else {})

    @classmethod
    def from_dict(cls, d: dict) -> "Detectors":
        known = {f.name: f for f in fields(cls) if f.name != "history"}
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"unknown detector setting {unknown[0]!r}; known: {', '.join(known)}")
        return cls(**d)

    def check_step(self, fp: dict) -> dict | None:
        loss, gn, k = fp.get("loss"), fp.get("grad_norm"), fp["step"]
        if self.non_finite and ((loss is not None and not math.isfinite(loss)) or not math.isfinite(gn)):
            return {"kind": "non_finite", "failing_step": k, "detail": {"loss": loss, "grad_norm": gn}}
        if loss is None or not math.isfinite(loss):
            return None
        hit = None
        h = self.history
        if self.loss_spike and len(h) >= self.loss_spike_min_steps and loss > (med := _median(h)):
            # (At or below the median z is not positive: no spreads to sort.)
            mad = _median([abs(x - med) for x in h])
            scale = max(1.4826 * mad, 1e-3 * abs(med), 1e-12)
            z = (loss - med) / scale
            if z > self.loss_spike_z:
                hit = {"kind": "loss_spike", "failing_step": k,
                       "detail": {"loss": loss, "median": med, "robust_z": round(z, 2)}}
        if hit is None:  # a spike does not become the new normal
            h.append(loss)
            if len(h) > self.loss_spike_window:
                del h[0]
        return hit

    def stall_limit_s(self, median_step_s: float) -> float:
        return max(self.stall_seconds, self.stall_factor * median_step_s)

    def hang_limit_s(self, median_step_s: float) -> float:
        return max(self.hang_seconds, self.hang_factor * median_step_s)


def _median(xs: list) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
