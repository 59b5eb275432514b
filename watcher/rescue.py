"""A rank that died, replaced while the job runs: no restart, no checkpoint.

Under `watcher run` (unless --no-rescue) every rank's launcher-visible process is a
supervisor (runtime/supervisor.py) that reports its rank's death and waits
for a word.  This side, in `watcher run` beside its watch over the ranks
(rank_deaths.py), decides:

1. Not rescued (the supervisor ends as the rank did, and the job goes down
   as it would have): a death while the launcher tears the job down, one
   while another incident is handled, no snapshot step every rank still
   holds, or a death that came back:
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

On a job that spans nodes each node's `watcher run` does this for its own
ranks, on one decision made by the dead rank's node (rescue_across.py).
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
from .rescue_across import AcrossNodes
from .rundir import RunDir, read_json, read_json_or_none, write_json
from .runtime.control import Control
from .runtime.nodes import NodeLayout, NodeLink
from .runtime.supervisor import wait_for

SNAPSHOT_WAIT_S = 10.0   # for the survivors' snapshots to say they are orphaned
RESUME_WAIT_S = 90.0     # for every rank to name its resumed process
DEAD_ORPHAN_WAIT_S = 2.0  # for the dead rank's snapshots to see their parent gone
LET_GO_KEY = "rescue/let_go"  # in the job's store: peers on other nodes stop waiting for a rescue (relink.py)


class Rescuer:
    def __init__(self, run_dir: RunDir, ctl: Control, job_store=lambda: None):
        self.run_dir, self.ctl = run_dir, ctl
        self.job_store = job_store        # the job's store under Watcher's prefix, on many nodes (rank_deaths.py)
        self.job: dict | None = None
        self.across: AcrossNodes | None = None  # the other nodes' launchers, on many nodes
        self.nodelink: NodeLink | None = None   # incidents opened job-wide, on many nodes
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
        ax = self._across()
        if ax is not None and ax.link is not None:
            self._adopt_docs(ax)
            for a, call in ax.unanswered():
                replaced = self._answer(a, call, known) or replaced
            if replaced:
                return True  # `known` is stale: the caller learns the new processes first
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
                    act = self._rescue_across if ax is not None else self._rescue
                    replaced = act(death, known, plan) or replaced
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
        plan = {"job": job, "failing": self._died_at(death)}
        rec = self.pending
        if rec is not None and rec["rank"] == death["rank"] and _same_death(rec, death) \
                and plan["failing"] == rec["step"]:
            self._verdict(rec, reproduced=True)
            return (f"rank {death['rank']} died again in step {rec['step']} the same way after its rescue: "
                    "persistent", plan)
        if self.ctl.incident_seq > self.ctl.verdict_seq:
            return "another incident is being handled", plan
        if multi_node(job):
            elsewhere = self._let_go_elsewhere()
            if elsewhere:
                self.let_go = elsewhere
                return f"the job is going down ({elsewhere})", plan
            ax = self._across()
            if ax is None or ax.link is None:
                return f"the other nodes' launchers cannot be reached ({ax and ax.error or 'not linked yet'})", plan
            return None, plan  # the step every rank holds is agreed across nodes (_rescue_across)
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
        self._tell_peers_let_go(f"rank {death['rank']}'s death was let go")
        print(f"watcher: rank {death['rank']} died ({_how(death)}); not replaced: {why}", file=sys.stderr, flush=True)

    def _tell_peers_let_go(self, what: str) -> None:
        """On many nodes, the other nodes' ranks waiting for a rescue
        (relink.py) stop waiting, and their launchers replace no rank after it."""
        try:
            store = self.job_store() if self.across is not None else None
            if store is not None and not store.check([LET_GO_KEY]):
                store.set(LET_GO_KEY, f"{what} on node {self.job['node']}")
        except Exception:
            pass

    def _let_go_elsewhere(self) -> str | None:
        """Another node's launcher let a death go: the job is going down."""
        try:
            store = self.job_store()
            if store is not None and store.check([LET_GO_KEY]):
                return store.get(LET_GO_KEY).decode()
        except Exception:
            pass
        return None

    def _rescue(self, death: dict, known: dict, plan: dict) -> bool:
        t0 = time.monotonic()
        dead, step, failing = death["rank"], plan["from_step"], plan["failing"]
        seq = self.ctl.open_incident({"kind": "crash", "rank": dead, "failing_step": failing, "halt_step": None,
                                      "resolved": True, "detected_ts": time.monotonic_ns(),
                                      "detected_unix": time.time()})
        if seq is None:
            self._let_go(death, "another incident is being handled")
            return False
        attempt = len(self.attempts) + 1
        rec = self._record(death, attempt, failing, step, seq, t0)
        print(f"watcher: rank {dead} died ({_how(death)}) in step {failing}; replacing every rank from its "
              f"step-{step} snapshot (rescue {attempt})", file=sys.stderr, flush=True)
        host, port = self._store()
        ok = self._carry_out({"attempt": attempt, "from_step": step, "prefix": f"watcher/rescue/{attempt}/",
                              "store": [host, port]}, known, death, plan["job"])
        return self._conclude(rec, seq, ok, known, death, "every rank")

    def _record(self, death: dict, attempt: int, failing: int, step: int, seq: int, t0: float) -> dict:
        """What a rescue keeps of itself: the death, where the ranks resume, its incident."""
        dead = death["rank"]
        rec = {"attempt": attempt, "rank": dead, "pid": death["pid"], "signal": death.get("signal"),
               "exit_code": death.get("exit_code"), "step": failing, "from_step": step,
               "incident_id": f"inc-{seq:04d}", "t0": t0}
        cause = read_json_or_none(self.run_dir.rescue_cause(dead))
        if cause:  # Watcher ended this rank itself: a stuck rank whose hang replayed clean
            rec["cause"] = cause
            os.unlink(self.run_dir.rescue_cause(dead))
        return rec

    def _conclude(self, rec: dict, seq: int, ok: bool, known: dict, death: dict, who: str) -> bool:
        """The rescue's incident and verdict word; on a failure every process
        this node gave to it is let go (its supervisor stops waiting)."""
        rec["detect_to_resume_s"] = round(time.monotonic() - rec["t0"], 3)
        self.attempts.append(rec)
        self._write_incident(rec, ok)
        self._set_verdict(seq)
        if not ok:
            why = f"rescue {rec['attempt']} failed: not {who} resumed from its step-{rec['from_step']} snapshot"
            self._give_up(why, dict(known, **{death["rank"]: (death["pid"], None)}), f"rescue {rec['attempt']} failed")
            return False
        self.pending = rec
        print(f"watcher: {who} resumed from step {rec['from_step']} in {rec['detect_to_resume_s']:.2f} s; the job "
              "goes on", file=sys.stderr, flush=True)
        return True

    def _give_up(self, why: str, given: dict, what: str) -> None:
        """A rescue that failed here: every process this node gave to it is
        let go at once (its supervisor stops waiting for a replacement and
        ends as its rank did), and so is the job on the other nodes."""
        self.let_go = why
        for r, (pid, _) in given.items():
            write_json(self.run_dir.rescue_fate(r, pid), {"fate": "let_go", "reason": why})
        self._tell_peers_let_go(what)
        print(f"watcher: {why}", file=sys.stderr, flush=True)

    # -- across nodes (rescue_across.py) -------------------------------------------------------
    def _across(self) -> AcrossNodes | None:
        """The link to the other nodes' launchers, on a job that spans nodes
        (known once its ranks wrote job.json); None on one node."""
        if self.job is None:
            self.job = read_json_or_none(self.run_dir.job)
            if self.job is not None and multi_node(self.job):
                self.across = AcrossNodes(self.job)
        return self.across

    def _rescue_across(self, death: dict, known: dict, plan: dict) -> bool:
        """Node D's side: call the rescue, agree the step, decide, replace this
        node's ranks, and see every node's replaced."""
        ax, t0 = self.across, time.monotonic()
        a = ax.new_call()
        replaced = False
        for b, call in ax.unanswered(below=a):  # earlier calls first: one of them may cover this death
            replaced = self._answer(b, call, known) or replaced
        ax.answered = max(ax.answered, a)
        if replaced or self._fate_given(death):
            ax.call(a, dict(death, withdrawn=True))
            ax.decide(a, {"withdrawn": True})
            return replaced
        job, dead, failing = plan["job"], death["rank"], plan["failing"]
        ax.call(a, {k: death.get(k) for k in ("rank", "pid", "signal", "exit_code")} | {"failing": failing})
        ax.share_held(a, self._held_local(known, dead))
        held = ax.gather_held(a, SNAPSHOT_WAIT_S)
        step, why = _common_across(held, job["world"], ax.nodes)
        seq = None
        if why is None:
            seq = self._open_incident({"kind": "crash", "rank": dead, "failing_step": failing, "halt_step": None,
                                       "resolved": True, "detected_ts": time.monotonic_ns(),
                                       "detected_unix": time.time()})
            if seq is None:
                why = "another incident is being handled"
        if why is not None:
            ax.decide(a, {"let_go": why})
            self._let_go(death, why)
            return False
        self._clear_gone(job["world"])
        host, port = ax.address
        decision = {"attempt": a, "rank": dead, "node": ax.node, "failing": failing, "from_step": step,
                    "how": _how(death), "prefix": f"watcher/rescue/{a}/", "store": [host, port],
                    "seq": seq, "incident": read_json_or_none(self.ctl.incident_path(seq))}
        ax.decide(a, decision)
        rec = self._record(death, a, failing, step, seq, t0)
        print(f"watcher: rank {dead} died ({_how(death)}) in step {failing}; replacing every rank of the job's "
              f"{ax.nodes} nodes from its step-{step} snapshot (rescue {a})", file=sys.stderr, flush=True)
        ok = self._carry_out(decision, known, death, job)
        ok = ax.all_done(a, RESUME_WAIT_S + SNAPSHOT_WAIT_S) and ok
        return self._conclude(rec, seq, ok, known, death, "every rank of the job")

    def _answer(self, a: int, call: dict | None, known: dict) -> bool:
        """Another node's call: say which snapshots this node's ranks hold,
        and replace them as decided.  True when they were replaced."""
        ax = self.across
        if call is None or call.get("withdrawn"):
            return False
        ax.share_held(a, None if self.let_go is not None else self._held_local(known, None))
        d = ax.decision(a, SNAPSHOT_WAIT_S + 15)
        if d is None or d.get("withdrawn") or "let_go" in d:
            if d is None or "let_go" in d:
                self.let_go = f"rank {call['rank']}'s death on node {call['node']} was let go"
            return False
        print(f"watcher: rank {d['rank']} died on node {d['node']} ({d['how']}) in step {d['failing']}; replacing "
              f"this node's ranks from their step-{d['from_step']} snapshots (rescue {a})", file=sys.stderr, flush=True)
        ok = self._carry_out(d, known, None, self.job)
        ax.done(a, ok)
        if not ok:
            self._give_up(f"rescue {a} failed: not every rank of this node resumed from its step-{d['from_step']} "
                          "snapshot", known, f"rescue {a} failed")
        return ok

    def _carry_out(self, d: dict, known: dict, death: dict | None, job: dict) -> bool:
        """Replace this node's ranks by their step-S snapshots, as decided.
        On one node every rank of the job is this node's (`job` is the one
        read for this rescue: on one node its ranks may still be joining it)."""
        step, a = d["from_step"], d["attempt"]
        world = int(job["world"])
        local = [int(r) for r in job["local_ranks"]] if multi_node(job) else list(range(world))
        survivors = {r: pid for r, (pid, _) in known.items() if death is None or r != death["rank"]}
        if death is not None:
            write_json(self.run_dir.rescue_fate(death["rank"], death["pid"]), {"fate": "replace", "attempt": a})
        for r, pid in survivors.items():
            write_json(self.run_dir.rescue_fate(r, pid), {"fate": "replace", "attempt": a})
        for pid in survivors.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        orphans = [self.run_dir.rescue_orphan(r, step) for r in local]
        if not wait_for(lambda: all(p.exists() for p in orphans), SNAPSHOT_WAIT_S):
            return False
        # Nobody is gone in the resumed job: this node's view of the other
        # nodes' ranks forgets the deaths it adopted (the job's store forgot
        # them too, _clear_gone).
        for r in range(world):
            if self.ctl.gone(r):
                self.ctl.arrive(r, 0, step)
        # The resumed ranks start with the rescue's incident known (their
        # node's relay, which would have brought it, died with the leader):
        # else they would take it for a new one and skip their first snapshot.
        if d.get("incident") and self.ctl.incident_seq < d["seq"]:
            write_json(self.ctl.incident_path(d["seq"]), d["incident"])
            self.ctl.mirror(incident=d["seq"])
        for r in local:
            write_json(self.run_dir.crash_order(r, step), {"op": "resume", "attempt": a, "prefix": d["prefix"],
                                                          "store": d["store"]})
        old = {r: pid for r, (pid, _) in known.items()}
        return bool(wait_for(lambda: all(_named_pid(self.run_dir, r) not in (None, old.get(r)) for r in local),
                             RESUME_WAIT_S))

    def _held_local(self, known: dict, dead: int | None) -> dict:
        """{rank: snapshot steps} of this node's ranks: the dead rank's orphans, the others' last snapshots."""
        out = {}
        for r in [int(r) for r in self.job.get("local_ranks") or known]:
            if r == dead:
                mine = wait_for(lambda: sorted(int(p.name.rsplit("step", 1)[1])
                                               for p in self.run_dir.rescue.glob(f"orphan.rank{r}.step*")),
                                DEAD_ORPHAN_WAIT_S) or []
            else:
                mine = _last_snapshots(self.run_dir.steps_log(r))
            out[str(r)] = mine
        return out

    def _clear_gone(self, world: int) -> None:
        """The job's store forgets the ranks marked gone: every one resumes."""
        store = self.job_store()
        if store is None:
            return
        for r in range(world):
            try:
                store.delete_key(f"gone/{r}")
            except Exception:
                pass
        try:
            store.delete_key(LET_GO_KEY)
        except Exception:
            pass

    def _open_incident(self, info: dict) -> int | None:
        """Job-wide on many nodes (the job's store), else in the node's control block."""
        if self.across is None:
            return self.ctl.open_incident(info)
        if self.nodelink is None:
            store = self.job_store()
            if store is None:
                return None
            j = self.job
            lay = NodeLayout(rank=-1, world=int(j["world"]), local_rank=-1, local_world=len(j["local_ranks"]),
                             node=int(j["node"]), nodes=int(j["nodes"]), master_addr=j["master_addr"],
                             master_port=int(j["master_port"]), run_id=j.get("run_id", "job"))
            self.nodelink = NodeLink(self.ctl, lay, store=store)
        return self.nodelink.open_incident(info)

    def _set_verdict(self, seq: int) -> None:
        v = max(self.ctl.verdict_seq, seq)
        self.ctl.verdict_seq = v
        if self.nodelink is not None:
            try:
                self.nodelink.set_word("verdict_seq", v)
            except Exception:
                pass

    def _save(self, doc: Incident) -> None:
        """The incident in this run directory, and on many nodes in every node's."""
        save_incident(self.run_dir, doc)
        if self.across is not None and self.across.link is not None:
            try:
                self.across.share_doc(doc.to_dict())
            except Exception:
                pass

    def _adopt_docs(self, ax: AcrossNodes) -> None:
        for d in ax.new_docs():
            save_incident(self.run_dir, Incident.from_dict(d))

    def finish(self) -> None:
        """At the job's end: the last documents other nodes shared, then the link's thread goes."""
        ax = self.across
        if ax is None:
            return
        if ax.link is not None:
            try:
                self._adopt_docs(ax)
            except Exception:
                pass
        ax.stop()

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
        self._save(doc)

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
        self._save(doc)
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
        self._save(hang)


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


def _common_across(held: dict[int, dict | None], world: int, nodes: int) -> tuple[int | None, str | None]:
    """The newest step of which every rank of every node holds a snapshot, or why there is none."""
    missing = [n for n in range(nodes) if held.get(n) is None]
    if missing:
        return None, f"node {missing[0]}'s launcher did not take part in the rescue"
    by_rank = {int(r): set(steps) for h in held.values() for r, steps in h.items()}
    if sorted(by_rank) != list(range(world)):
        return None, "not every rank's snapshots were accounted for"
    common = set.intersection(*by_rank.values())
    if not common:
        return None, "no step of which every rank still holds a snapshot"
    return max(common), None


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


