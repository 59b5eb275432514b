"""Incident handling across ranks: halt, plan, replay, verdict.

Every rank runs `handle_incident` when it reaches the incident's halt step
(one step after detection, so no rank is ever left waiting inside a collective
of a step its peers will not run):

1. arrive: say which snapshots it holds, wait for every rank;
2. plan (rank 0): the newest verified snapshot v before the failing step k
   that every rank still holds, and the collectives whose recorded outputs
   disagree across ranks (suspected corrupted in communication);
3. replay: each rank replays its own window v+1..k from its snapshot, in the
   sandbox, rank-isolated;
4. verdict (rank 0): first divergence, communication check, reproduced or
   not, classification; written as DIR/incidents/<id>.json;
5. go on (policy observe) or stop cleanly (any other policy, until recovery).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from ..runtime.control import read_json, write_json

WAIT_S = float(os.environ.get("WATCHER_INCIDENT_WAIT", "600"))
# Persistent failures diagnosed by counterfactual replay (a hang or a crash is
# reported with where each rank was, not replayed with variants).
DIAGNOSED = ("non_finite", "loss_spike", "sdc")


def handle_incident(rt, seq: int, info: dict, final: bool = False) -> None:
    ctl, k = rt.ctl, rt.step
    inc_dir = rt.run_dir / "incidents" / info["incident_id"]
    inc_dir.mkdir(parents=True, exist_ok=True)
    t_halt = time.monotonic_ns()
    rt.seg.flush()  # the replays and the verdict read every rank's window and logs from disk
    rt.flush_logs()
    usable = [s.step for s in rt.snapshots if s.step > rt.window_gap]  # none from before a measurement's pause
    write_json(inc_dir / f"arrive.rank{rt.rank}.json",
               {"rank": rt.rank, "step": k, "snapshots": usable, "pid": os.getpid(),
                "unsupported": rt.unsupported, "copies": rt.copies.held() if rt.copies is not None else []})
    ctl.arrive(rt.rank, seq, k)
    _say(rt, f"incident {info['incident_id']} ({info['kind']} at step {info['failing_step']}, "
             f"rank {info['rank']}): halted at step {k}, replaying")
    verdict = None
    result_dir = None
    try:
        # At exit a peer that died first never arrives: do not hold the exit long.
        ctl.wait(lambda: all(ctl.arrived(r)[0] == seq for r in range(rt.world)), 30 if final else WAIT_S,
                 "every rank to halt")
        if rt.rank == 0:
            plan = make_plan(rt, info, inc_dir)
            write_json(inc_dir / "plan.json", plan)
            ctl.plan_seq = seq
        ctl.wait(lambda: ctl.plan_seq >= seq, WAIT_S, "the replay plan")
        plan = read_json(inc_dir / "plan.json")
        if plan.get("state_copy") is not None:
            # First the short window from the newest state copy; it stands
            # only if it proves itself (copy_outcome), else the fork's window.
            quick = inc_dir / "from-copy"
            quick.mkdir(exist_ok=True)
            _replay_mine(rt, info, plan, quick, t_halt, "-copy")
            if rt.rank == 0:
                _await_replays(rt, quick)
                try:
                    outcome = copy_outcome(rt, info, plan, quick)
                except Exception as e:
                    outcome = {"accepted": False, "reason": f"the verdict failed: {e}"}
                if outcome["accepted"]:
                    write_json(rt.run_dir / "incidents" / f"{info['incident_id']}.json", outcome.pop("verdict"))
                else:
                    outcome.pop("verdict", None)
                    outcome["plan"] = fallback_plan(rt, plan, outcome["reason"])
                    write_json(inc_dir / "plan.json", outcome["plan"])
                write_json(quick / "outcome.json", outcome)
            ctl.wait(lambda: (quick / "outcome.json").exists(), WAIT_S, "the state copy's verdict")
            outcome = read_json(quick / "outcome.json")
            _remove_tree(rt.window_dir / f"exchange-{info['incident_id']}-copy")
            if outcome["accepted"]:
                result_dir = quick
            else:
                plan = outcome["plan"]
        if result_dir is None:
            _replay_mine(rt, info, plan, inc_dir, t_halt)
            result_dir = inc_dir
            if rt.rank == 0:
                _await_replays(rt, inc_dir)
                try:
                    verdict = decide(rt, info, plan, inc_dir)
                except Exception as e:
                    verdict = unclassified(info, plan, f"the verdict failed: {e}")
                if plan.get("copy_attempt") and verdict.get("replay") is not None:
                    verdict["replay"]["copy_attempt"] = plan["copy_attempt"]
                write_json(rt.run_dir / "incidents" / f"{info['incident_id']}.json", verdict)
        if rt.rank == 0:
            ctl.verdict_seq = seq
        ctl.wait(lambda: ctl.verdict_seq >= seq, WAIT_S, "the verdict")
        verdict = read_json(rt.run_dir / "incidents" / f"{info['incident_id']}.json")
    except Exception as e:  # never leave the peers waiting on this rank
        _say(rt, f"incident {info['incident_id']}: {e}; going on without a verdict")
        if rt.rank == 0:
            if not (inc_dir / "plan.json").exists():
                write_json(inc_dir / "plan.json", {"failing_step": info["failing_step"], "from_step": None,
                                                   "to_step": info["failing_step"], "reason": str(e)})
            ctl.plan_seq = max(ctl.plan_seq, seq)
            ctl.verdict_seq = max(ctl.verdict_seq, seq)
        elif not (inc_dir / f"replayed.rank{rt.rank}.json").exists():
            write_json(inc_dir / f"replayed.rank{rt.rank}.json", {"rank": rt.rank, "error": str(e)})
    rt.handled_seq = seq
    _remove_tree(rt.window_dir / f"exchange-{info['incident_id']}")
    recovered = False
    if verdict:
        _say(rt, f"incident {info['incident_id']}: {verdict['classification'] or 'unclassified'}"
                 + (f" ({verdict['transient_cause']})" if verdict.get("transient_cause") else ""))
    if (verdict and verdict.get("classification") == "transient" and rt.policy in ("recover", "apply")
            and info["kind"] != "replay_check" and not final):
        recovered = recover(rt, seq, info, plan, inc_dir, t_halt, result_dir=result_dir)
    if (verdict and verdict.get("classification") == "persistent" and rt.policy in ("recover", "apply")
            and info["kind"] in DIAGNOSED and not final):
        recovered = diagnose_and_apply(rt, info, plan, inc_dir, t_halt)
    if verdict:
        if verdict["classification"] == "persistent":
            # Keep the frozen snapshot out of rotation for diagnosis: the one
            # the diagnosis replayed from, if one ran, so that `watcher
            # diagnose` repeats it from the same state.
            start = plan.get("from_step")
            round0 = inc_dir / "diagnosis" / "round0.json"
            if round0.exists():
                start = read_json(round0).get("from_step", start)
            snap = rt.snapshot_at(start) if start is not None else None
            if snap in rt.snapshots:
                snap.incident_id = info["incident_id"]
                rt.snapshots.remove(snap)
                # One retained snapshot at a time: each is a copy-on-write image of the rank.
                for old in rt.retained:
                    old.release()
                rt.retained = [snap]
    if rt.policy != "observe" and info["kind"] != "replay_check" and not final and not recovered:
        rt.flush_logs()
        rt.seg.flush()
        _say(rt, f"stopping after incident {info['incident_id']} (policy {rt.policy})")
        rt.close()
        os._exit(75)


def _await_replays(rt, out_dir: Path) -> None:
    """Rank 0: wait until every rank has said how its replay into out_dir ended."""
    rt.ctl.wait(lambda: all((out_dir / f"replayed.rank{r}.json").exists() for r in range(rt.world)),
                WAIT_S, "every rank's replay")


def _replay_mine(rt, info: dict, plan: dict, out_dir: Path, t_halt: int, tag: str = "") -> None:
    """This rank's replay of the plan's window, its outcome in out_dir/replayed.rankN.json."""
    mine = {"rank": rt.rank, "halted_ns": t_halt}
    try:
        start = plan.get("fork_step", plan.get("from_step"))
        if plan.get("from_step") is not None:
            snap = rt.snapshot_at(start)
            if snap is None:
                mine["error"] = f"snapshot {start} is gone"
            else:
                exchange = rt.window_dir / f"exchange-{info['incident_id']}{tag}"
                exchange.mkdir(exist_ok=True)
                mine.update(snap.replay(plan["to_step"], out_dir, timeout=plan["replay_timeout_s"],
                                        exchange=exchange, state_copy=plan.get("state_copy")))
    except Exception as e:  # a dead snapshot, a broken pipe: this rank's replay failed, not the job
        mine["error"] = f"replay failed: {e}"
    write_json(out_dir / f"replayed.rank{rt.rank}.json", mine)


def diagnose_and_apply(rt, info: dict, plan: dict, inc_dir: Path, t_halt: int) -> bool:
    """Track B (diagnose.py) on every rank; under --policy apply, merge the
    state of the counterfactual replay that cured the failure.  True when
    training may go on."""
    from .diagnose import apply_effects, diagnose, record_affinity

    done = inc_dir / "diagnosis" / "done.json"
    try:
        record_affinity(rt)
        outcome = diagnose(rt, info, plan, inc_dir)
    except Exception as e:
        _say(rt, f"incident {info['incident_id']}: diagnosis failed: {e}")
        if rt.rank == 0 and not done.exists():
            write_json(done, {"apply": None, "error": str(e)})
        outcome = None
    if not outcome or not outcome.get("apply"):
        return False
    result_dir = inc_dir / "diagnosis" / outcome["apply"]
    ok = recover(rt, 0, info, plan, inc_dir, t_halt, result_dir=result_dir)
    if ok:
        apply_effects(rt, info)
    return ok


def recover(rt, seq: int, info: dict, plan: dict, inc_dir: Path, t_halt: int, result_dir: Path | None = None) -> bool:
    """Track A: load the replayed state into this live rank, check it, and
    agree with every rank that all of them did.  True when training may go on.
    `result_dir` holds the replay results to merge (default: the verdict's)."""
    from .merge import merge_state

    result_dir = result_dir or inc_dir
    ctl, iid = rt.ctl, info["incident_id"]
    inc_path = rt.run_dir / "incidents" / f"{iid}.json"
    verdict = read_json(inc_path)
    rec = verdict.get("recovery") or {}
    t0 = time.monotonic_ns()
    mine = {"rank": rt.rank, "ok": False, "tries": 0}
    if rec.get("possible"):
        try:
            res = torch.load(result_dir / f"rank{rt.rank}.result.pt", weights_only=False)
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
                _adopt_replayed_steps(rt, res, plan)
        except Exception as e:
            mine["error"] = f"merge failed: {e}"
    else:
        mine["error"] = rec.get("reason") or "no recovery was planned"
    mine["merge_s"] = round((time.monotonic_ns() - t0) / 1e9, 4)
    write_json(result_dir / f"merged.rank{rt.rank}.json", mine)
    done_path = result_dir / "recovery.json"
    if rt.rank == 0:
        try:
            ctl.wait(lambda: all((result_dir / f"merged.rank{r}.json").exists() for r in range(rt.world)),
                     WAIT_S, "every rank's merge")
            merged = [read_json(result_dir / f"merged.rank{r}.json") for r in range(rt.world)]
        except Exception as e:
            merged = [{"rank": rt.rank, "ok": False, "error": str(e)}]
        ok = all(m.get("ok") for m in merged)
        now = time.monotonic_ns()
        verdict.update(recovered=ok, resumed_at_step=plan["to_step"] + 1 if ok else None, steps_lost=0 if ok else None)
        verdict["recovery"] = dict(rec, merged=merged, retried=any(m.get("tries", 0) > 1 for m in merged),
                                   reason=None if ok else next((f"rank {m['rank']}: {m.get('error')}" for m in merged
                                                                if not m.get("ok")), rec.get("reason")),
                                   detect_to_resume_s=round((now - info["detected_ts"]) / 1e9, 3),
                                   halt_to_resume_s=round((now - t_halt) / 1e9, 3))
        write_json(inc_path, verdict)
        write_json(done_path, {"ok": ok})
    ctl.wait(lambda: done_path.exists(), WAIT_S, "the recovery outcome")
    ok = bool(read_json(done_path).get("ok"))
    if ok:
        _say(rt, f"incident {iid}: recovered; training resumes at step {plan['to_step'] + 1}, no step lost")
        # The retained snapshots and window still hold the faulty live run:
        # start afresh from the recovered state.
        for snap in rt.snapshots:
            snap.release()
        rt.snapshots = []
        if rt.copies is not None:
            rt.copies.forget()
        rt.resnapshot = True
    return ok


def _adopt_replayed_steps(rt, res: dict, plan: dict) -> None:
    """The replayed fingerprints become the record of the recovered steps
    (the steps log keeps the last line per step), and the beacon carries the
    recovered parameters for the replica check."""
    for k in sorted(res["steps"]):
        fp = {f: v for f, v in res["steps"][k].items() if f not in ("match", "diff", "_colls")}
        fp["recovered"] = True
        rt.steps_log.write(json.dumps(fp) + "\n")
    rt.flush_logs()
    last = res["steps"][plan["to_step"]]
    rt.ctl.beacon(rt.rank, plan["to_step"], last["param_sum"])


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _say(rt, msg: str) -> None:
    if rt.rank == 0:
        print(f"watcher: {msg}", file=sys.stderr, flush=True)


TAIL_BLOCK = 1 << 20


def _read_jsonl(path: Path, key, since: int | None = None, keep=None) -> dict:
    """A rank's JSON-lines log keyed by key(record), the records `keep`
    accepts (default all); a line still being written is skipped.  With
    `since` (a step) only the log's tail back to that step is read: an
    incident needs the last snapshot interval, not a long run's whole
    history (100k steps are tens of MB of JSON, seconds to parse)."""
    try:
        with open(path, "rb") as f:
            if since is None:
                data = f.read()
            else:
                end = f.seek(0, os.SEEK_END)
                start = end
                while start > 0:
                    start = max(0, start - TAIL_BLOCK)
                    f.seek(start)
                    head = f.readline() if start else b""  # a partial first line
                    line = f.readline()
                    try:
                        first = json.loads(line).get("step")
                    except ValueError:
                        first = None
                    # A margin: recovered steps are logged again later, out of order.
                    if first is not None and first < since - 64:
                        break
                f.seek(start)
                if start:
                    f.readline()
                data = f.read(end - f.tell())
    except OSError:
        return {}
    out = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if keep is None or keep(rec):
            out[key(rec)] = rec
    return out


def read_steps(run_dir: Path, rank: int, since: int | None = None) -> dict[int, dict]:
    return _read_jsonl(run_dir / "runtime" / f"rank{rank}.steps.jsonl", lambda fp: fp["step"], since,
                       lambda rec: "seq" not in rec)


def read_colls(run_dir: Path, rank: int, since: int | None = None) -> dict[tuple, dict]:
    """A rank's logged collectives: the lines of its steps log that carry a sequence number."""
    return _read_jsonl(run_dir / "runtime" / f"rank{rank}.steps.jsonl", lambda c: (c["group"], c["seq"]), since,
                       lambda rec: "seq" in rec)


def window_seconds(steps: dict, from_step: int, to_step: int) -> float:
    """How long steps from_step+1..to_step took live, from one rank's steps log."""
    return sum((steps.get(s, {}).get("dur") or 0) for s in range(from_step + 1, to_step + 1)) / 1e9


def held_by_all(arrivals: list[dict]) -> set[int]:
    """Snapshot steps every rank still holds (from their arrive files)."""
    common = set(arrivals[0]["snapshots"])
    for a in arrivals[1:]:
        common &= set(a["snapshots"])
    return common


def full_param_sum(fp: dict) -> int | None:
    """A step's checksum of all the parameters: recorded at snapshot and
    state-copy steps (other steps hold one part's, runtime/checksum.PARTS)."""
    return fp.get("param_sum_full", fp.get("param_sum"))


def verified(steps: list[dict], step: int) -> bool:
    """Every rank recorded the same parameter checksum at `step`."""
    sums = {full_param_sum(s.get(step, {})) for s in steps}
    return len(sums) == 1 and None not in sums


def make_plan(rt, info: dict, inc_dir: Path) -> dict:
    world, k = rt.world, info["failing_step"]
    arrivals = [read_json(inc_dir / f"arrive.rank{r}.json") for r in range(world)]
    held = [s for a in arrivals for s in a["snapshots"] + (a.get("copies") or [])]
    steps = [read_steps(rt.run_dir, r, since=min(held) if held else None) for r in range(world)]
    common = held_by_all(arrivals)
    v, why = None, "no snapshot before the failing step is held by every rank"
    refused = [a["unsupported"] for a in arrivals if a.get("unsupported")]
    if refused:
        common, why = set(), refused[0]
    # A failure replays the shortest window (newest snapshot); a replay check the longest.
    newest_first = info["kind"] != "replay_check"
    for cand in sorted((s for s in common if s < k), reverse=newest_first):
        if verified(steps, cand):
            v = cand
            break
        why = f"snapshot {cand} is not verified: ranks disagree on the parameters"
    # The replay runs to where the ranks halted, so that under --policy
    # recover its end state is the live ranks' state, recomputed.
    halt = min(a["step"] for a in arrivals) if info["kind"] != "replay_check" else k
    plan = {"failing_step": k, "from_step": v, "to_step": max(k, halt), "reason": None if v is not None else why}
    if v is None:
        return plan
    copy = newest_usable_copy(arrivals, steps, v, k) if newest_first else None
    if copy is not None:
        plan.update(fork_step=v, from_step=copy, state_copy=copy)
    return _timed(plan, steps[0])


def newest_usable_copy(arrivals: list[dict], steps: list[dict], fork: int, failing: int) -> int | None:
    """The newest state copy every rank holds, after the fork snapshot it is
    loaded into, verified, and at least two steps before the failing step:
    the step after the copy must replay before the failure, as recorded,
    for the copy's window to be trusted (copy_outcome)."""
    common = set(arrivals[0].get("copies") or [])
    for a in arrivals[1:]:
        common &= set(a.get("copies") or [])
    for c in sorted(common, reverse=True):
        if fork < c <= failing - 2 and verified(steps, c):
            return c
    return None


def _timed(plan: dict, steps: dict) -> dict:
    window_s = window_seconds(steps, plan["from_step"], plan["to_step"])
    plan["replay_timeout_s"] = max(60.0, 20 * window_s)
    plan["window_wall_s"] = round(window_s, 3)
    return plan


def fallback_plan(rt, plan: dict, reason: str) -> dict:
    """The fork snapshot's whole window, after a state copy's replay did not stand."""
    out = {k: v for k, v in plan.items() if k not in ("fork_step", "state_copy")}
    out["from_step"] = plan["fork_step"]
    out["copy_attempt"] = {"from_step": plan["from_step"], "rejected": reason}
    return _timed(out, read_steps(rt.run_dir, 0, since=out["from_step"]))


def copy_outcome(rt, info: dict, plan: dict, out_dir: Path) -> dict:
    """Does the replay from a state copy stand as the incident's replay?

    The copy carries the training state but not the program's own Python
    state, which is the fork's.  So the replay stands only when every rank
    re-executed every step before the fault exactly as recorded (fingerprints
    and collective inputs), at least one of them (the copy is chosen two steps
    before the failing step for that); and only for a transient verdict: a persistent
    failure is confirmed and diagnosed from the fork snapshot itself, whose
    state is the live rank's whole state."""
    results = load_results(out_dir, rt.world)
    verdict = decide(rt, info, plan, out_dir, results)
    first = plan["from_step"] + 1
    # Every step before the fault must replay as recorded: up to the first
    # localised divergence, or up to the failing step when there is none.
    div = (verdict.get("replay") or {}).get("first_divergence")
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
    if reason is None and verdict.get("classification") != "transient":
        reason = f"classified {verdict.get('classification')}: confirmed from the fork snapshot"
    if reason is None and rt.policy in ("recover", "apply") and not (verdict.get("recovery") or {}).get("possible"):
        reason = f"not recoverable from the copy: {(verdict.get('recovery') or {}).get('reason')}"
    if reason is None:
        verdict["replay"]["state_copy"] = {"step": plan["state_copy"], "fork_step": plan["fork_step"]}
    return {"accepted": reason is None, "reason": reason, "verdict": verdict}


def find_stall(rt, plan: dict) -> dict | None:
    """The collective that waited longest in the window, and the rank that entered it last."""
    colls = [read_colls(rt.run_dir, r, since=plan.get("from_step")) for r in range(rt.world)]
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


def incident_doc(incident_id: str, kind: str, step, rank, ts, detail, from_step, to_step,
                 reason: str | None = None) -> dict:
    """The incident document (DIR/incidents/<id>.json), before any verdict.
    Diagnosis and recovery fields stay null until those stages fill them."""
    return {"incident_id": incident_id, "kind": kind, "detected_step": step, "detected_rank": rank,
            "detected_ts": ts, "detail": detail, "window": {"from_step": from_step, "to_step": to_step},
            "replay": None if reason is None else {"reproduced": None, "first_divergence": None, "reason": reason},
            "classification": None, "track": None, "transient_cause": None, "attribution": None,
            "causal_chain": None, "prescription": None, "recovered": False, "resumed_at_step": None,
            "steps_lost": None, "recovery": None, "escalated": None, "snapshot": None}


def unclassified(info: dict, plan: dict, reason: str) -> dict:
    return incident_doc(info["incident_id"], info["kind"], info["failing_step"], info["rank"], info["detected_ts"],
                        info.get("detail"), plan.get("from_step"), plan.get("to_step"), reason)


def load_results(inc_dir: Path, world: int) -> list[dict]:
    """Every rank's replay result (steps, collectives, the end state)."""
    results = []
    for r in range(world):
        try:
            results.append(torch.load(inc_dir / f"rank{r}.result.pt", weights_only=False))
        except Exception:
            results.append({"rank": r, "status": "no_result"})
    return results


def decide(rt, info: dict, plan: dict, inc_dir: Path, results: list[dict] | None = None) -> dict:
    world = rt.world
    replayed = [read_json(inc_dir / f"replayed.rank{r}.json") for r in range(world)]
    results = results if results is not None else load_results(inc_dir, world)
    if plan.get("from_step") is None:
        return unclassified(info, plan, plan.get("reason"))
    verdict = unclassified(info, plan, "")
    divs = [res["first_divergence"] for res in results if res.get("first_divergence")]
    # The earliest divergence; at the same collective a rank whose own input
    # differed (compute) explains the others' differing outputs.
    div = min(divs, key=lambda d: (d["step"], d["collective"]["seq"], d["where"] != "compute")) if divs else None
    statuses = {r: results[r].get("status") for r in range(world)}
    timed_out = [r for r in range(world) if replayed[r].get("timed_out")]
    exact = all(statuses[r] == "done" and all(s["match"] for s in results[r]["steps"].values())
                and all(c["match"] for c in results[r]["colls"]) for r in range(world))
    stall = find_stall(rt, plan) if info["kind"] == "hang" else None
    if info["kind"] == "replay_check":  # a healthy window replayed on request: no failure to classify
        verdict["replay"] = {"reproduced": None, "exact": exact, "first_divergence": div,
                             "per_rank": None, "window_wall_s": plan.get("window_wall_s")}
        verdict["replay"]["per_rank"] = {r: {"status": statuses[r], "steps": len(results[r].get("steps", {})),
                                             "collectives": len(results[r].get("colls", [])),
                                             "wall_s": replayed[r].get("wall_s")} for r in range(world)}
        return verdict
    # A replay that timed out is an answer only for a hang.
    incomplete = [r for r in range(world) if statuses[r] != "done"
                  and (r not in timed_out or info["kind"] != "hang")]
    if incomplete and info["kind"] != "hang":
        # A replay that could not finish proves nothing either way.
        verdict["replay"] = {"reproduced": None, "exact": False, "first_divergence": div,
                             "reason": "; ".join(f"rank {r}: {statuses[r]}"
                                                 + (f" ({(results[r].get('error') or '').strip().splitlines()[-1]})"
                                                    if results[r].get("error") else "") for r in incomplete)}
        return verdict
    if info["kind"] == "hang":
        reproduced = bool(timed_out)
    else:
        reproduced = exact and not div
    first = div
    verdict["replay"] = {
        "reproduced": reproduced, "exact": exact, "first_divergence": first,
        "stall": stall,
        "per_rank": {r: {"status": statuses[r], "error": results[r].get("error"),
                         "steps": len(results[r].get("steps", {})),
                         "mismatched_steps": sorted(k for k, s in results[r].get("steps", {}).items()
                                                    if not s["match"]),
                         "wall_s": replayed[r].get("wall_s"), "exit_code": replayed[r].get("exit_code"),
                         "replay_s": round(results[r]["wall_ns"] / 1e9, 3) if results[r].get("wall_ns") else None,
                         "exchange_ms": results[r].get("exchange_ms")}
                     for r in range(world)},
        "window_wall_s": plan.get("window_wall_s"),
    }
    if reproduced:
        verdict.update(classification="persistent", track="B",
                       snapshot={"from_step": plan["from_step"], "retained": True})
    else:
        cause = ("communication" if div and div["where"] == "communication" else "bit_flip" if div else
                 "timeout" if info["kind"] == "hang" else "unknown")
        verdict.update(classification="transient", track="A", transient_cause=cause)
        suspect = div["rank"] if div else stall["rank"] if stall else None
        repeats = earlier_transients(rt, suspect, info["failing_step"]) if suspect is not None else []
        if len(repeats) + 1 >= rt.detectors.transient_limit:
            # The same rank keeps failing: not bad luck but a bad device.
            verdict.update(classification="persistent", track="B", transient_cause=None,
                           escalated={"rank": suspect, "transients": repeats + [info["incident_id"]],
                                      "reason": f"{len(repeats) + 1} transients on rank {suspect} within "
                                                f"{rt.detectors.transient_window} steps: hardware suspect"},
                           snapshot={"from_step": plan["from_step"], "retained": True})
        else:
            verdict["recovery"] = recoverable(rt, plan, results)
    return verdict


def earlier_transients(rt, rank: int, step: int) -> list[str]:
    """Earlier incidents of this run classified transient and pinned on `rank`, within the window."""
    found = []
    for p in sorted((rt.run_dir / "incidents").glob("inc-*.json")):
        try:
            inc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        rep = inc.get("replay") or {}
        where = rep.get("first_divergence") or rep.get("stall") or {}
        if (inc.get("classification") == "transient" and where.get("rank") == rank
                and step - (inc.get("detected_step") or 0) <= rt.detectors.transient_window):
            found.append(inc["incident_id"])
    return found


def recoverable(rt, plan: dict, results: list[dict]) -> dict:
    """Can the replayed end state replace the live one?  It must be complete,
    computed (not copied from a record that may carry the fault), finite,
    unremarkable to the detectors, and the same on every replica."""
    import copy

    world, to = rt.world, plan["to_step"]
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
        recorded = read_steps(rt.run_dir, r, since=plan["failing_step"] - detectors.loss_spike_window - 1)
        detectors.history = [recorded[s]["loss"] for s in sorted(recorded) if s < plan["failing_step"]
                             and recorded[s].get("loss") is not None and math.isfinite(recorded[s]["loss"])
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
