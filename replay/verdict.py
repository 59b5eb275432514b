"""The verdict on an incident (rank 0), from every rank's replay of its window.

Reproduced or not: a failure whose replay is exact (every fingerprint and
collective input as recorded) and shows no divergence came back, so it is
persistent (Track B); a replay that departs from the record localises a
transient (Track A) to its rank, step and collective, in compute or in
communication.  A hang is reproduced when its replay times out too; a crash
when its replay dies the same way.  Transients that keep coming back on one
rank escalate to persistent (a bad device).
"""

from __future__ import annotations

import copy
import math
import signal

from .. import health
from ..incident import Incident
from ..rundir import ReplayDir, read_json
from ..runtime import crashsite
from ..runtime.seam import Rank
from .plan import JobLog, full_param_sum
from .rounds import load_results

# Persistent failures diagnosed by counterfactual replay (a hang or a crash is
# reported with where each rank was, not replayed with variants).
DIAGNOSED = ("non_finite", "loss_spike", "sdc")


def decide(rt: Rank, info: dict, plan: dict, out: ReplayDir, log: JobLog,
           results: list[dict] | None = None) -> Incident:
    world = rt.world
    replayed = [rt.rundir.get(out.replayed(r)) for r in range(world)]
    results = results if results is not None else load_results(rt, out)
    if plan.get("from_step") is None:
        return Incident.unclassified(info, plan, plan.get("reason"))
    verdict = Incident.unclassified(info, plan, "")
    divs = [res["first_divergence"] for res in results if res.get("first_divergence")]
    # The earliest divergence; at the same collective a rank whose own input
    # differed (compute) explains the others' differing outputs.
    div = min(divs, key=lambda d: (d["step"], d["collective"]["seq"], d["where"] != "compute")) if divs else None
    statuses = {r: results[r].get("status") for r in range(world)}
    timed_out = [r for r in range(world) if replayed[r].get("timed_out")]
    exact = all(statuses[r] == "done" and all(s["match"] for s in results[r]["steps"].values())
                and all(c["match"] for c in results[r]["colls"]) for r in range(world))
    stall = (stuck_rank(rt, info["incident_id"]) or find_stall(rt, plan, log)) if info["kind"] == "hang" else None
    if info["kind"] == "replay_check":  # a healthy window replayed on request: no failure to classify
        verdict.replay = {"reproduced": None, "exact": exact, "first_divergence": div,
                          "per_rank": {r: {"status": statuses[r], "steps": len(results[r].get("steps", {})),
                                           "collectives": len(results[r].get("colls", [])),
                                           "wall_s": replayed[r].get("wall_s")} for r in range(world)},
                          "window_wall_s": plan.get("window_wall_s")}
        return verdict
    # A replay that timed out is an answer only for a hang.
    incomplete = [r for r in range(world) if statuses[r] != "done"
                  and (r not in timed_out or info["kind"] != "hang")]
    if incomplete and not (info["kind"] == "hang" and timed_out):
        # A replay that could not finish proves nothing either way.  For a
        # hang, a timeout is the answer (its peers' replays, left waiting on
        # it, end as they may); a replay that failed with none timed out is not.
        verdict.replay = {"reproduced": None, "exact": False, "first_divergence": div,
                          "reason": "; ".join(f"rank {r}: {statuses[r]}"
                                              + (f" ({(results[r].get('error') or '').strip().splitlines()[-1]})"
                                                 if results[r].get("error") else "") for r in incomplete)}
        return verdict
    reproduced = bool(timed_out) if info["kind"] == "hang" else exact and not div
    verdict.replay = {
        "reproduced": reproduced, "exact": exact, "first_divergence": div,
        "stall": stall,
        "per_rank": {r: {"status": statuses[r], "error": results[r].get("error"),
                         "steps": len(results[r].get("steps", {})),
                         "mismatched_steps": sorted(k for k, s in results[r].get("steps", {}).items()
                                                    if not s["match"]),
                         "wall_s": replayed[r].get("wall_s"), "exit_code": replayed[r].get("exit_code"),
                         "timed_out": bool(replayed[r].get("timed_out")),
                         "replay_s": round(results[r]["wall_ns"] / 1e9, 3) if results[r].get("wall_ns") else None,
                         "exchange_ms": results[r].get("exchange_ms")}
                     for r in range(world)},
        "window_wall_s": plan.get("window_wall_s"),
    }
    if reproduced:
        verdict.update(classification="persistent", track="B",
                       snapshot={"from_step": plan["from_step"], "retained": True})
        return verdict
    cause = ("communication" if div and div["where"] == "communication" else "bit_flip" if div else
             "timeout" if info["kind"] == "hang" else "unknown")
    verdict.update(classification="transient", track="A", transient_cause=cause)
    suspect = div["rank"] if div else stall["rank"] if stall else None
    repeats = earlier_transients(rt, suspect, info["failing_step"]) if suspect is not None else []
    # The device the divergence ran on, and how often it failed before (this
    # run, and every run on the node with --health-dir): health.py.
    device = health.step_device(rt.rundir.read_steps(div["rank"]), div["step"]) if div else None
    if div is not None:
        div["device"] = device
    ledger = health.Ledger.for_run(rt.rundir.root)
    recurring = health.repeat_verdict(ledger, device, info["incident_id"], str(rt.rundir.root)) if device else None
    if recurring:
        # Each failure replayed clean, but they keep landing on one device.
        prescription = health.quarantine_prescription(ledger, device, suspect)
        verdict.update(classification="persistent", track="B", transient_cause=None,
                       escalated=dict(recurring, rank=suspect),
                       attribution={"cause": "hardware", "confidence": 0.8, "evidence": recurring["reason"]},
                       causal_chain=[{"kind": "device", "step": div["step"], "rank": suspect, "module": None,
                                      "op": None, "collective": div.get("collective"), "device": device,
                                      "evidence": recurring["reason"] + "; this one: rank "
                                      f"{suspect}'s {div['where']} at step {div['step']} departed from the "
                                      "record and its replay was clean"}],
                       prescription=prescription,
                       snapshot={"from_step": plan["from_step"], "retained": True})
        # The replay was clean: its state can still replace the live one (under --policy apply).
        verdict.recovery = recoverable(rt, plan, results, log)
    elif len(repeats) + 1 >= rt.detectors.transient_limit:
        # The same rank keeps failing: not bad luck but a bad device.
        verdict.update(classification="persistent", track="B", transient_cause=None,
                       escalated={"rank": suspect, "transients": repeats + [info["incident_id"]],
                                  "reason": f"{len(repeats) + 1} transients on rank {suspect} within "
                                            f"{rt.detectors.transient_window} steps: hardware suspect"},
                       snapshot={"from_step": plan["from_step"], "retained": True})
    else:
        verdict.recovery = recoverable(rt, plan, results, log)
    return verdict


