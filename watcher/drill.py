"""`watcher drill`: inject known faults into the reference workload and score Watcher.

Each scenario is one `watcher run --policy recover` (or `apply`) of the 2-rank reference
job with one fault, or two (see watcher.runtime.inject).  The scorecard
compares what Watcher concluded with the fault that was injected (only this
module knows both) and, for transient faults, whether training recovered: no
step lost and final parameters bit-identical to a fault-free run; for
persistent faults, whether diagnosis named the injected cause (and, under
--policy apply, whether the prescription was applied and training finished).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .demo import reference_command
from .errors import UsageError
from .run import RunConfig, run
from .rundir import read_steps

FAULT_STEP = 12
FAULT_RANK = 1
SECOND_STEP, SECOND_RANK = 18, 0  # the second fault of two_transients
MIN_STEPS = SECOND_STEP + 4
# A persistent scenario keeps its snapshots this long after its run (`watcher diagnose`).
RETAIN_S = 15.0


@dataclass
class Scenario:
    name: str
    inject: dict
    kinds: tuple           # acceptable detected kinds
    classification: str | None     # None: a report (a stall), not a verdict
    where: str | None = None       # compute | communication | stall | crash | reported
    detect: dict = field(default_factory=dict)
    also: list = field(default_factory=list)  # further faults in the same run (with their own rank/step)
    incidents: int = 1                         # how many incidents the faults make
    attribution: str | None = None             # persistent: the cause diagnosis must name
    policy: str = "recover"                    # apply: the prescription must be applied and training finish
    op: str | None = None                      # software: the op the prescription must name
    precision: bool = False                    # software: clean in float64, and the prescription says so
    rescue: bool = False                       # a dead (or stuck) rank is replaced; off, the death ends the job


SCENARIOS = [
    Scenario("grad_bitflip", {"scenario": "grad_bitflip"}, ("non_finite", "loss_spike"), "transient", "compute"),
    Scenario("allreduce_corrupt", {"scenario": "allreduce_corrupt"}, ("non_finite", "sdc", "loss_spike"),
             "transient", "communication"),
    Scenario("stall", {"scenario": "stall", "seconds": 4}, ("hang",), "transient", "stall",
             detect={"hang_seconds": 1.5}),
    # The network drops the rank's connections: the collective fails on every member.
    Scenario("link_reset", {"scenario": "link_reset"}, ("collective_error",), "transient", "link"),
    # The network silently loses the rank's traffic: no error, every member waits in the
    # collective until the per-operation timeout aborts it and it is retried on a new transport.
    Scenario("net_blackhole", {"scenario": "net_blackhole"}, ("collective_error",), "transient", "link",
             detect={"collective_timeout": 2.0}),
    # A fault during the recovery itself: the merged copy gets a flipped bit.
    Scenario("merge_bitflip", {"scenario": "grad_bitflip"}, ("non_finite", "loss_spike"), "transient", "compute",
             also=[{"scenario": "merge_bitflip", "rank": FAULT_RANK, "step": FAULT_STEP}]),
    # Two transients in one run, on different ranks and steps.
    Scenario("two_transients", {"scenario": "grad_bitflip"}, ("non_finite", "loss_spike"), "transient", "compute",
             also=[{"scenario": "allreduce_corrupt", "rank": SECOND_RANK, "step": SECOND_STEP}], incidents=2),
    # Track B: persistent faults, each diagnosed by counterfactual replay.
    Scenario("bad_batch", {"scenario": "bad_batch", "sample": 5}, ("non_finite",), "persistent", attribution="data"),
    Scenario("bad_op", {"scenario": "bad_op"}, ("non_finite",), "persistent", attribution="software",
             op="aten::div.Tensor"),
    # Clean in the float64 reference only: a float32 precision bug in an op.
    Scenario("fp32_overflow", {"scenario": "fp32_overflow"}, ("non_finite",), "persistent", attribution="software",
             op="aten::exp", precision=True),
    Scenario("lr_spike", {"scenario": "lr_spike", "factor": 1000.0}, ("loss_spike", "non_finite"), "persistent",
             attribution="params"),
    Scenario("bad_cores", {"scenario": "bad_cores", "factor": 1e4, "cpus": [0]}, ("loss_spike", "non_finite"),
             "persistent", attribution="hardware"),
    # --policy apply: the prescription is applied and training finishes.
    Scenario("skip_batch", {"scenario": "bad_batch", "sample": 5}, ("non_finite",), "persistent",
             attribution="data", policy="apply"),
    Scenario("adjust_lr", {"scenario": "lr_spike", "factor": 1000.0}, ("loss_spike", "non_finite"), "persistent",
             attribution="params", policy="apply"),
    Scenario("segv", {"scenario": "segv"}, ("crash",), "persistent", "crash"),
    # A 20-s stall in a job of ~25-ms steps: reported within seconds, nothing
    # halted, the run goes on and ends as a fault-free one.
    Scenario("long_stall", {"scenario": "stall", "seconds": 20}, ("stall",), None, "reported"),
    # A rank that blocks in a read at the step, in replay too: persistent, and stopped.
    Scenario("hang_pipe", {"scenario": "hang_pipe"}, ("hang",), "persistent", "stall",
             detect={"hang_seconds": 3.0}),
    # --rescue: a rank killed (as the OOM killer does) or dead of a native fault, once, is replaced
    # while the job runs; a rank stuck once in a read is ended and replaced after its hang replays clean.
    Scenario("kill_rescued", {"scenario": "sigkill_once"}, ("crash",), "transient", "crash", rescue=True),
    Scenario("segv_rescued", {"scenario": "segv_once"}, ("crash",), "transient", "crash", rescue=True),
    Scenario("hang_rescued", {"scenario": "hang_pipe_once"}, ("hang",), "transient", "stall",
             detect={"hang_seconds": 3.0}, incidents=2, rescue=True),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def _final_sha(run_dir: Path) -> str | None:
    p = run_dir / "final.pt.sha256"
    return p.read_text().strip() if p.exists() else None


def _job(steps: int, run_dir: Path, ranks: int = 2) -> list[str]:
    return reference_command(steps, ranks) + [f"--save={run_dir / 'final.pt'}"]


def score(s: Scenario, incidents: list[dict]) -> dict:
    # Reports (a stall before a hang is the same fault seen early; a straggler
    # is a rank's pace) are not verdicts: scored only where they are the point.
    incidents = [i for i in incidents if i["kind"] not in ("stall", "straggler") or i["kind"] in s.kinds]
    inc = incidents[0] if incidents else None
    row = {"scenario": s.name, "injected": f"rank {FAULT_RANK} step {FAULT_STEP}",
           "detected": None, "classification": None, "localised": None, "replay_exact": None, "pass": False}
    if inc is None:
        return row
    rep = inc.get("replay") or {}
    row["detected"] = f"{inc['kind']}@{inc['detected_step']}"
    row["classification"] = inc.get("classification")
    row["replay_exact"] = rep.get("exact")
    loc = None
    if s.where in ("compute", "communication"):
        d = rep.get("first_divergence") or {}
        loc = (d.get("rank") == FAULT_RANK and d.get("step") == FAULT_STEP and d.get("where") == s.where)
        row["localised"] = (f"rank {d.get('rank')} step {d.get('step')} "
                            f"{(d.get('collective') or {}).get('op')} {d.get('where')}") if d else "none"
    elif s.where == "stall":
        st = rep.get("stall") or {}
        loc = st.get("rank") == FAULT_RANK and st.get("step") == FAULT_STEP
        what = (f"outside collectives, in {(st.get('where') or {}).get('syscall')}" if st.get("outside_collective")
                else (st.get("collective") or {}).get("op"))
        row["localised"] = f"rank {st.get('rank')} step {st.get('step')} {what}" if st else "none"
    elif s.where == "reported":
        w = (inc.get("detail") or {}).get("where") or {}
        loc = inc.get("detected_rank") == FAULT_RANK and inc.get("detected_step") == FAULT_STEP
        row["localised"] = f"rank {inc.get('detected_rank')} step {inc.get('detected_step')} in {w.get('syscall')}"
        row["incidents"] = len(incidents)
    elif s.where == "link":
        c = (inc.get("recovery") or {}).get("collective") or {}
        loc = inc.get("detected_step") == FAULT_STEP and c.get("op") == "allreduce"
        row["localised"] = f"step {inc.get('detected_step')} {c.get('op')} #{c.get('seq')}" if c else "none"
    elif s.where == "crash":
        loc = inc.get("detected_rank") == FAULT_RANK and inc.get("detected_step") == FAULT_STEP
        row["localised"] = f"rank {inc.get('detected_rank')} step {inc.get('detected_step')}"
    row["pass"] = bool(inc["kind"] in s.kinds and inc.get("classification") == s.classification
                       and (loc is None or loc) and (s.where != "reported" or len(incidents) == 1))
    if s.attribution:
        att, pre = inc.get("attribution") or {}, inc.get("prescription") or {}
        row["attribution"] = f"{att.get('cause')} ({pre.get('action')})" if att else None
        row["cause_named"] = names_cause(s, pre)
        row["pass"] = row["pass"] and att.get("cause") == s.attribution and row["cause_named"]
        if s.policy == "apply":
            row["applied"] = bool(pre.get("applied")) and bool(inc.get("recovered"))
            row["recovered"], row["steps_lost"] = inc.get("recovered"), inc.get("steps_lost")
            row["resume_s"] = (inc.get("recovery") or {}).get("detect_to_resume_s")
            row["pass"] = row["pass"] and row["applied"]
    if s.classification == "transient":
        # Recovered, every time: every incident of the run, no step lost.
        row["incidents"] = len(incidents)
        row["recovered"] = all(i.get("recovered") for i in incidents)
        row["steps_lost"] = sum(i.get("steps_lost") or 0 for i in incidents) if row["recovered"] else None
        row["resume_s"] = max(((i.get("recovery") or {}).get("detect_to_resume_s") or 0) for i in incidents)
        row["merge_retried"] = any((i.get("recovery") or {}).get("retried") for i in incidents)
        row["pass"] = row["pass"] and row["recovered"] and len(incidents) == s.incidents
        if s.also and len(incidents) > 1:
            second = incidents[1].get("replay", {}).get("first_divergence") or {}
            row["pass"] = row["pass"] and second.get("rank") == SECOND_RANK and second.get("step") == SECOND_STEP \
                and all(i.get("classification") == "transient" for i in incidents)
        if s.name == "merge_bitflip":
            row["pass"] = row["pass"] and row["merge_retried"]
    return row


def names_cause(s: Scenario, pre: dict) -> bool:
    """Does the prescription name what was injected?"""
    inj = s.inject
    if s.attribution == "data":
        return any(b.get("rank") == FAULT_RANK and b.get("step") == FAULT_STEP and b.get("samples") == [inj["sample"]]
                   for b in pre.get("batches") or [])
    if s.attribution == "software":
        return pre.get("op") == s.op and str(pre.get("module", "")).endswith("mlp.1") \
            and bool(pre.get("reproducer")) and ("precision" in pre) == s.precision
    if s.attribution == "params":
        return any(c.get("name") == "lr" for c in pre.get("params") or [])
    if s.attribution == "hardware":
        d = pre.get("device") or {}
        return d.get("rank") == FAULT_RANK and d.get("cpus") == inj["cpus"]
    return False


def _final_loss(run_dir: Path) -> float | None:
    steps = read_steps(run_dir, 0)
    return steps[max(steps)].get("loss") if steps else None


def run_drills(which: str, steps: int, out: Path, json_out: Path | None, retain_s: float = RETAIN_S,
               ranks: int = 2) -> int:
    names = [s.name for s in SCENARIOS] if which == "all" else which.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise UsageError(f"unknown scenario {unknown[0]!r}; choose from all, {', '.join(BY_NAME)}")
    if ranks < 2:
        raise UsageError("--ranks must be at least 2 (the faults are injected on rank 1)")
    if steps < MIN_STEPS:
        raise UsageError(f"--steps must be at least {MIN_STEPS} (faults fire at steps {FAULT_STEP} and {SECOND_STEP})")
    out.mkdir(parents=True, exist_ok=False)
    base_dir = out / "baseline"
    print(f"drill: fault-free baseline ({steps} steps, {ranks} ranks)", file=sys.stderr, flush=True)
    base = run(RunConfig(cmd=_job(steps, base_dir, ranks), out=base_dir, policy="observe", snapshot_interval=4, quiet=True))
    rows = []
    for name in names:
        s = BY_NAME[name]
        inject = [dict(s.inject, rank=FAULT_RANK, step=FAULT_STEP), *s.also]
        run_dir = out / name
        print(f"drill: {name}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        res = run(RunConfig(cmd=_job(steps, run_dir, ranks), out=run_dir, policy=s.policy, snapshot_interval=4,
                            detect=s.detect, inject=inject, retain_s=retain_s, rescue=s.rescue, quiet=True))
        row = score(s, res.incidents)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        row["exit_code"] = res.exit_code
        sha = _final_sha(run_dir)
        row["bit_identical"] = (sha == _final_sha(base_dir)) if sha else None
        if s.classification == "transient" or s.where == "reported":
            row["pass"] = row["pass"] and row["bit_identical"] is True and res.exit_code == 0
        if s.policy == "apply":
            loss = _final_loss(run_dir)
            row["final_loss"] = loss
            row["steps"] = res.steps
            row["pass"] = row["pass"] and res.exit_code == 0 and loss is not None and math.isfinite(loss)
        rows.append(row)
    _print(rows)
    if json_out:
        json_out.write_text(json.dumps({"baseline_steps": base.steps, "ranks": ranks, "scenarios": rows}, indent=1))
    return 0 if all(r["pass"] for r in rows) else 1


def _print(rows: list[dict]) -> None:
    cols = ("scenario", "detected", "classification", "localised", "attribution", "recovered", "steps_lost",
            "resume_s", "bit_identical", "pass")
    table = [cols] + [tuple("-" if r.get(c) is None else str(r.get(c)) for c in cols) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
