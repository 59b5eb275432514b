"""The incident protocol across ranks: halt, plan, replay, verdict, go on or stop.

Every rank runs `handle_incident` when it reaches the incident's halt step
(one step after detection, so no rank is ever left waiting inside a collective
of a step its peers will not run):

1. arrive: say which snapshots and copies it holds, wait for every rank;
2. plan (rank 0, plan.py): the verified state to start from and the window;
3. replay (rounds.py): each rank replays its own window from its snapshot, in
   the sandbox, coordinated through an exchange directory; first from a
   state copy when there is one, and from the fork if that does not stand;
4. verdict (rank 0, verdict.py): written as DIR/incidents/<id>.json;
5. go on: Track A merges a transient's replayed state (recovery.py), Track B
   diagnoses a persistent failure (diagnose.py) and under --policy apply
   merges the cure; otherwise the rank goes on (policy observe) or stops
   cleanly (exit STOP_EXIT_CODE).

The ranks meet through the node's control block (rt.ctl: arrived, plan and
verdict words) and the incident's directory (watcher/rundir.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from .. import health
from ..incident import Incident, load_incident, save_incident
from ..rundir import IncidentDir, exchange_dir, write_json
from ..runtime.seam import Rank
from ..runtime.supervisor import rescuable
from .plan import JobLog, fallback_plan, log_excerpt, make_plan
from .recovery import diagnose_and_apply, recover
from .rounds import WAIT_S, await_replays, forget_published, remove_tree, replay_here, say
from .verdict import DIAGNOSED, copy_outcome, decide


def handle_incident(rt: Rank, seq: int, info: dict, final: bool = False, stuck: dict | None = None) -> None:
    """With `stuck` (where the training thread is: its step, collectives in
    flight, frames), a hang handled by the rank's watchdog while its training
    thread is blocked (runtime/rank.py): replayed and judged as usual, but
    nothing can be merged into a thread that does not move."""
    ctl, k, iid = rt.ctl, rt.step, info["incident_id"]
    inc_dir = rt.rundir.incident_dir(iid).make()
    t_halt = time.monotonic_ns()
    rt.flush()  # the replays read every rank's window from disk
    snaps, copies = rt.usable_snapshots(), rt.copies.held() if rt.copies is not None else []
    rt.rundir.put(inc_dir.arrive(rt.rank),
                  {"rank": rt.rank, "step": k, "snapshots": snaps, "pid": os.getpid(),
                   "unsupported": rt.unsupported, "copies": copies, "log": log_excerpt(rt, snaps + copies, info),
                   "stuck": stuck})
    ctl.arrive(rt.rank, seq, k)
    say(rt, f"incident {iid} ({info['kind']} at step {info['failing_step']}, rank {info['rank']}): "
            + (f"stuck after step {k}, replaying from the watchdog" if stuck else f"halted at step {k}, replaying"))
    verdict = None
    plan = {}
    result_dir = None
    try:
        # At exit a peer that died first never arrives: do not hold the exit long.
        ctl.wait(lambda: all(ctl.arrived(r)[0] == seq or ctl.gone(r) for r in range(rt.world)),
                 30 if final else WAIT_S, "every rank to halt")
        gone = [r for r in range(rt.world) if ctl.gone(r)]
        if gone:
            raise RuntimeError(f"rank(s) {gone} failed open and cannot replay; the incident is recorded, not replayed")
        if rt.rank == 0:
            rt.rundir.put(inc_dir.plan, make_plan(rt, info, inc_dir))
            ctl.plan_seq = seq
        ctl.wait(lambda: ctl.plan_seq >= seq, WAIT_S, "the replay plan")
        plan = rt.rundir.get(inc_dir.plan)
        if plan.get("state_copy") is not None:
            # First the short window from the newest state copy; it stands
            # only if it proves itself (copy_outcome), else the fork's window.
            quick = inc_dir.from_copy.make()
            replay_here(rt, plan["fork_step"], plan["to_step"], quick, f"{iid}-copy", plan["replay_timeout_s"],
                        state_copy=plan["state_copy"], halted_ns=t_halt)
            if rt.rank == 0:
                await_replays(rt, quick)
                try:
                    outcome = copy_outcome(rt, info, plan, quick, JobLog.of(rt.rundir, inc_dir, rt.world))
                except Exception as e:
                    outcome = {"accepted": False, "reason": f"the verdict failed: {e}"}
                copied = outcome.pop("verdict", None)
                if outcome["accepted"]:
                    save_incident(rt.rundir, copied)
                else:
                    outcome["plan"] = fallback_plan(rt, plan, outcome["reason"], inc_dir)
                    rt.rundir.put(inc_dir.plan, outcome["plan"])
                rt.rundir.put(quick.outcome, outcome)
            ctl.wait(lambda: rt.rundir.has(quick.outcome), WAIT_S, "the state copy's verdict")
            outcome = rt.rundir.get(quick.outcome)
            remove_tree(exchange_dir(rt.window_dir, f"{iid}-copy"))
            if outcome["accepted"]:
                result_dir = quick
            else:
                plan = outcome["plan"]
        if result_dir is None:
            replay_here(rt, plan.get("from_step"), plan["to_step"], inc_dir, iid, plan.get("replay_timeout_s"),
                        halted_ns=t_halt)
            result_dir = inc_dir
            if rt.rank == 0:
                await_replays(rt, inc_dir)
                try:
                    verdict = decide(rt, info, plan, inc_dir, JobLog.of(rt.rundir, inc_dir, rt.world))
                except Exception as e:
                    verdict = Incident.unclassified(info, plan, f"the verdict failed: {e}")
                if plan.get("copy_attempt") and verdict.replay is not None:
                    verdict.replay["copy_attempt"] = plan["copy_attempt"]
                save_incident(rt.rundir, verdict)
        if rt.rank == 0:
            ctl.verdict_seq = seq
        ctl.wait(lambda: ctl.verdict_seq >= seq, WAIT_S, "the verdict")
        verdict = load_incident(rt.rundir, iid)
    except Exception as e:  # never leave the peers waiting on this rank
        say(rt, f"incident {iid}: {e}; going on without a verdict")
        if rt.rank == 0:
            if not rt.rundir.has(inc_dir.plan):
                rt.rundir.put(inc_dir.plan, {"failing_step": info["failing_step"], "from_step": None,
                                             "to_step": info["failing_step"], "reason": str(e)})
            if not rt.rundir.has(rt.rundir.incident_path(iid)):
                save_incident(rt.rundir, Incident.unclassified(info, {}, f"not replayed: {e}"))
            ctl.plan_seq = max(ctl.plan_seq, seq)
            ctl.verdict_seq = max(ctl.verdict_seq, seq)
        elif not rt.rundir.has(inc_dir.replayed(rt.rank)):
            rt.rundir.put(inc_dir.replayed(rt.rank), {"rank": rt.rank, "error": str(e)})
    rt.incident_handled(seq)
    remove_tree(exchange_dir(rt.window_dir, iid))
    _go_on(rt, info, plan, inc_dir, result_dir, verdict, t_halt, final, stuck)


def _go_on(rt: Rank, info: dict, plan: dict, inc_dir, result_dir, verdict: Incident | None, t_halt: int,
           final: bool, stuck: dict | None = None) -> None:
    """After the verdict: recover, diagnose, keep the snapshot, or stop.

    A stuck hang that is persistent would block again wherever the job went
    on: it stops (unless observing).  One that is transient (its replay ran
    past the point) is left to move on by itself: the stuck thread cannot be
    given the replayed state, and stopping a job that may still move is not
    Watcher's call."""
    iid = info["incident_id"]
    recovered = False
    acting = rt.policy in ("recover", "apply") and not final and stuck is None
    if stuck is not None and verdict and verdict.classification == "transient":
        replace = rescuable(rt)
        if rt.rank == 0:
            verdict.recovery = (
                {"possible": True, "method": "the rank stuck outside any collective is ended and replaced: every "
                 "rank resumes from its snapshot (the rescue; the crash incident that follows)"}
                if replace else
                {"possible": False, "reason": "the rank is stuck outside any collective and its training thread "
                 "cannot take the replayed state; the job is left to move on (the rescue, off here, replaces it)"})
            save_incident(rt.rundir, verdict)
        _close(rt, inc_dir, iid)
        if replace and stuck.get("in_flight") == 0:
            # This is the stuck rank (its peers wait inside a collective for it):
            # end it, and the launcher side replaces it (watcher/rescue.py).
            write_json(rt.rundir.rescue_cause(rt.rank), {"incident_id": iid, "step": stuck.get("step"),
                                                         "reason": "stuck outside any collective; its window "
                                                                   "replayed clean"})
            say(rt, f"incident {iid}: transient; ending this stuck rank to be replaced")
            os.kill(os.getpid(), signal.SIGKILL)
        say(rt, f"incident {iid}: transient, but the training thread is stuck: "
                + ("its rank is being replaced" if replace else "left as it is"))
        return
    if verdict and info["kind"] == "replay_check":  # a check, not a failure: say whether it matched
        exact = (verdict.replay or {}).get("exact")
        say(rt, f"replay check {iid}: " + ("the window matched the record exactly" if exact
                                           else "the window DIFFERS from the record"))
    elif verdict:
        say(rt, f"incident {iid}: {verdict.classification or 'unclassified'}"
                + (f" ({verdict.transient_cause})" if verdict.transient_cause else ""))
    if verdict and verdict.classification == "transient" and acting and info["kind"] != "replay_check":
        recovered = recover(rt, info, plan, t_halt, result_dir or inc_dir)
    recurring = verdict is not None and bool((verdict.escalated or {}).get("device"))
    if recurring and verdict.classification == "persistent" and acting:
        # Attributed by recurrence on one device (health.py): this window
        # replayed clean, so under --policy apply its state is merged and the
        # rank moves off the device; no counterfactual would show more.
        p = verdict.prescription or {}
        if rt.policy == "apply" and p.get("action") == "quarantine_device" and p.get("move_to"):
            recovered = recover(rt, info, plan, t_halt, result_dir or inc_dir)
            if recovered:
                rt.apply_prescription(p, iid)
                if rt.rank == 0:
                    done = load_incident(rt.rundir, iid)
                    done.prescription = dict(p, applied=True, applied_at_step=rt.step + 1)
                    save_incident(rt.rundir, done)
    elif verdict and verdict.classification == "persistent" and acting and info["kind"] in DIAGNOSED:
        recovered = diagnose_and_apply(rt, info, plan, inc_dir, t_halt)
    if verdict and verdict.classification == "persistent":
        # Keep the frozen snapshot out of rotation for diagnosis: the one
        # the diagnosis replayed from, if one ran, so that `watcher
        # diagnose` repeats it from the same state.
        start = plan.get("from_step")
        round0 = inc_dir.diagnosis_round(0)
        if rt.rundir.has(round0):
            start = rt.rundir.get(round0).get("from_step", start)
        if start is not None:
            rt.retain_snapshot(start, iid)
    _close(rt, inc_dir, iid)
    if rt.policy != "observe" and info["kind"] != "replay_check" and not final and not recovered:
        say(rt, f"stopping after incident {iid} (policy {rt.policy})")
        rt.stop_after_incident(iid)