def copy_outcome(rt: Rank, info: dict, plan: dict, out: ReplayDir, log: JobLog) -> dict:
    """Does the replay from a state copy stand as the incident's replay?

    The copy carries the training state but not the program's own Python
    state, which is the fork's.  So the replay stands only when every rank
    re-executed every step before the fault exactly as recorded (fingerprints
    and collective inputs), at least one of them (the copy is chosen two steps
    before the failing step for that); and only for a transient verdict: a persistent
    failure is confirmed and diagnosed from the fork snapshot itself, whose
    state is the live rank's whole state.  Returns {"accepted", "reason",
    "verdict" (an Incident)}."""
    results = load_results(rt, out)
    verdict = decide(rt, info, plan, out, log, results)
    first = plan["from_step"] + 1
    # Every step before the fault must replay as recorded: up to the first
    # localised divergence, or up to the failing step when there is none.
    div = (verdict.replay or {}).get("first_divergence")
    clean_to = min(div["step"], plan["failing_step"]) if div else plan["failing_step"]
    reason = None
    for r, res in enumerate(results):
        if res.get("status") != "done":
            reason = f"rank {r}'s replay from the copy ended with {res.get('status')}: " \
                     f"{((res.get('error') or '').strip().splitlines() or [''])[-1]}"
            break
        if clean_to <= first:
            reason = f"the first divergence is at step {clean_to}, the first step replayed from the copy"
            break
        for k in range(first, clean_to):
            fp = res.get("steps", {}).get(k)
            if fp is None or not fp["match"]:
                reason = f"rank {r} did not replay step {k} as recorded ({', '.join(fp['diff']) if fp else 'missing'})"
            elif not all(c["match"] for c in res["colls"] if c["step"] == k):
                reason = f"rank {r}'s collective inputs at step {k} differ from the record"
            if reason:
                break
        if reason:
            break
    if reason is None and verdict.classification != "transient":
        reason = f"classified {verdict.classification}: confirmed from the fork snapshot"
    if reason is None and rt.policy in ("recover", "apply") and not (verdict.recovery or {}).get("possible"):
        reason = f"not recoverable from the copy: {(verdict.recovery or {}).get('reason')}"
    if reason is None:
        verdict.replay["state_copy"] = {"step": plan["state_copy"], "fork_step": plan["fork_step"]}
    return {"accepted": reason is None, "reason": reason, "verdict": verdict}


