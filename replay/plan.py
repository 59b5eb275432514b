"""Planning an incident's replay (rank 0): which verified state to start
from, which window to replay, how long to wait for it.

The plan is the newest verified snapshot v before the failing step k that
every rank still holds (the oldest, for a replay check), and the window
v+1..max(k, halt step).  A state copy newer than v, when every rank holds one
that is verified, starts a shorter first try (copy_outcome in verdict.py
decides whether it stands; else `fallback_plan` replays from v).
"""

from __future__ import annotations

from ..rundir import IncidentDir, RunDir
from ..runtime.seam import Rank


def window_seconds(durations: dict, from_step: int, to_step: int) -> float:
    """How long steps from_step+1..to_step took live, from one rank's step durations (ns)."""
    return sum((durations.get(s) or 0) for s in range(from_step + 1, to_step + 1)) / 1e9


def replay_timeout_s(window_s: float) -> float:
    return max(60.0, 20 * window_s)


def healthy_window_seconds(durations: dict, from_step: int, to_step: int) -> float:
    """How long the window's steps take when healthy: the median step times
    their number.  A replay's timeout comes from this, never from a window
    holding the stalled step itself, or a hang that repeats in replay would
    wait out twenty times the stall before it could be called persistent."""
    known = sorted(d for d in durations.values() if d)
    if not known:
        return window_seconds(durations, from_step, to_step)
    return known[len(known) // 2] * (to_step - from_step) / 1e9


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


def log_excerpt(rt: Rank, held: list[int], info: dict) -> dict:
    """What the plan and the verdict need of this rank's log, carried in its
    arrival (the log itself may be on another node): the full parameter
    checksum at the steps it holds a snapshot or copy of, step durations
    since the oldest, the recent losses, and for a hang the collectives."""
    first_loss = info["failing_step"] - rt.detectors.loss_spike_window - 1
    oldest = min(held + [rt.step])
    since = min(oldest, first_loss)
    steps = rt.rundir.read_steps(rt.rank, since=since)
    out = {"param_sums": {str(s): full_param_sum(steps[s]) for s in held if s in steps},
           "durations": {str(s): fp.get("dur") for s, fp in steps.items() if s >= oldest},
           "losses": {str(s): fp.get("loss") for s, fp in steps.items() if s >= first_loss}}
    if info["kind"] == "hang":
        out["colls"] = [c for c in rt.rundir.read_colls(rt.rank, since=since).values() if c["step"] >= oldest]
    return out


class JobLog:
    """Every rank's log excerpt, from the arrivals of an incident."""

    def __init__(self, arrived: list[dict]):
        self.arrived = arrived

    @classmethod
    def of(cls, run_dir: RunDir, inc_dir: IncidentDir, world: int) -> "JobLog":
        return cls([run_dir.get(inc_dir.arrive(r)) for r in range(world)])

    def _part(self, rank: int, name: str) -> dict:
        return {int(k): v for k, v in ((self.arrived[rank].get("log") or {}).get(name) or {}).items()}

    def verified(self, step: int) -> bool:
        """Every rank recorded the same full parameter checksum at `step`."""
        sums = {self._part(r, "param_sums").get(step) for r in range(len(self.arrived))}
        return len(sums) == 1 and None not in sums

    def durations(self, rank: int = 0) -> dict[int, int]:
        return self._part(rank, "durations")

    def losses(self, rank: int) -> dict[int, float]:
        return self._part(rank, "losses")

    def colls(self, rank: int) -> dict[tuple, dict]:
        return {(c["group"], c["seq"]): c for c in (self.arrived[rank].get("log") or {}).get("colls") or []}


def make_plan(rt: Rank, info: dict, inc_dir: IncidentDir) -> dict:
    k = info["failing_step"]
    log = JobLog.of(rt.rundir, inc_dir, rt.world)
    arrived = log.arrived
    common = held_by_all(arrived)
    v, why = None, "no snapshot before the failing step is held by every rank"
    refused = [a["unsupported"] for a in arrived if a.get("unsupported")]
    if refused:
        common, why = set(), refused[0]
    # A failure replays the shortest window (newest snapshot); a replay check the longest.
    newest_first = info["kind"] != "replay_check"
    for cand in sorted((s for s in common if s < k), reverse=newest_first):
        if log.verified(cand):
            v = cand
            break
        why = f"snapshot {cand} is not verified: ranks disagree on the parameters"
    # The replay runs to where the ranks halted, so that under --policy
    # recover its end state is the live ranks' state, recomputed.
    halt = min(a["step"] for a in arrived) if info["kind"] != "replay_check" else k
    stuck = any(a.get("stuck") for a in arrived)
    # A rank stuck outside any collective (a hang handled while its training
    # thread is blocked) never ended the step after its last one: the replay
    # runs that step, the one it blocked in, and no further (its peers went
    # on to steps whose inputs the stuck rank never fetched).
    to = halt + 1 if stuck and info["kind"] == "hang" else max(k, halt)
    plan = {"failing_step": k, "from_step": v, "to_step": to, "reason": None if v is not None else why}
    if v is None:
        return plan
    # A state copy serves a quick recovery; a stuck rank cannot be recovered into.
    copy = newest_usable_copy(log, v, k) if newest_first and not stuck else None
    if copy is not None:
        plan.update(fork_step=v, from_step=copy, state_copy=copy)
    return _timed(plan, log.durations(0))


def newest_usable_copy(log: JobLog, fork: int, failing: int) -> int | None:
    """The newest state copy every rank holds, after the fork snapshot it is
    loaded into, verified, and at least two steps before the failing step:
    the step after the copy must replay before the failure, as recorded,
    for the copy's window to be trusted (copy_outcome)."""
    common = set(log.arrived[0].get("copies") or [])
    for a in log.arrived[1:]:
        common &= set(a.get("copies") or [])
    for c in sorted(common, reverse=True):
        if fork < c <= failing - 2 and log.verified(c):
            return c
    return None


def _timed(plan: dict, durations: dict) -> dict:
    window_s = window_seconds(durations, plan["from_step"], plan["to_step"])
    plan["replay_timeout_s"] = replay_timeout_s(healthy_window_seconds(durations, plan["from_step"],
                                                                       plan["to_step"]))
    plan["window_wall_s"] = round(window_s, 3)
    return plan


def fallback_plan(rt: Rank, plan: dict, reason: str, inc_dir: IncidentDir) -> dict:
    """The fork snapshot's whole window, after a state copy's replay did not stand."""
    out = {k: v for k, v in plan.items() if k not in ("fork_step", "state_copy")}
    out["from_step"] = plan["fork_step"]
    out["copy_attempt"] = {"from_step": plan["from_step"], "rejected": reason}
    return _timed(out, JobLog.of(rt.rundir, inc_dir, rt.world).durations(0))


def diagnosis_start(rt: Rank, info: dict, inc_dir: IncidentDir) -> int | None:
    """Where a diagnosis replays from: the oldest verified snapshot every rank
    holds, so the window reaches back before a cause that came a few steps early."""
    log = JobLog.of(rt.rundir, inc_dir, rt.world)
    k = info["failing_step"]
    return next((s for s in sorted(held_by_all(log.arrived)) if s < k and log.verified(s)), None)