def _close(rt: Rank, inc_dir: IncidentDir, iid: str) -> None:
    """The incident's last word: rank 0 enters it in the device health ledger
    (health.py).  On many nodes: once rank 0 has written the incident for the
    last time, every other node's leader copies it into its own run directory."""
    if rt.rank == 0:
        try:
            note_health(rt, load_incident(rt.rundir, iid).to_dict())
        except Exception as e:  # the ledger never stops the job
            print(f"watcher: rank 0: incident {iid} not entered in the health ledger: {e}", file=sys.stderr)
    if rt.rundir.shared is None:
        return
    if rt.rank == 0:
        rt.rundir.put(inc_dir.closed, {"incident_id": iid})
    else:
        try:
            rt.ctl.wait(lambda: rt.rundir.has(inc_dir.closed), 60, "the incident's last word")
            if rt.rank == rt.local_ranks[0]:
                rt.rundir.get(inc_dir.closed, mirror=True)
                load_incident(rt.rundir, iid, mirror=True)
        except Exception as e:
            print(f"watcher: rank {rt.rank}: incident {iid} not mirrored on this node: {e}", file=sys.stderr)
    # Every replay of the incident is over on every node: their exchange
    # directories and what they put in the job's store can go.
    for d in Path(rt.window_dir).glob(f"exchange-{iid}*"):
        remove_tree(d)
    forget_published(rt, iid)


def note_health(rt: Rank, inc: dict) -> None:
    """Failures pinned on a device go into the ledger; a device attributed
    hardware is quarantined on the node when the policy acted on it."""
    ledger = health.Ledger.for_run(rt.rundir.root)
    run = str(rt.rundir.root)
    for ev in health.incident_events(inc, run, rt.rundir.read_steps):
        ledger.add(ev)
    p = inc.get("prescription") or {}
    if p.get("node_unusable"):
        ledger.quarantine(p["device"]["id"], p.get("reason", ""), inc["incident_id"], run)  # the breaker: marks the node
    elif p.get("action") == "quarantine_device" and p.get("applied"):
        d = p["device"]
        for dev in [d["id"]] if d.get("id") else [health.cpu_device(c, d.get("host")) for c in d.get("cpus") or []]:
            ledger.quarantine(dev, (inc.get("attribution") or {}).get("evidence") or "hardware", inc["incident_id"],
                              run)