def find_stall(rt: Rank, plan: dict, log: JobLog) -> dict | None:
    """The collective that waited longest in the window, and the rank that entered it last."""
    colls = [log.colls(r) for r in range(rt.world)]
    lo, hi = (plan.get("from_step") or -1), plan["failing_step"]
    best = None
    for key, c in colls[0].items():
        if not (lo < c["step"] <= hi):
            continue
        per_rank = [colls[r].get(key) for r in range(rt.world)]
        if any(p is None or p.get("dur") is None for p in per_rank):
            continue
        wait = max(p["dur"] for p in per_rank)
        late = max(range(rt.world), key=lambda r: per_rank[r]["ts"])
        if best is None or wait > best["wait_s"] * 1e9:
            best = {"rank": late, "step": c["step"], "wait_s": round(wait / 1e9, 3),
                    "collective": {"group": key[0], "seq": key[1], "op": c["op"]}}
    return best


def stuck_rank(rt: Rank, incident_id: str) -> dict | None:
    """A hang handled while the ranks were stuck (runtime/rank.py): the rank
    outside every collective, whom the others wait for inside one, with its
    step and where its training thread was (Python frames, system call)."""
    inc_dir = rt.rundir.incident_dir(incident_id)
    found = []
    for r in range(rt.world):
        try:
            s = (rt.rundir.get(inc_dir.arrive(r)) or {}).get("stuck")
        except Exception:
            s = None
        if s and s.get("in_flight") == 0:
            found.append({"rank": r, "step": s["step"], "outside_collective": True, "where": s.get("where"),
                          "collective": None, "wait_s": None})
    return min(found, key=lambda f: (f["step"], f["rank"])) if found else None


def earlier_transients(rt: Rank, rank: int, step: int) -> list[str]:
    """Earlier incidents of this run classified transient and pinned on `rank`, within the window."""
    found = []
    for p in rt.rundir.incident_paths():
        try:
            inc = read_json(p)
        except (OSError, ValueError):
            continue
        rep = inc.get("replay") or {}
        where = rep.get("first_divergence") or rep.get("stall") or {}
        if (inc.get("classification") == "transient" and where.get("rank") == rank
                and step - (inc.get("detected_step") or 0) <= rt.detectors.transient_window):
            found.append(inc["incident_id"])
    return found


def recoverable(rt: Rank, plan: dict, results: list[dict], log: JobLog) -> dict:
    """Can the replayed end state replace the live one?  It must be complete,
    computed (not copied from a record that may carry the fault), finite,
    unremarkable to the detectors, and the same on every replica."""
    to = plan["to_step"]
    why = None
    for r, res in enumerate(results):
        if res.get("status") != "done" or "state" not in res:
            why = f"rank {r}'s replay did not finish ({res.get('status')})"
        elif res.get("from_record"):
            why = f"rank {r} replayed collectives Watcher cannot compute ({res['from_record'][0]}...)"
        if why:
            return {"possible": False, "reason": why}
    for r, res in enumerate(results):
        # Each rank's replayed losses against that rank's own recorded history.
        detectors = copy.deepcopy(rt.detectors)
        recorded = log.losses(r)
        detectors.history = [recorded[s] for s in sorted(recorded) if s < plan["failing_step"]
                             and recorded[s] is not None and math.isfinite(recorded[s])
                             ][-detectors.loss_spike_window:]
        for k in range(plan["from_step"] + 1, to + 1):
            fp = res["steps"].get(k)
            if fp is None:
                return {"possible": False, "reason": f"step {k} is missing from rank {r}'s replay"}
            hit = detectors.check_step(fp) if k >= plan["failing_step"] else None
            if hit:
                return {"possible": False,
                        "reason": f"the replayed step {k} is itself anomalous on rank {r} ({hit['kind']})"}
    sums = {full_param_sum(res["steps"][to]) for res in results}
    if rt.replicated and len(sums) > 1:
        return {"possible": False, "reason": f"the replicas disagree after the replay of step {to}"}
    return {"possible": True, "reason": None, "param_sums": [full_param_sum(res["steps"][to]) for res in results]}


