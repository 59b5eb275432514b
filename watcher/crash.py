"""After the job: a rank that crashed, replayed from its last snapshot.

A rank's snapshots outlive it for a short while (replay/snapshot.py, the
orphan wait), so once the job is over `watcher run` orders every rank's
snapshot at one step to replay up to the crash step, coordinated (the
crashed rank's collectives need its peers' inputs), and judges the crash by
whether the replay dies again the same way.

On many nodes each node holds its own ranks' snapshots and the job's store
is gone: the nodes' launchers link (launcher_link.py).  Each shares its
first abnormal death and its ranks' snapshot steps; node 0 picks the crash
(a death by a signal before an exit code, then the earliest) and the step to
replay from; every node orders its own snapshots, relaying the replays'
collective inputs through the link (replay/relay.py); the crashed rank's
node judges and publishes the incident, and every node writes the same one.
"""

from __future__ import annotations

import json
import shutil
import signal
import time

import duckdb
import torch

from .errors import RecordingError
from .incident import Incident, save_incident
from .launcher_link import LauncherLink, multi_node
from .replay.relay import ExchangeRelay, assigned_pulls
from .replay.snapshot import replay_order
from .replay.verdict import classify_crash, crash_replay_verdict
from .rundir import STOP_EXIT_CODE, ReplayDir, RunDir, live_snapshots, read_json, read_json_or_none, write_json
from .runtime import crashsite
from .store import rank_processes

# How long the crashed rank's replay may take to answer (the orphans wait
# for their orders a little, then run the window).
REPLY_WAIT_S = 120.0
# Deaths that are the launcher's doing, after a peer failed or on a stop.
TEARDOWN = (signal.SIGTERM, signal.SIGKILL, signal.SIGINT)


def crash_incident(run_dir: RunDir) -> Incident | None:
    """The crash incident of a job that lost a rank, written to the run directory."""
    try:
        # A death the rescue undid is not the job's crash (rescue.py judged it).
        ranks = [r for r in rank_processes(run_dir.recording, _took_over(run_dir)) if not _rescued(run_dir, r)]
    except duckdb.Error:
        return None
    job = read_json(run_dir.job) if run_dir.job.exists() else {}
    world = job.get("world") or (max(r["rank"] for r in ranks) + 1 if ranks else 0)
    local = job.get("local_ranks") or sorted({r["rank"] for r in ranks})
    crashed = next((r for r in ranks if _crashed(r)), None)
    if multi_node(job):
        if not any(_abnormal(r) for r in ranks):
            return None  # every rank here ended well: no peer of ours crashed while we ran
        steps = {r: run_dir.read_steps(r) for r in local}
        death = _death(crashed, steps.get(crashed["rank"], {}), run_dir) if crashed else None
        return _across_nodes(run_dir, job, world, local, death, steps)
    if crashed is None:
        return None  # a job that ended well reads no step log here
    death = _death(crashed, run_dir.read_steps(crashed["rank"]), run_dir)
    snaps = death["snaps"]
    verdict = _opened(run_dir.next_incident_id(), death, snaps[-1] if snaps else None)
    inc_dir = run_dir.incident_dir(verdict.incident_id).make()
    if snaps:
        verdict.replay = _replay(run_dir, death, world, local, snaps[-1], inc_dir)
        classify_crash(verdict)
    else:
        verdict.replay = _no_replay("the rank crashed before its first snapshot")
    save_incident(run_dir, verdict)
    return verdict


def _took_over(run_dir: RunDir) -> dict[int, int]:
    """{pid: rank} of the processes that resumed a rank after a rescue: the
    last process each rank named (DIR/runtime/rank<r>.process.json)."""
    out = {}
    for rank, path in run_dir.rank_process_files():
        p = read_json_or_none(path) or {}
        if p.get("rescue") and p.get("pid"):
            out[int(p["pid"])] = rank
    return out


def _rescued(run_dir: RunDir, r: dict) -> bool:
    return (read_json_or_none(run_dir.rescue_fate(r["rank"], r["pid"])) or {}).get("fate") == "replace"


def _crashed(r: dict) -> bool:
    """Died of itself: a signal the launcher does not send, or an error exit."""
    sig, code = r["exit_signal"], r["exit_code"]
    if sig:
        return sig not in TEARDOWN
    return code not in (0, STOP_EXIT_CODE, None)


def _abnormal(r: dict) -> bool:
    return bool(r["exit_signal"]) or r["exit_code"] not in (0, STOP_EXIT_CODE)


def _death(r: dict, steps: dict, run_dir: RunDir) -> dict:
    """A crashed rank's death, in terms every node compares alike (the wall
    clock: the recording's timestamps are this machine's monotonic clock),
    with where it died when it died of a fatal signal (runtime/crashsite.py)."""
    last = max(steps) if steps else -1
    return {"rank": r["rank"], "pid": r["pid"], "exit_code": r["exit_code"], "exit_signal": r["exit_signal"],
            "end_ts": r["end_ts"], "died_wall": r["end_ts"] / 1e9 + time.time() - time.monotonic(),
            "how": (f"signal {signal.Signals(r['exit_signal']).name}" if r["exit_signal"]
                    else f"exit code {r['exit_code']}"),
            "last_step": last, "snaps": live_snapshots(run_dir.steps_log(r["rank"])),
            "site": crashsite.read(run_dir.crash_site(r["rank"])) if r["exit_signal"] else None}


