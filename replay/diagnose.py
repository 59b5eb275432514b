"""Track B: diagnose a persistent failure by counterfactual replay.

Every rank runs `diagnose` after a persistent verdict, while the live ranks
stay halted at the step boundary.  From the oldest verified snapshot every
rank holds, the window is replayed (coordinated, in the sandbox) again and
again, each time with one thing changed (variants.py):

  round 0  trace        op-level tracing: the first non-finite op (or the first
                        op whose output departs from the step before), its
                        module and inputs; the failing batch scanned for anomalies
  round 1  swap_batch   the failing step trained on another recorded batch
           drop_rows    the anomalous samples removed (only if there are any)
           lr_hold /    learning rate held at its value at the snapshot (if it
           lr_low       rose in the window), else a tenth of it
           clip         gradients clipped at the pre-failure norm
           other_cores  pinned ranks moved to the CPUs they were not using
           float64      the float64 reference: model, optimizer state and batches
                        in double precision

Which replays come back clean decides the attribution (data, hardware,
params, software), with the evidence and a causal chain from root cause to
symptom, and a prescription taken from the replay that worked.  Under
`--policy apply` the state of that replay is merged into the live ranks
(as in Track A) and training goes on from the failing step without the failure.

Rank 0 plans each round and judges; every rank replays its own snapshot.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path

import torch

from ..incident import load_incident, save_incident
from ..rundir import IncidentDir
from ..runtime.seam import Rank
from .plan import JobLog, diagnosis_start
from .rounds import WAIT_S, await_replays, load_results, replay_here, say
from .verdict import recoverable

PARAM_VARIANTS = ("lr_hold", "lr_low", "clip")
# How each counterfactual reads in evidence ("it fails as well ...").
AS_CHANGED = {"swap_batch": "with another batch", "drop_rows": "without the anomalous samples",
              "lr_hold": "with the learning rate held", "lr_low": "with a lower learning rate",
              "clip": "with clipped gradients", "other_cores": "on other CPUs", "float64": "in float64"}


def diagnose(rt: Rank, info: dict, plan: dict, inc_dir: IncidentDir) -> dict | None:
    """Run the diagnosis on every rank; returns the outcome rank 0 wrote
    ({"apply": variant or None}), or None when no diagnosis was possible."""
    inc_dir.diagnosis.mkdir(exist_ok=True)
    iid = info["incident_id"]
    if rt.rank == 0:
        rt.rundir.put(inc_dir.diagnosis_round(0), plan_trace(rt, info, plan, inc_dir))
    rt.ctl.wait(lambda: rt.rundir.has(inc_dir.diagnosis_round(0)), WAIT_S, "the diagnosis plan")
    first = rt.rundir.get(inc_dir.diagnosis_round(0))
    if first.get("from_step") is None:
        return None
    dplan = dict(plan, from_step=first["from_step"])
    t0 = time.monotonic()
    for rnd in (0, 1):
        path = inc_dir.diagnosis_round(rnd)
        rt.ctl.wait(lambda: rt.rundir.has(path), WAIT_S, f"diagnosis round {rnd}")
        for var in rt.rundir.get(path)["variants"]:
            say(rt, f"{iid}: counterfactual replay {var['name']}")
            replay_here(rt, first["from_step"], dplan["to_step"], inc_dir.variant(var["name"]),
                        f"{iid}-{var['name']}", dplan.get("replay_timeout_s", 120.0), variant=var,
                        keep_exchange=False)
        if rt.rank == 0 and rnd == 0:
            trace = _results(rt, inc_dir, "trace")
            rt.rundir.put(inc_dir.diagnosis_round(1), {"variants": plan_counterfactuals(rt, info, dplan, trace)})
    if rt.rank == 0:
        variants = {v["name"]: v for v in rt.rundir.get(inc_dir.diagnosis_round(1))["variants"]}
        results = {n: _results(rt, inc_dir, n) for n in ["trace"] + list(variants)}
        outcome = judge(rt, info, dplan, results, variants, inc_dir)
        outcome["diagnosis_s"] = round(time.monotonic() - t0, 3)
        rt.rundir.put(inc_dir.diagnosis_done, outcome)
    rt.ctl.wait(lambda: rt.rundir.has(inc_dir.diagnosis_done), WAIT_S, "the diagnosis")
    return rt.rundir.get(inc_dir.diagnosis_done)


def _results(rt: Rank, inc_dir: IncidentDir, name: str) -> list[dict]:
    out = inc_dir.variant(name)
    await_replays(rt, out, f"every rank's {name} replay")
    return load_results(rt, out)


# -- planning (rank 0) ------------------------------------------------------------------------

def plan_trace(rt: Rank, info: dict, plan: dict, inc_dir: IncidentDir) -> dict:
    """Round 0: from the oldest verified snapshot every rank holds, so the
    window reaches back before a cause that came a few steps early."""
    v = diagnosis_start(rt, info, inc_dir)
    say(rt, f"diagnosing {info['incident_id']}: counterfactual replays of steps {v}..{plan['to_step']}"
        if v is not None else f"diagnosing {info['incident_id']}: no verified snapshot to replay from")
    trace = {"name": "trace", "trace": {"failing_step": info["failing_step"]}}
    ran = as_ran(rt, info["failing_step"])
    if ran:
        trace["cpus"] = ran
    return {"from_step": v, "to_step": plan["to_step"], "variants": [trace]}


def as_ran(rt: Rank, k: int) -> dict | None:
    """{rank: [the core it ran step k on]} from the step lines, when every rank's is known.

    The diagnosis replays run there: a fault of one core then comes back in
    every replay but the one moved off it, whichever core the scheduler
    would have picked (on a small machine a rank's threads float between cores)."""
    ran = {}
    for r in range(rt.world):
        cpu = (rt.rundir.read_steps(r, since=k).get(k) or {}).get("cpu")
        if cpu is None:
            return None
        ran[str(r)] = [cpu]
    return ran


def plan_counterfactuals(rt, info: dict, plan: dict, trace: list[dict]) -> list[dict]:
    k = info["failing_step"]
    anomalous = {r: res.get("batch_anomalies") or [] for r, res in enumerate(trace)}
    bad_ranks = [r for r, a in anomalous.items() if a]
    out = [{"name": "swap_batch", "swap_batch": {"step": k, "ranks": bad_ranks or list(range(rt.world))}}]
    if bad_ranks:
        out.append({"name": "drop_rows", "drop_rows": {"step": k, "rows": {
            str(r): sorted({a["sample"] for a in anomalous[r]}) for r in bad_ranks}}})
    elif (rows := _spoiled_rows(trace, k)) is not None:
        # Nothing odd in the data itself, but the first bad op went bad in
        # some samples' rows only: the window without them says whether
        # those samples trigger it (a bug the data sets off).
        out.append({"name": "drop_rows", "drop_rows": {"step": k, "rows": rows}})
    steps = trace[0].get("steps") or {}
    lrs = [(s, steps[s].get("lr")) for s in sorted(steps) if steps[s].get("lr")]
    rose = lrs and any(max(lr) > max(lrs[0][1]) for _, lr in lrs)
    # lr after the first replayed step is the snapshot's unless it rose there already;
    # holding it at the snapshot's value is what lr_factor 1.0 does.
    out.append({"name": "lr_hold", "lr_factor": 1.0} if rose else {"name": "lr_low", "lr_factor": 0.1})
    norms = [steps[s]["grad_norm"] for s in sorted(steps) if s < k and math.isfinite(steps[s].get("grad_norm") or math.nan)]
    if norms:
        out.append({"name": "clip", "clip": sorted(norms)[len(norms) // 2]})
    out.append({"name": "float64", "float64": True})
    ran = as_ran(rt, k)
    if ran:
        for v in out:
            v["cpus"] = ran
    moved = _other_cores(rt, ran, trace, info)
    if moved:
        out.insert(len(out) - 1, dict({"name": "other_cores"}, **moved))
    return out


def _spoiled_rows(trace: list[dict], k: int) -> dict | None:
    """{rank: rows} when the first non-finite op ran forward at step k, from
    finite inputs, and spoiled only some rows of a batch-shaped output."""
    origin = _origin(trace)
    if not origin or not origin.get("nonfinite") or not origin.get("inputs_finite") or origin["step"] != k \
            or origin.get("phase") != "forward":
        return None
    r = origin["rank"]
    rows, n = origin.get("bad_rows") or [], len(trace[r].get("row_digests") or [])
    if not rows or not n or origin["shape"][:1] != [n] or len(rows) >= n:
        return None
    return {str(r): rows}


def _first_bad_input(trace: list[dict]) -> int | None:
    """The one rank whose input to a collective was non-finite first (a
    gradient spoiled outside any traced op: a hook, a fault in the copy)."""
    firsts = {}
    for r, res in enumerate(trace):
        c = next((c for c in res.get("colls") or [] if c.get("in_nonfinite")), None)
        if c is not None:
            firsts[r] = (c["step"], c["seq"])
    if not firsts:
        return None
    first = min(firsts.values())
    ranks = [r for r, at in firsts.items() if at == first]
    return ranks[0] if len(ranks) == 1 else None


def _other_cores(rt: Rank, ran: dict | None, trace: list[dict], info: dict) -> dict | None:
    """The counterfactual that moves the rank the failure starts on (its first
    bad op, else its first non-finite collective input, else a rank the job
    pinned, else the detecting rank) to other CPUs, the others replaying where
    they ran: a rank the job pinned to some CPUs goes to the rest; a rank whose
    threads float goes off the core it ran the failing step on."""
    every = set(range(os.cpu_count() or 1))
    pinned = {}
    for r in range(rt.world):
        path = rt.rundir.affinity(r)
        got = rt.rundir.get(path) if rt.rundir.has(path) else None
        if got and set(got) < every:
            pinned[r] = sorted(got)
    origin = _origin(trace)
    r = origin["rank"] if origin else _first_bad_input(trace)
    if r is None and pinned:
        r = min(pinned)  # nothing in the trace says which: a rank the job pinned is where a core fault lives
    r = info.get("rank") if r is None else r  # else the rank that detected it
    if r is None or (r not in pinned and not (ran and str(r) in ran)):
        r = min(pinned) if pinned else None  # nothing says which: the first pinned rank
    if r is None:
        return None
    was = pinned.get(r) or ran[str(r)]
    rest = sorted(every - set(was))
    if not rest:
        return None
    return {"cpus": dict(ran or {}, **{str(r): rest}), "moved_rank": r, "from_cpus": was}


def record_affinity(rt: Rank) -> None:
    """Each rank says where it runs (its CPU set) before a diagnosis."""
    path = rt.rundir.affinity(rt.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    rt.rundir.put(path, sorted(os.sched_getaffinity(0)))


# -- judging (rank 0) --------------------------------------------------------------------------

def _clean(rt: Rank, plan: dict, results: list[dict], log: JobLog) -> tuple[bool, str | None]:
    got = recoverable(rt, plan, results, log)
    return bool(got["possible"]), got.get("reason")


def judge(rt: Rank, info: dict, plan: dict, results: dict, variants: dict, inc_dir: IncidentDir) -> dict:
    """Attribution, causal chain and prescription from the replays' outcomes;
    written into the incident.  Returns {"apply": variant name or None}."""
    verdict = load_incident(rt.rundir, info["incident_id"])
    found = conclude(rt, info, plan, results, variants, inc_dir.reproducer, JobLog.of(rt.rundir, inc_dir, rt.world))
    apply, cause = found.pop("apply"), found["attribution"]["cause"]
    verdict.update(**found)
    apply = apply if rt.policy == "apply" else None
    if apply:
        verdict.recovery = {"possible": True, "reason": None, "from_variant": apply}
    save_incident(rt.rundir, verdict)
    say(rt, f"{info['incident_id']}: {cause} (confidence {found['attribution']['confidence']}); prescription "
            f"{found['prescription']['action']}" + (f", applying it ({apply})" if apply else ""))
    return {"apply": apply, "cause": cause}


def conclude(rt, info: dict, plan: dict, results: dict, variants: dict, repro_dir: Path, log: JobLog) -> dict:
    """The incident's attribution, causal_chain, prescription and diagnosis
    fields, plus "apply" (the variant whose state would cure the failure);
    writes the reproducer into `repro_dir` for a software or hardware cause."""
    outcomes = {}
    for name, res in results.items():
        clean, why = _clean(rt, plan, res, log)
        outcomes[name] = {"clean": clean, "reason": why,
                          "changed": {k: v for k, v in (variants.get(name) or {"trace": True}).items() if k != "name"},
                          "wall_s": max((r.get("wall_ns") or 0) for r in res) / 1e9}
    trace = results["trace"]
    origin = _origin(trace)
    anomalies = {r: res.get("batch_anomalies") or [] for r, res in enumerate(trace)}
    cause, confidence, root, prescription, apply, *trigger = _attribute(rt, info, plan, outcomes, trace, origin,
                                                                         anomalies, variants)
    symptoms = _symptoms(info, trace, origin)
    if root and root["kind"] == "op":  # the culprit op is the root itself
        symptoms = [link for link in symptoms if link["kind"] != "op"]
    chain = ([root] if root else []) + trigger + symptoms
    if cause in ("software", "hardware") and origin and trace[origin["rank"]].get("trace", {}).get("culprit_inputs"):
        path = write_reproducer(repro_dir, info, origin, trace[origin["rank"]]["trace"]["culprit_inputs"], cause)
        prescription["reproducer"] = str(path)
    return {"attribution": {"cause": cause, "confidence": confidence,
                            "evidence": [f"{n}: {'clean' if o['clean'] else 'fails'}"
                                         + (f" ({o['reason']})" if o["reason"] and not o["clean"] else "")
                                         for n, o in outcomes.items()]},
            "causal_chain": chain, "prescription": prescription,
            "diagnosis": {"from_step": plan["from_step"], "to_step": plan["to_step"], "replays": outcomes,
                          "first_nonfinite": origin if origin and origin.get("nonfinite") else None,
                          "departure": origin if origin and not origin.get("nonfinite") else None,
                          "batch_anomalies": {r: a for r, a in anomalies.items() if a}},
            "apply": apply}


def _origin(trace: list[dict]) -> dict | None:
    """Where the failure starts: the earliest first non-finite op over the
    ranks (a rank that received NaN through a collective meets it after that
    collective), else the earliest departing op."""
    for key in ("first_nonfinite", "departure"):
        found = [dict(res["trace"][key], rank=r) for r, res in enumerate(trace)
                 if (res.get("trace") or {}).get(key)]
        if found:
            return min(found, key=lambda o: (o["step"], o.get("phase") != "forward", o["colls_before"], o["i"], o["rank"]))
    return None


def _attribute(rt, info, plan, outcomes, trace, origin, anomalies, variants):
    k = info["failing_step"]
    ok = {n for n, o in outcomes.items() if o["clean"]}
    if "trace" in ok:
        return ("unknown", 0.0, None, {"action": "none", "reason": "the failure did not reproduce from the older snapshot"},
                None)
    bad = {r: a for r, a in anomalies.items() if a}
    if bad and ({"drop_rows", "swap_batch"} & ok):
        used = "drop_rows" if "drop_rows" in ok else "swap_batch"
        batches = [{"rank": r, "step": k, "batch_index": trace[r].get("batch_index"),
                    "samples": sorted({x["sample"] for x in a}),
                    "digests": [str(d) for _, d in sorted((trace[r].get("sample_digests") or {}).items())]}
                   for r, a in bad.items()]
        ev = "; ".join(x["evidence"] for a in bad.values() for x in a[:3])
        root = {"kind": "batch", "step": k, "rank": min(bad), "module": None, "op": None, "collective": None,
                "batch_index": batches[0]["batch_index"], "samples": batches[0]["samples"],
                "evidence": f"{ev}; without them ({used}) the window replays clean"}
        return ("data", 0.95 if used == "drop_rows" else 0.8, root,
                {"action": "skip_batch", "batches": batches, "verified_by": used, "applied": False}, used)
    # Clean without the samples, and not a float32 precision failure (clean in float64: below).
    if not bad and "drop_rows" in ok and "float64" not in ok and origin and origin.get("nonfinite") \
            and origin.get("inputs_finite"):
        return _data_triggered(k, origin, trace, variants["drop_rows"]["drop_rows"]["rows"])
    if "other_cores" in ok:
        v = variants["other_cores"]
        moved, r, was = v["cpus"], v["moved_rank"], v["from_cpus"]
        device = {"host": socket.gethostname(), "rank": r, "kind": "cpu", "cpus": was}
        root = {"kind": "device", "step": k, "rank": r, "module": None, "op": None, "collective": None,
                "evidence": f"rank {r} on CPUs {was} fails; the same inputs replayed on CPUs {moved[str(r)]} are clean"}
        return ("hardware", 0.9, root, {"action": "quarantine_device", "device": device,
                                        "move_to": {"cpus": moved[str(r)]}, "verified_by": "other_cores",
                                        "applied": False}, "other_cores")
    params = [n for n in PARAM_VARIANTS if n in ok]
    if params and not bad:
        used = params[0]
        v = variants[used]
        steps = trace[0].get("steps") or {}
        lr_seq = [(s, steps[s]["lr"]) for s in sorted(steps) if steps[s].get("lr")]
        if "lr_factor" in v:
            base = lr_seq[0][1] if lr_seq else None
            target = [x * v["lr_factor"] for x in base] if base else None
            change = [{"param_group": i, "name": "lr", "to": t} for i, t in enumerate(target or [])]
            rise = _lr_jump(lr_seq)
            ev = (f"learning rate jumped from {rise[2]:g} to {max(rise[1]):g} at step {rise[0]} ({_times(rise[3])} in "
                  f"one step" + (f"; before it, at most {_times(rise[4])} a step" if rise[4] else "") + ")" if rise
                  else f"training at learning rate {max(base):g} is unstable here") if base else "learning rate"
            root = {"kind": "hyperparameter", "step": rise[0] if rise else k, "rank": None, "module": None, "op": None,
                    "collective": None, "evidence": f"{ev}; replayed with lr {max(target):g} the window is clean"}
        else:
            change = [{"name": "max_grad_norm", "to": v["clip"]}]
            root = {"kind": "hyperparameter", "step": k, "rank": None, "module": None, "op": None, "collective": None,
                    "evidence": f"gradients clipped at the pre-failure norm {v['clip']:.4g} make the window clean"}
        return ("params", 0.85, root, {"action": "adjust_params", "params": change, "verified_by": used,
                                       "applied": False}, used)
    if origin and ok <= {"float64"}:
        finite = origin.get("inputs_finite", True)
        failing = [AS_CHANGED[n] for n in outcomes if n != "trace" and n not in ok and n in AS_CHANGED]
        what = (f"{origin['op']} in {origin['module']} produced {origin['nonfinite']} non-finite values "
                f"from {'finite' if finite else 'non-finite'} inputs" if origin.get("nonfinite") else
                f"{origin['op']} in {origin['module']} output norm {origin['norm']:.4g}, "
                f"{origin['ratio']:.3g}x {origin.get('compared_with')}")
        prescription = {"action": "fix_kernel", "op": origin["op"], "module": origin["module"],
                        "step": origin["step"], "rank": origin["rank"], "applied": False}
        if ok:  # clean in double precision only: the op's float32 numerics (overflow, cancellation)
            prescription["precision"] = "float32 fails, float64 is clean: compute this op in higher precision or rescale"
            root = {"kind": "op", "step": origin["step"], "rank": origin["rank"], "module": origin["module"],
                    "op": origin["op"], "collective": None,
                    "evidence": f"{what}; the same window replayed in float64 is clean (a float32 precision failure)"
                                + (f"; it fails {', '.join(failing)}" if failing else "")}
            return "software", 0.7, root, prescription, None
        root = {"kind": "op", "step": origin["step"], "rank": origin["rank"], "module": origin["module"],
                "op": origin["op"], "collective": None,
                "evidence": what + (f"; it fails as well {', '.join(failing)}" if failing else "")}
        return "software", 0.8 if finite else 0.6, root, prescription, None
    return ("unknown", 0.0, None, {"action": "none", "reason": "no counterfactual isolated the cause"}, None)


def _times(r: float) -> str:
    return f"{r:.0f}x" if r >= 10 else f"{r:.3g}x"


def _lr_jump(lr_seq: list[tuple[int, list[float]]]) -> tuple | None:
    """The step where the learning rate rose most in one step (a warm-up's
    gentle climb is not the jump that broke the run): (step, lrs, lr before,
    that step's ratio, the largest ratio before it), or None if it never rose."""
    ratios = [(s, lr, max(prev), max(lr) / max(prev)) for (_, prev), (s, lr) in zip(lr_seq, lr_seq[1:])
              if max(prev) > 0]
    rises = [x for x in ratios if x[3] > 1]
    if not rises:
        return None
    s, lr, before, ratio = max(rises, key=lambda x: x[3])
    earlier = [x[3] for x in rises if x[0] < s]
    return s, lr, before, ratio, max(earlier) if earlier else None


_GUARDS = {"div": "guard the division against a zero denominator (clamp it, e.g. count.clamp(min=1), or mask "
                  "the result)",
           "log": "guard the log against zero or negative inputs (clamp to a small positive value)",
           "sqrt": "guard the sqrt against negative inputs, and its gradient at zero (add an epsilon)",
           "rsqrt": "guard the rsqrt against zero (add an epsilon)",
           "pow": "guard the power against zero bases with negative exponents"}


def _data_triggered(k: int, origin: dict, trace: list[dict], rows: dict) -> tuple:
    """A software bug the data sets off: an op turned finite inputs into
    non-finite values in a few samples' rows only, and the window without
    those samples is clean.  The op is the cause; the samples its trigger."""
    batches = [{"rank": int(r), "step": k, "batch_index": trace[int(r)].get("batch_index"), "samples": rs,
                "digests": [trace[int(r)]["row_digests"][i] for i in rs]} for r, rs in sorted(rows.items())]
    line = origin.get("line") or {}
    at = f"{os.path.basename(line['file'])}:{line['line']} ({line['source']})" if line else "its Python line unknown"
    where = f"in {origin['module']}" if origin.get("module") else "outside any module"
    samples = "; ".join(f"rank {b['rank']} samples {b['samples']}" for b in batches)
    root = {"kind": "op", "step": origin["step"], "rank": origin["rank"], "module": origin["module"] or None,
            "op": origin["op"], "collective": None, "line": line or None,
            "evidence": f"{origin['op']} {where} at {at} turned finite inputs into {origin['nonfinite']} non-finite "
                        f"value(s), in the rows of {samples} only; without those samples the window replays clean: "
                        f"a bug the data triggers"}
    trigger = {"kind": "batch", "step": k, "rank": batches[0]["rank"], "module": None, "op": None, "collective": None,
               "batch_index": batches[0]["batch_index"], "samples": batches[0]["samples"],
               "evidence": f"the samples that set it off ({samples}): their values are finite, the op's handling of "
                           f"them is not"}
    prescription = {"action": "skip_batch", "batches": batches, "verified_by": "drop_rows", "applied": False,
                    "fix": {"op": origin["op"], "module": origin["module"] or None, "line": line or None,
                            "advice": _GUARDS.get(origin["op"].split("::")[-1].split(".")[0],
                                                  "guard this op against these inputs (clamp them or mask its result)")
                                      + "; meanwhile these samples are skipped"}}
    return "software", 0.85, root, prescription, "drop_rows", trigger


def _symptoms(info: dict, trace: list[dict], origin: dict | None) -> list[dict]:
    """From the first bad op to the detector: op, loss, the collective that
    spread it, the detection."""
    links = []
    if origin:
        links.append({"kind": "op", "step": origin["step"], "rank": origin["rank"], "module": origin["module"],
                      "op": origin["op"], "collective": None, "phase": origin.get("phase"),
                      "evidence": (f"first non-finite output ({origin['nonfinite']} values, shape {origin['shape']}) from "
                                   + ("finite" if origin.get("inputs_finite") else "non-finite") + " inputs"
                                   if origin.get("nonfinite") else
                                   f"first departing output: norm {origin['norm']:.4g} vs {origin['before_norm']:.4g} "
                                   f"for {origin.get('compared_with', 'the same op the step before')}")})
        r, k = origin["rank"], origin["step"]
        fp = ((trace[r].get("steps") or {}).get(k)) or {}
        if fp:
            links.append({"kind": "loss", "step": k, "rank": r, "module": None, "op": None, "collective": None,
                          "evidence": f"loss {fp.get('loss')} at step {k} on rank {r}"})
        spread = next((c for c in trace[r].get("colls") or [] if c["step"] >= k and c.get("out_nonfinite")), None)
        if spread:
            links.append({"kind": "collective", "step": spread["step"], "rank": r, "module": None, "op": None,
                          "collective": {"group": spread["group"], "seq": spread["seq"], "op": spread["op"]},
                          "evidence": f"{spread['op']} #{spread['seq']} spread non-finite values to ranks "
                                      f"0..{len(trace) - 1}"})
    links.append({"kind": "detector", "step": info["failing_step"], "rank": info["rank"], "module": None, "op": None,
                  "collective": None, "evidence": f"{info['kind']} detected at step {info['failing_step']} "
                                                  f"on rank {info['rank']}"})
    return links


# -- the standalone reproducer ---------------------------------------------------------------

REPRO = '''"""Standalone reproducer: {op} in module {module}, step {step}, rank {rank} ({cause}).

Needs only torch.  Calls the op once on the saved inputs (inputs.pt, next to
this file) and checks its output: exit 1 if the failure reproduces here
(non-finite output, or an output norm far from the one recorded on a healthy
replay), 0 if it does not.
"""
import math
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
saved = torch.load(os.path.join(here, "inputs.pt"), weights_only=False)
ns, _, rest = saved["op"].partition("::")
name, _, overload = rest.partition(".")
op = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
out = op(*saved["args"], **saved["kwargs"])
outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
bad = sum(int(t.numel() - torch.isfinite(t).sum()) for t in outs if t.is_floating_point())
print(f"{{saved['op']}}: {{bad}} non-finite output values")
if bad:
    print("reproduced")
    sys.exit(1)
if saved.get("healthy_norm"):
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in outs if t.is_floating_point()))
    ratio = norm / saved["healthy_norm"]
    print(f"output norm {{norm:.6g}}, {{ratio:.3g}}x the healthy replay's")
    if ratio > 10 or ratio < 0.1:
        print("reproduced")
        sys.exit(1)
print("not reproduced")
'''


def write_reproducer(out: Path, info: dict, origin: dict, inputs: dict, cause: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    saved = dict(inputs, healthy_norm=origin.get("before_norm"))
    torch.save(saved, out / "inputs.pt")
    script = out / "repro.py"
    script.write_text(REPRO.format(op=origin["op"], module=origin["module"], step=origin["step"], rank=origin["rank"],
                                   cause=cause))
    return script
