"""A rank that died, replaced while the job runs: no restart, no checkpoint.

Under `watcher run` (unless --no-rescue) every rank's launcher-visible process is a
supervisor (runtime/supervisor.py) that reports its rank's death and waits
for a word.  This side, in `watcher run` beside its watch over the ranks
(rank_deaths.py), decides:

1. Not rescued (the supervisor ends as the rank did, and the job goes down
   as it would have): a death while the launcher tears the job down, one
   while another incident is handled, a job on several nodes (not built
   yet), no snapshot step every rank still holds, or a death that came back:
   the same rank dying the same way at the same step as the death last
   rescued (persistent; the crash incident after the job replays and
   diagnoses it as before).
2. Rescued: S is the newest step of which every rank holds a snapshot (the
   dead rank's are orphans that said so, rescue/orphan.*).  The survivors,
   waiting inside the collective that failed (runtime/relink.py), are
   stopped; their snapshots are orphaned too.  Every rank's step-S snapshot
   is ordered to resume: it rebuilds the job's transports under a prefix of
   its own and goes back into the training loop, live, from step S.  The
   steps S+1.. are computed again; training is deterministic (the same
   property the replays rely on), so the run ends as it would have without
   the death.  The supervisors take the resumed processes as their ranks.

The incident (kind `crash`) is written when the rescue is made and judged
once the resumed job passes the step the rank died in: transient, recovered,
if it does; persistent if the rank dies there again the same way.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch.distributed as dist

from .incident import Incident, load_incident, save_incident
from .launcher_link import multi_node
from .rundir import RunDir, read_json, read_json_or_none, write_json
from .runtime.control import Control
from .runtime.supervisor import wait_for

SNAPSHOT_WAIT_S = 10.0   # for the survivors' snapshots to say they are orphaned
RESUME_WAIT_S = 90.0     # for every rank to name its resumed process


class Rescuer:
    def __init__(self, run_dir: RunDir, ctl: Control):
        self.run_dir, self.ctl = run_dir, ctl
        self.seen: set[str] = set()
        self.attempts: list[dict] = []   # every rescue made: rank, signal, exit code, step, incident
        self.pending: dict | None = None  # a rescue whose verdict waits for the job to pass the step
        self.let_go: str | None = None    # once a death is let go the job is going down: no rescue after it
        self.store = None                 # hosted here from the first rescue on (_store)
        run_dir.rescue.mkdir(parents=True, exist_ok=True)

    def poll(self, known: dict[int, tuple]) -> bool:
        """Answer new death reports; True when the ranks were replaced (their
        processes changed: the caller learns them again)."""
        self._judge_pending()
        replaced = False
        for path in self.run_dir.rescue_deaths():
            if path.name in self.seen:
                continue
            self.seen.add(path.name)
            try:
                death = read_json(path)
            except (OSError, ValueError):
                self.seen.discard(path.name)  # being written
                continue
            if self._fate_given(death):
                continue  # a survivor this side stopped for a rescue
            try:
                why, plan = self._why_not(death)
                if why is None:
                    replaced = self._rescue(death, known, plan) or replaced
                    continue
            except Exception as e:  # fail open: the death goes to the launcher as it would have
                why = f"the rescue failed: {type(e).__name__}: {e}"
            if not self._fate_given(death):
                self._let_go(death, why)
        return replaced

    # -- deciding -------------------------------------------------------------------------------
    def _fate_given(self, death: dict) -> bool:
        return self.run_dir.rescue_fate(death["rank"], death["pid"]).exists()

    def _why_not(self, death: dict) -> tuple[str | None, dict]:
        """Why this death is let go (None: replace it), and what a rescue
        needs: the job, the step the rank died in, the step to resume from."""
        if self.let_go is not None:
            return f"the job is going down ({self.let_go})", {}
        job = read_json_or_none(self.run_dir.job) or {}
        if multi_node(job):
            return "a rank of a job on several nodes is not replaced yet", {}
        plan = {"job": job, "failing": self._died_at(death)}
        rec = self.pending
        if rec is not None and rec["rank"] == death["rank"] and _same_death(rec, death) \
                and plan["failing"] == rec["step"]:
            self._verdict(rec, reproduced=True)
            return (f"rank {death['rank']} died again in step {rec['step']} the same way after its rescue: "
                    "persistent", plan)
        if self.ctl.incident_seq > self.ctl.verdict_seq:
            return "another incident is being handled", plan
        plan["from_step"] = self._common_step(death["rank"], job)
        if plan["from_step"] is None:
            return "no step of which every rank still holds a snapshot", plan
        return None, plan

    def _died_at(self, death: dict) -> int:
        steps = self.run_dir.read_steps(death["rank"])
        return (max(steps) if steps else -1) + 1

    def _common_step(self, dead: int, job: dict) -> int | None:
        """The newest step every rank holds a snapshot of: the dead rank's
        orphans said theirs; a survivor's are its last logged snapshots."""
        world = job.get("world") or 0
        if not world:
            return None
        held = None
        for r in range(world):
            if r == dead:
                mine = {int(p.name.rsplit("step", 1)[1]) for p in self.run_dir.rescue.glob(f"orphan.rank{r}.step*")}
            else:
                mine = set(_last_snapshots(self.run_dir.steps_log(r)))
            held = mine if held is None else held & mine
        return max(held) if held else None

    # -- acting ---------------------------------------------------------------------------------
    def _let_go(self, death: dict, why: str) -> None:
        if self.let_go is None:
            self.let_go = f"rank {death['rank']}'s death was let go"
        write_json(self.run_dir.rescue_fate(death["rank"], death["pid"]), {"fate": "let_go", "reason": why})
        print(f"watcher: rank {death['rank']} died ({_how(death)}); not replaced: {why}", file=sys.stderr, flush=True)

    def _rescue(self, death: dict, known: dict, plan: dict) -> bool:
        t0 = time.monotonic()
        world, dead = plan["job"]["world"], death["rank"]
        step, failing = plan["from_step"], plan["failing"]
        seq = self.ctl.open_incident({"kind": "crash", "rank": dead, "failing_step": failing, "halt_step": None,
                                      "resolved": True, "detected_ts": time.monotonic_ns(),
                                      "detected_unix": time.time()})
        if seq is None:
            self._let_go(death, "another incident is being handled")
            return False
        attempt = len(self.attempts) + 1
        rec = {"attempt": attempt, "rank": dead, "pid": death["pid"], "signal": death.get("signal"),
               "exit_code": death.get("exit_code"), "step": failing, "from_step": step,
               "incident_id": f"inc-{seq:04d}", "t0": t0}
        cause = read_json_or_none(self.run_dir.rescue_cause(dead))
        if cause:  # Watcher ended this rank itself: a stuck rank whose hang replayed clean
            rec["cause"] = cause
            os.unlink(self.run_dir.rescue_cause(dead))
        # Every rank's present process gets its fate first: the survivors'
        # supervisors, seeing them stopped, wait for the replacement.
        survivors = {r: pid for r, (pid, _) in known.items() if r != dead}
        write_json(self.run_dir.rescue_fate(dead, death["pid"]), {"fate": "replace", "attempt": attempt})
        for r, pid in survivors.items():
            write_json(self.run_dir.rescue_fate(r, pid), {"fate": "replace", "attempt": attempt})
        print(f"watcher: rank {dead} died ({_how(death)}) in step {failing}; replacing every rank from its "
              f"step-{step} snapshot (rescue {attempt})", file=sys.stderr, flush=True)
        for pid in survivors.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        orphans = [self.run_dir.rescue_orphan(r, step) for r in range(world)]
        ok = bool(wait_for(lambda: all(p.exists() for p in orphans), SNAPSHOT_WAIT_S))
        if ok:
            host, port = self._store()
            for r in range(world):
                write_json(self.run_dir.crash_order(r, step),
                           {"op": "resume", "attempt": attempt, "prefix": f"watcher/rescue/{attempt}/",
                            "store": [host, port]})
            old = {r: pid for r, (pid, _) in known.items()}
            ok = bool(wait_for(lambda: all(_named_pid(self.run_dir, r) not in (None, old.get(r))
                                           for r in range(world)), RESUME_WAIT_S))
        rec["detect_to_resume_s"] = round(time.monotonic() - t0, 3)
        self.attempts.append(rec)
        self._write_incident(rec, ok)
        self.ctl.verdict_seq = max(self.ctl.verdict_seq, seq)
        if not ok:
            why = f"rescue {attempt} failed: not every rank resumed from its step-{step} snapshot"
            self.let_go = why
            for r, pid in dict(survivors, **{dead: death["pid"]}).items():
                write_json(self.run_dir.rescue_fate(r, pid), {"fate": "let_go", "reason": why})
            print(f"watcher: {why}", file=sys.stderr, flush=True)
            return False
        self.pending = rec
        print(f"watcher: every rank resumed from step {step} in {rec['detect_to_resume_s']:.2f} s; the job goes on",
              file=sys.stderr, flush=True)
        return True

    def _store(self) -> tuple[str, int]:
        """Where the resumed ranks meet: a store this process hosts for the
        rest of the job.  The job's own may have died with a rank (Lightning's
        rank 0 hosts it), and this one outlives every rank."""
        if self.store is None:
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=60))
        return "127.0.0.1", self.store.port

    def _write_incident(self, rec: dict, ok: bool) -> None:
        detail = {"how": _how(rec), "pid": rec["pid"], "exit_code": rec["exit_code"], "exit_signal": rec["signal"]}
        if rec.get("cause"):
            detail["ended_by_watcher"] = rec["cause"]
        doc = Incident.opened(rec["incident_id"], "crash", rec["step"], rec["rank"], time.monotonic_ns(), detail,
                              rec["from_step"], rec["step"])
        doc.replay = {"reproduced": None, "first_divergence": None, "method": "live re-execution",
                      "reason": "every rank re-executes the window live from its snapshot; judged when the job "
                                "passes the step" if ok else "the ranks could not be resumed"}
        doc.update(recovery={"method": "every rank resumed from its snapshot at the window's start, on a rebuilt "
                                       "transport; no restart, no checkpoint", "possible": ok,
                             "from_step": rec["from_step"], "detect_to_resume_s": rec["detect_to_resume_s"],
                             "rescue": rec["attempt"]},
                   recovered=False)
        save_incident(self.run_dir, doc)

    # -- judging -------------------------------------------------------------------------------
    def _judge_pending(self) -> None:
        rec = self.pending
        if rec is None:
            return
        steps = self.run_dir.read_steps(rec["rank"], since=rec["step"])
        if rec["step"] in steps:
            self._verdict(rec, reproduced=False)

    def _verdict(self, rec: dict, reproduced: bool) -> None:
        self.pending = None
        try:
            doc = load_incident(self.run_dir, rec["incident_id"])
        except Exception:
            return
        compared = (f"rank {rec['rank']}'s death ({_how(rec)}, in step {rec['step']}) against the live re-execution "
                    f"of steps {rec['from_step'] + 1}..{rec['step']} from every rank's step-{rec['from_step']} snapshot")
        doc.replay = {"reproduced": reproduced, "first_divergence": None, "method": "live re-execution",
                      "compared": compared,
                      "matched": (f"died again in step {rec['step']} the same way" if reproduced
                                  else f"step {rec['step']} completed")}
        if reproduced:
            doc.update(classification="persistent", track="B", recovered=False)
        else:
            doc.update(classification="transient", track="A", transient_cause="unknown", recovered=True,
                       resumed_at_step=rec["from_step"] + 1, steps_lost=0)
        save_incident(self.run_dir, doc)
        if rec.get("cause") and not reproduced:
            self._hang_recovered(rec)
        print(f"watcher: {rec['incident_id']}: rank {rec['rank']}'s death in step {rec['step']} "
              + ("came back: persistent" if reproduced else "did not come back: transient, recovered"),
              file=sys.stderr, flush=True)


    def _hang_recovered(self, rec: dict) -> None:
        """The hang whose stuck rank this rescue replaced is recovered too."""
        try:
            hang = load_incident(self.run_dir, rec["cause"]["incident_id"])
        except Exception:
            return
        hang.update(recovered=True, resumed_at_step=rec["from_step"] + 1, steps_lost=0,
                    recovery=dict(hang.recovery or {}, replaced_by=rec["incident_id"],
                                  detect_to_resume_s=rec["detect_to_resume_s"]))
        save_incident(self.run_dir, hang)


def _last_snapshots(log, keep: int = 2, tail: int = 1 << 20) -> list[int]:
    """The steps of the last `keep` snapshots a live rank logged, in the order
    it took them (after a rescue the log still holds the old timeline's later
    steps until they are run again: the step numbers alone would mislead)."""
    try:
        with open(log, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - tail))
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[int] = []
    for line in reversed(lines):
        if b'"snapshot": true' not in line:
            continue
        try:
            found.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
        if len(found) == keep:
            break
    return found


def _same_death(a: dict, b: dict) -> bool:
    return (a.get("signal"), a.get("exit_code")) == (b.get("signal"), b.get("exit_code"))


def _how(d: dict) -> str:
    if d.get("signal"):
        try:
            return f"signal {signal.Signals(d['signal']).name}"
        except ValueError:
            return f"signal {d['signal']}"
    return f"exit code {d.get('exit_code')}"


def _named_pid(run_dir: RunDir, rank: int) -> int | None:
    p = read_json_or_none(run_dir.rank_process(rank))
    return p.get("pid") if p else None