def _opened(incident_id: str, death: dict, snap_step: int | None) -> Incident:
    k = death["last_step"] + 1
    detail = {key: death[key] for key in ("how", "pid", "exit_code", "exit_signal")}
    if death.get("site"):
        detail.update(crash_site=death["site"], where=crashsite.describe(death["site"]))
    return Incident.opened(incident_id, "crash", k, death["rank"], death["end_ts"], detail, snap_step, k)


def _no_replay(reason: str) -> dict:
    return {"reproduced": None, "first_divergence": None, "reason": reason}


def _across_nodes(run_dir: RunDir, job: dict, world: int, local: list[int], death: dict | None,
                  steps: dict) -> Incident | None:
    mine = {"crash": death and dict(death, node=job["node"]), "next_id": run_dir.next_incident_id(),
            "snaps": {str(r): live_snapshots(run_dir.steps_log(r)) for r in steps}}
    try:
        link = LauncherLink(job, "crash")
    except RecordingError as e:
        if death is None:
            return None
        verdict = _opened(mine["next_id"], death, None)
        verdict.replay = _no_replay(f"a crash replay needs every node's snapshots: {e}")
        save_incident(run_dir, verdict)
        return verdict
    try:
        link.share(mine)
        if link.node == 0:
            link.decide(_decide(link.gather(), link.nodes, world))
        d = link.decision(link.wait_s + 15)
        if d is None or d["crash"] is None:
            if death is None:
                return None
            verdict = _opened(mine["next_id"], death, None)
            verdict.replay = _no_replay("node 0's launcher never answered, so no node replayed")
            save_incident(run_dir, verdict)
            return verdict
        c, iid = d["crash"], d["incident_id"]
        inc_dir = run_dir.incident_dir(iid).make()
        verdict = _opened(iid, c, d["snap_step"])
        owner = c["node"] == job["node"]
        if d.get("reason"):
            verdict.replay = _no_replay(d["reason"])
        else:
            replay = _replay(run_dir, c, world, local, d["snap_step"], inc_dir, link.store)
            if owner:
                verdict.replay = replay
                classify_crash(verdict)
        if owner:
            link.store.set("verdict", json.dumps(verdict.to_dict(), default=str))
        else:
            try:
                verdict = Incident.from_dict(json.loads(link.wait_for("verdict", REPLY_WAIT_S + 30)))
            except Exception:  # none came (json.loads(None) raises too), or it was unreadable
                verdict.replay = _no_replay(f"node {c['node']}, where rank {c['rank']} crashed, never sent its "
                                            "verdict")
        save_incident(run_dir, verdict)
        return verdict
    finally:
        link.close()


def _decide(found: dict[int, dict], nodes: int, world: int) -> dict:
    """Node 0's choice, from every node's share: the crash, its incident id
    (after every node's incidents), the step every rank replays from."""
    deaths = [f["crash"] for f in found.values() if f.get("crash")]
    if not deaths:
        return {"crash": None}
    # A death by a signal is the cause; an error exit may be a peer failing on
    # the dead rank's closed connections.  Then the earliest.
    c = min(deaths, key=lambda d: (not d["exit_signal"], d["died_wall"], d["rank"]))
    decision = {"crash": c, "incident_id": max(f["next_id"] for f in found.values()), "snap_step": None}
    missing = sorted(set(range(nodes)) - set(found))
    snaps = {int(r): set(s) for f in found.values() for r, s in f["snaps"].items()}
    common = set.intersection(*(snaps.get(r, set()) for r in range(world)))
    common = sorted(s for s in common if s <= c["last_step"])
    if missing:
        decision["reason"] = f"nodes {missing} never linked after the job, and a crash replay needs every rank"
    elif not common:
        decision["reason"] = "the rank crashed before every rank had a snapshot to replay from"
    else:
        decision["snap_step"] = common[-1]
    return decision


def _replay(run_dir: RunDir, crash: dict, world: int, local: list[int], snap_step: int, inc_dir: ReplayDir,
            store=None) -> dict | None:
    """Order this node's snapshots at `snap_step` to replay to the crash step;
    the verdict's replay part where the crashed rank is one of ours.  With a
    store, the replays' collective inputs cross nodes through it."""
    rank, to_step = crash["rank"], crash["last_step"] + 1
    inc_dir.exchange.mkdir(exist_ok=True)
    relays = [ExchangeRelay(store, "crash", inc_dir.exchange, r, assigned_pulls(local, world, r)).start()
              for r in local] if store is not None else []
    for r in local:
        order = replay_order(r, to_step, inc_dir, inc_dir.exchange, 60, reply=inc_dir.crash_reply(r))
        write_json(run_dir.crash_order(r, snap_step), order)
    first = [rank] if rank in local else local
    deadline = time.monotonic() + REPLY_WAIT_S
    while time.monotonic() < deadline and not all(inc_dir.crash_reply(r).exists() for r in first):
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(inc_dir.crash_reply(r).exists() for r in local):
        time.sleep(0.1)
    for relay in relays:
        relay.finish(10)
    shutil.rmtree(inc_dir.exchange, ignore_errors=True)  # the replayed inputs: large, and read by nobody now
    if rank not in local:
        return None
    if not inc_dir.crash_reply(rank).exists():
        return _no_replay(f"the snapshot at step {snap_step} was gone before it could be replayed")
    result = {}
    try:
        result = torch.load(inc_dir.result(rank), weights_only=False)
    except Exception:
        pass
    return crash_replay_verdict(read_json(inc_dir.crash_reply(rank)), result, snap_step, crash,
                                crashsite.read(inc_dir.crash_site(rank)))