def crash_replay_verdict(reply: dict, result: dict, snap_step: int, crash: dict, site: dict | None = None) -> dict:
    """The replay part of a crash incident, from the crashed rank's snapshot
    reply (its wait status), replay result and crash site: did it die again,
    the way the rank died (`crash`: its exit_signal or exit_code, and its
    `site`, runtime/crashsite.py)?  A replay killed by another signal (the
    sandbox's SIGSYS, a SIGKILL from outside), or by the same signal at
    another place, answers nothing."""
    sig = -reply["exit_code"] if reply.get("exit_code") is not None and reply["exit_code"] < 0 else None
    replay_status = result.get("status") if result else None
    reason = None
    same_site = crashsite.same_site(crash.get("site"), site) if sig is not None else None
    if sig is not None:
        again = True if sig == crash.get("exit_signal") and same_site is not False else None
        if sig != crash.get("exit_signal"):
            reason = (f"the replay died of {signal.Signals(sig).name}, the rank of "
                      f"{crash.get('how') or crash.get('exit_code')}: not the same death, so no answer")
        elif again is None:
            reason = (f"the replay died of {signal.Signals(sig).name} as the rank did, but at "
                      f"{crashsite.describe(site)}, not at {crashsite.describe(crash['site'])}: "
                      "another fault, so no answer")
    elif replay_status == "exception" and reply.get("exit_code") == 1:
        # A Python exception in the replay: the same death when the rank died of an error exit.
        again = True if not crash.get("exit_signal") else None
        if again is None:
            reason = f"the replay raised an exception, the rank died of {crash.get('how')}: no answer"
    elif replay_status == "done":
        again = False  # ran past the crash point
    else:
        again = None   # ran out of record or left no result: no answer
        reason = f"the replay ended {replay_status or 'without a result'} before the crash step"
    out = {"reproduced": again, "crashed_again": again,
           "replay_signal": signal.Signals(sig).name if sig else None,
           "replay_site": site, "same_site": same_site,
           "replay_status": result.get("status") if result else ("killed" if sig else None),
           "replayed_steps": sorted(result.get("steps", {})) if result else None,
           "first_divergence": result.get("first_divergence") if result else None,
           "from_step": snap_step, "wait_status": reply.get("status")}
    if reason:
        out["reason"] = reason
    return out


def classify_crash(verdict: Incident) -> None:
    """Persistent when the replay crashed again, transient when it ran past
    the crash.  A persistent crash's causal chain is its site: the faulting
    native frame, the Python line that led there, the death."""
    again = (verdict.replay or {}).get("crashed_again")
    if again is not None:
        verdict.update(classification="persistent" if again else "transient", track="B" if again else "A",
                       transient_cause=None if again else "unknown")
    if again:
        verdict.causal_chain = crash_chain(verdict)
        site = (verdict.detail or {}).get("crash_site")
        if site:
            # The same instruction faulting again from the same state is the
            # program's doing, not a device's: fix the code at the site.
            where = crashsite.innermost(site)
            verdict.attribution = {"cause": "software", "confidence": 0.8 if verdict.replay.get("same_site") else 0.5,
                                   "evidence": f"the replay from step {verdict.replay.get('from_step')} died of "
                                               f"{site.get('signal')} at the same native and Python frames"}
            verdict.prescription = {"action": "fix_kernel", "op": where["native"], "module": where["python"],
                                    "native": where["native_named"],
                                    "python": where["python"], "site": crashsite.describe(site)}


def crash_chain(verdict: Incident) -> list[dict]:
    detail, rep = verdict.detail or {}, verdict.replay or {}
    site, k, rank = detail.get("crash_site") or {}, verdict.detected_step, verdict.detected_rank
    again = (f"the replay from step {rep.get('from_step')} died here again"
             + (" (same signal, same native and Python frames)" if rep.get("same_site") else ""))
    chain = []
    w = crashsite.innermost(site) if site else {}
    if w.get("native"):
        chain.append({"kind": "native", "step": k, "rank": rank, "op": w["native"], "module": w.get("native_named"),
                      "evidence": f"{site.get('signal')} at address {site.get('address')} in {w['native']}"
                                  + (f", called through {w['native_named']}" if w.get("native_named") else "")
                                  + f"; {again}"})
    for i, py in enumerate((site.get("python") or [])[:3]):
        chain.append({"kind": "code", "step": k, "rank": rank, "module": f"{py['file']}:{py['line']}",
                      "op": py["function"],
                      "evidence": ("the innermost Python frame: the call that faulted" if i == 0
                                   else "called from here")})
    chain.append({"kind": "detector", "step": k, "rank": rank,
                  "evidence": f"rank {rank} died of {detail.get('how')} in step {k}"
                              + ("" if site else f"; {again} (no frames: the rank died before writing them)")})
    return chain
