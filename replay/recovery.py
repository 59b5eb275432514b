"""Track A: merge the replay's verified state into the live ranks, and go on.

Every rank loads its replay's end state into itself (merge.py), checks it
against the replay's parameter checksum, and says so; rank 0 agrees on the
outcome for all and writes it into the incident.  Track B under --policy
apply ends the same way, merging the counterfactual replay that cured the
failure, and then the rank carries out the prescription.
"""

from __future__ import annotations

import time

import torch

from ..incident import load_incident, save_incident
from ..rundir import IncidentDir, ReplayDir
from ..runtime.seam import Rank
from .diagnose import diagnose, record_affinity
from .merge import merge_state
from .rounds import WAIT_S, say


def recover(rt: Rank, info: dict, plan: dict, t_halt: int, result_dir: ReplayDir) -> bool:
    """Load the replayed state in `result_dir` into this live rank, check it,
    and agree with every rank that all of them did.  True when training may go on."""
    iid = info["incident_id"]
    verdict = load_incident(rt.rundir, iid)
    rec = verdict.recovery or {}
    t0 = time.monotonic_ns()
    mine = {"rank": rt.rank, "ok": False, "tries": 0}
    if rec.get("possible"):
        try:
            res = torch.load(result_dir.result(rt.rank), weights_only=False)
            want = res["state"]["param_sum"]
            # A fault during the merge itself (a flipped bit in the copy) shows
            # as a checksum that is not the replay's: merge again, once.
            for attempt in (1, 2):
                mine["tries"] = attempt
                got = merge_state(rt, res["state"])
                if got == want:
                    mine["ok"] = True
                    break
                mine["error"] = f"merged parameters have checksum {got}, the replay {want}"
            if mine["ok"]:
                mine.pop("error", None)
                # The replayed fingerprints become the record of the recovered steps.
                fps = [{f: v for f, v in res["steps"][k].items() if f not in ("match", "diff", "_colls")}
                       for k in sorted(res["steps"])]
                rt.adopt_recovered_steps(fps, plan["to_step"], res["steps"][plan["to_step"]]["param_sum"])
        except Exception as e:
            mine["error"] = f"merge failed: {e}"
    else:
        mine["error"] = rec.get("reason") or "no recovery was planned"
    mine["merge_s"] = round((time.monotonic_ns() - t0) / 1e9, 4)
    rt.rundir.put(result_dir.merged(rt.rank), mine)
    if rt.rank == 0:
        try:
            rt.ctl.wait(lambda: rt.rundir.has_all([result_dir.merged(r) for r in range(rt.world)]), WAIT_S,
                        "every rank's merge")
            merged = [rt.rundir.get(result_dir.merged(r)) for r in range(rt.world)]
        except Exception as e:
            merged = [{"rank": rt.rank, "ok": False, "error": str(e)}]
        ok = all(m.get("ok") for m in merged)
        now = time.monotonic_ns()
        verdict.update(recovered=ok, resumed_at_step=plan["to_step"] + 1 if ok else None,
                       steps_lost=0 if ok else None)
        verdict.recovery = dict(rec, merged=merged, retried=any(m.get("tries", 0) > 1 for m in merged),
                                reason=None if ok else next((f"rank {m['rank']}: {m.get('error')}" for m in merged
                                                             if not m.get("ok")), rec.get("reason")),
                                # Wall clock when the detecting rank gave one: its monotonic
                                # clock is another node's on a multi-node job.
                                detect_to_resume_s=round(time.time() - info["detected_unix"], 3)
                                if info.get("detected_unix") else round((now - info["detected_ts"]) / 1e9, 3),
                                halt_to_resume_s=round((now - t_halt) / 1e9, 3))
        save_incident(rt.rundir, verdict)
        rt.rundir.put(result_dir.recovery, {"ok": ok})
    rt.ctl.wait(lambda: rt.rundir.has(result_dir.recovery), WAIT_S, "the recovery outcome")
    ok = bool(rt.rundir.get(result_dir.recovery).get("ok"))
    if ok:
        say(rt, f"incident {iid}: recovered; training resumes at step {plan['to_step'] + 1}, no step lost")
        rt.restart_history()  # the snapshots and window still hold the faulty live run
    return ok


def diagnose_and_apply(rt: Rank, info: dict, plan: dict, inc_dir: IncidentDir, t_halt: int) -> bool:
    """Track B (diagnose.py) on every rank; under --policy apply, merge the
    state of the counterfactual replay that cured the failure and carry out
    the prescription.  True when training may go on."""
    try:
        record_affinity(rt)
        outcome = diagnose(rt, info, plan, inc_dir)
    except Exception as e:
        say(rt, f"incident {info['incident_id']}: diagnosis failed: {e}")
        if rt.rank == 0 and not rt.rundir.has(inc_dir.diagnosis_done):
            rt.rundir.put(inc_dir.diagnosis_done, {"apply": None, "error": str(e)})
        outcome = None
    if not outcome or not outcome.get("apply"):
        return False
    ok = recover(rt, info, plan, t_halt, inc_dir.variant(outcome["apply"]))
    if ok:
        verdict = load_incident(rt.rundir, info["incident_id"])
        p = verdict.prescription or {}
        rt.apply_prescription(p, info["incident_id"])
        if rt.rank == 0:
            verdict.prescription = dict(p, applied=True, applied_at_step=rt.step + 1)
            save_incident(rt.rundir, verdict)
    return ok
