"""Planning an incident's replay (rank 0): which verified state to start
from, which window to replay, how long to wait for it.

The plan is the newest verified snapshot v before the failing step k that
every rank still holds (the oldest, for a replay check), and the window
v+1..max(k, halt step).  A state copy newer than v, when every rank holds one
that is verified, starts a shorter first try (copy_outcome in verdict.py
decides whether it stands; else `fallback_plan` replays from v).
"""

from __future__ import annotations

from ..rundir import IncidentDir, read_json
from ..runtime.seam import Rank


def window_seconds(steps: dict, from_step: int, to_step: int) -> float:
    """How long steps from_step+1..to_step took live, from one rank's steps log."""
    return sum((steps.get(s, {}).get("dur") or 0) for s in range(from_step + 1, to_step + 1)) / 1e9


def replay_timeout_s(window_s: float) -> float:
    return max(60.0, 20 * window_s)


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


def arrivals(rt: Rank, inc_dir: IncidentDir) -> list[dict]:
    return [read_json(inc_dir.arrive(r)) for r in range(rt.world)]


def make_plan(rt: Rank, info: dict, inc_dir: IncidentDir) -> dict:
    world, k = rt.world, info["failing_step"]
    arrived = arrivals(rt, inc_dir)
    held = [s for a in arrived for s in a["snapshots"] + (a.get("copies") or [])]
    steps = [rt.rundir.read_steps(r, since=min(held) if held else None) for r in range(world)]
    common = held_by_all(arrived)
    v, why = None, "no snapshot before the failing step is held by every rank"
    refused = [a["unsupported"] for a in arrived if a.get("unsupported")]
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
    halt = min(a["step"] for a in arrived) if info["kind"] != "replay_check" else k
    plan = {"failing_step": k, "from_step": v, "to_step": max(k, halt), "reason": None if v is not None else why}
    if v is None:
        return plan
    copy = newest_usable_copy(arrived, steps, v, k) if newest_first else None
    if copy is not None:
        plan.update(fork_step=v, from_step=copy, state_copy=copy)
    return _timed(plan, steps[0])


def newest_usable_copy(arrived: list[dict], steps: list[dict], fork: int, failing: int) -> int | None:
    """The newest state copy every rank holds, after the fork snapshot it is
    loaded into, verified, and at least two steps before the failing step:
    the step after the copy must replay before the failure, as recorded,
    for the copy's window to be trusted (copy_outcome)."""
    common = set(arrived[0].get("copies") or [])
    for a in arrived[1:]:
        common &= set(a.get("copies") or [])
    for c in sorted(common, reverse=True):
        if fork < c <= failing - 2 and verified(steps, c):
            return c
    return None


def _timed(plan: dict, steps: dict) -> dict:
    window_s = window_seconds(steps, plan["from_step"], plan["to_step"])
    plan["replay_timeout_s"] = replay_timeout_s(window_s)
    plan["window_wall_s"] = round(window_s, 3)
    return plan


def fallback_plan(rt: Rank, plan: dict, reason: str) -> dict:
    """The fork snapshot's whole window, after a state copy's replay did not stand."""
    out = {k: v for k, v in plan.items() if k not in ("fork_step", "state_copy")}
    out["from_step"] = plan["fork_step"]
    out["copy_attempt"] = {"from_step": plan["from_step"], "rejected": reason}
    return _timed(out, rt.rundir.read_steps(0, since=out["from_step"]))


def diagnosis_start(rt: Rank, info: dict, inc_dir: IncidentDir) -> int | None:
    """Where a diagnosis replays from: the oldest verified snapshot every rank
    holds, so the window reaches back before a cause that came a few steps early."""
    steps = [rt.rundir.read_steps(r) for r in range(rt.world)]
    k = info["failing_step"]
    return next((s for s in sorted(held_by_all(arrivals(rt, inc_dir))) if s < k and verified(steps, s)), None)
