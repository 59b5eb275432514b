"""`watcher diagnose` and `watcher release`: the diagnosis again, after the run,
from the snapshots a persistent incident retained.

When a run stops on a persistent incident, each rank hands the frozen
snapshot its diagnosis replayed from to an orphan that outlives the rank for
`watcher run --retain` seconds (snapshot.py).  It keeps taking replay orders,
as files:

    DIR/retained/rank<r>.json      where rank r's snapshot is: pid, step, deadline
    DIR/retained/orders/rank<r>/   order files it takes, one at a time
    DIR/retained/window/           the window since the snapshot, copied off tmpfs

`rediagnose` drives the same rounds the live ranks ran (trace, then the
counterfactuals planned from it), every rank's replay at once since replayed
collectives exchange inputs, and compares its verdict and causal chain with
the one recorded in the incident.  Results land in
DIR/incidents/<id>/rediagnosis-<n>/, never over the run's own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ..analysis.detectors import Detectors
from ..errors import RecordingError, UsageError
from ..incident import load_incident
from ..launcher_link import LINK_WAIT_S, LauncherLink, multi_node
from ..rundir import ReplayDir, RunDir, read_json, write_json
from ..runtime.control import process_state
from .diagnose import conclude, plan_counterfactuals
from .plan import JobLog, replay_timeout_s, window_seconds
from .relay import ExchangeRelay, assigned_pulls
from .rounds import load_results, publish_result, remove_tree
from .snapshot import replay_order
from .verdict import DIAGNOSED

# What a prescription says beyond the decision itself: where its reproducer
# was written and whether the run applied it.
NOT_COMPARED = ("reproducer", "applied", "applied_at_step")


@dataclass
class OfflineRun:
    """What diagnosis reads of a rank (runtime/seam.py), taken from the run directory."""
    rundir: RunDir
    world: int
    detectors: object
    replicated: bool | None
    rank: int = 0
    policy: str = "observe"  # a diagnosis after the run changes nothing


def retained(run_dir: RunDir) -> list[dict]:
    """The retained snapshots, by rank, each with "alive"."""
    found = []
    for p in run_dir.retained_infos():
        try:
            r = read_json(p)
        except (OSError, ValueError):
            continue
        r["alive"] = _alive(r)
        found.append(r)
    return sorted(found, key=lambda r: r["rank"])


def _alive(r: dict) -> bool:
    """The very process that was retained (pid and start time), not a zombie."""
    got = process_state(r["pid"])
    return got is not None and got[0] != "Z" and got[1] == r.get("start_ticks")


def rediagnose(run_dir: Path, incident_id: str | None = None, say=lambda msg: None) -> dict:
    """Repeat the incident's diagnosis from its retained snapshots; returns the
    new attribution, chain and prescription and whether they match the run's.

    On a multi-node job run it on every node: node 0's links the others
    (watcher/launcher_link.py), plans, and concludes; each node replays its
    own ranks' snapshots, their collective inputs relayed between nodes."""
    run_dir = RunDir(run_dir).check()
    snaps = retained(run_dir)
    if not snaps:
        raise RecordingError(f"{run_dir} has no retained snapshots: only a run stopped by a persistent "
                             "non_finite, loss_spike or sdc incident keeps them (watcher run --retain SECONDS)")
    iid = incident_id or snaps[0]["incident_id"]
    if any(s["incident_id"] != iid for s in snaps):
        held = snaps[0]["incident_id"]
        raise UsageError(f"the retained snapshots are {held}'s, not {iid}'s")
    world = snaps[0]["world"]
    job = read_json(run_dir.job) if run_dir.job.exists() else {}
    local = job.get("local_ranks") or list(range(world))
    if [s["rank"] for s in snaps] != local or len({s["step"] for s in snaps}) != 1:
        raise RecordingError(f"{run_dir.retained} holds ranks {[s['rank'] for s in snaps]} at steps "
                             f"{sorted({s['step'] for s in snaps})}, not one snapshot per rank of {local}")
    gone = [s["rank"] for s in snaps if not s["alive"]]
    if gone:
        ends = time.strftime("%H:%M:%S", time.localtime(max(s["until"] for s in snaps)))
        raise RecordingError(f"the retained snapshots of ranks {gone} are gone (kept until {ends}, or released); "
                             "run again with a longer --retain")
    if not run_dir.incident_path(iid).exists():
        raise UsageError(f"no incident {iid} in {run_dir.root}")
    inc = load_incident(run_dir, iid).to_dict()
    if inc.get("kind") not in DIAGNOSED:
        raise UsageError(f"{iid} is a {inc.get('kind')} incident; diagnosis covers {', '.join(DIAGNOSED)}")
    link = None
    if multi_node(job):
        say(f"{iid}: linking the job's {job['nodes']} nodes (run `watcher diagnose` on each)")
        link = LauncherLink(job, f"diagnose-{iid}", wait_s=LINK_WAIT_S)
        run_dir.shared = link.store
    try:
        return _rediagnose(run_dir, snaps, inc, link, say)
    finally:
        if link is not None:
            link.close()


def _rediagnose(run_dir: RunDir, snaps: list[dict], inc: dict, link: LauncherLink | None, say) -> dict:
    world, iid = snaps[0]["world"], inc["incident_id"]
    rt = OfflineRun(run_dir, world, Detectors.from_dict(json.loads(snaps[0]["detect"] or "{}")),
                    snaps[0].get("replicated"))
    lead = link is None or link.node == 0  # plans and concludes; the others replay their ranks
    k = inc["detected_step"]
    info = {"incident_id": iid, "failing_step": k, "rank": inc["detected_rank"], "kind": inc["kind"],
            "detected_ts": inc.get("detected_ts")}
    if lead:
        to_step = (inc.get("diagnosis") or {}).get("to_step") or inc["window"]["to_step"]
        durations = {s: fp.get("dur") for s, fp in run_dir.read_steps(0).items()}
        window_s = window_seconds(durations, snaps[0]["step"], to_step)
        plan = {"failing_step": k, "from_step": snaps[0]["step"], "to_step": to_step,
                "replay_timeout_s": replay_timeout_s(window_s)}
        out = run_dir.incident_dir(iid).new_rediagnosis()
    if link is not None:
        # Node 0 reads every rank's arrival (its log excerpt, plan.JobLog); each node holds its own ranks'.
        for s in snaps:
            arrival = run_dir.incident_dir(iid).arrive(s["rank"])
            if arrival.exists():
                link.store.set(run_dir.key(arrival), arrival.read_text())
        link.share({"ranks": [s["rank"] for s in snaps], "step": snaps[0]["step"]})
        if lead:
            link.decide(_check_nodes(link.gather(), link.nodes, world)
                        or {"plan": plan, "window_s": window_s, "out": str(out.relative_to(run_dir.root))})
        d = link.decision(link.wait_s + 15)
        if d is None:
            raise RecordingError(f"node 0's `watcher diagnose` never answered at {link.where}: run it on every node")
        if d.get("error"):
            raise RecordingError(d["error"])
        plan, window_s, out = d["plan"], d["window_s"], run_dir.root / d["out"]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    say(f"{iid}: replaying steps {plan['from_step']}..{plan['to_step']} from the retained snapshots")
    trace = _replay_everywhere(rt, snaps, {"name": "trace", "trace": {"failing_step": k}}, plan, out, say, link)
    if lead:
        variants = plan_counterfactuals(rt, info, plan, trace)
        if link is not None:
            link.store.set("variants", json.dumps(variants, default=str))
    else:
        variants = json.loads(_await_key(link, "variants", plan["replay_timeout_s"] + 60))
    results = {"trace": trace}
    for var in variants:
        results[var["name"]] = _replay_everywhere(rt, snaps, var, plan, out, say, link)
    if lead:
        found = conclude(rt, info, plan, results, {v["name"]: v for v in variants}, out / "reproducer",
                         JobLog.of(run_dir, run_dir.incident_dir(iid), world))
        found.pop("apply")
        doc = {"incident_id": iid, "from_step": plan["from_step"], "to_step": plan["to_step"],
               "diagnosis_s": round(time.monotonic() - t0, 3), "window_s": round(window_s, 3), **found}
        doc["differences"] = differences(inc, found) if inc.get("attribution") else None
        doc["same_as_recorded"] = None if doc["differences"] is None else not doc["differences"]
        if link is not None:
            link.store.set("summary", json.dumps(doc, default=str))
    else:
        doc = json.loads(_await_key(link, "summary", plan["replay_timeout_s"] + 60))
    write_json(ReplayDir(out).summary, doc)
    doc["out"] = str(out)
    return doc


def _check_nodes(found: dict[int, dict], nodes: int, world: int) -> dict | None:
    """Node 0's check that every node brought its ranks' snapshots, all at one step."""
    missing = sorted(set(range(nodes)) - set(found))
    if missing:
        return {"error": f"nodes {missing} did not join: run `watcher diagnose` on every node of the job "
                         f"within {LINK_WAIT_S:g} s of each other"}
    ranks = sorted(r for f in found.values() for r in f["ranks"])
    steps = sorted({f["step"] for f in found.values()})
    if ranks != list(range(world)) or len(steps) != 1:
        return {"error": f"the nodes hold snapshots of ranks {ranks} at steps {steps}, not one per rank of {world}"}
    return None


def _await_key(link: LauncherLink, key: str, wait_s: float) -> bytes:
    got = link.wait_for(key, wait_s)
    if got is None:
        raise RecordingError(f"node 0's `watcher diagnose` sent no {key} within {wait_s:.0f} s")
    return got


def differences(recorded: dict, found: dict) -> list[str]:
    """Where a repeated diagnosis departs from the recorded one (empty: the same)."""
    diffs = []
    a, b = recorded.get("attribution") or {}, found["attribution"]
    for key in ("cause", "confidence"):
        if a.get(key) != b.get(key):
            diffs.append(f"attribution {key}: recorded {a.get(key)!r}, now {b.get(key)!r}")
    chain_a, chain_b = recorded.get("causal_chain") or [], found["causal_chain"]
    if len(chain_a) != len(chain_b):
        diffs.append(f"causal chain: recorded {len(chain_a)} links, now {len(chain_b)}")
    for i, (x, y) in enumerate(zip(chain_a, chain_b)):
        if _plain(x) != _plain(y):
            diffs.append(f"causal chain link {i}: recorded {x}, now {y}")
    pa = {k: v for k, v in (recorded.get("prescription") or {}).items() if k not in NOT_COMPARED}
    pb = {k: v for k, v in found["prescription"].items() if k not in NOT_COMPARED}
    if _plain(pa) != _plain(pb):
        diffs.append(f"prescription: recorded {pa}, now {pb}")
    return diffs


def _plain(x):
    """JSON form, as the recorded incident has it (int keys become strings)."""
    return json.loads(json.dumps(x, default=str))


def _replay_everywhere(rt: OfflineRun, snaps: list[dict], var: dict, plan: dict, out: Path, say,
                       link: LauncherLink | None = None) -> list[dict]:
    """One variant, replayed by every rank's snapshot at once; their results
    (on many nodes: this node's ranks replay, and node 0 gets every rank's)."""
    name = var["name"]
    say(f"counterfactual replay {name}")
    vdir = ReplayDir(out / name)
    vdir.path.mkdir(parents=True, exist_ok=True)
    exchange = out / f"exchange-{name}"
    exchange.mkdir(exist_ok=True)
    local = [s["rank"] for s in snaps]
    relays = [ExchangeRelay(link.store, name, exchange, r, assigned_pulls(local, rt.world, r)).start()
              for r in local] if link is not None else []
    for s in snaps:
        r = s["rank"]
        order = replay_order(r, plan["to_step"], vdir, exchange, plan["replay_timeout_s"], var, reply=vdir.reply(r))
        write_json(rt.rundir.retained_orders(r) / f"{time.time_ns()}-{name}.json", order)
    deadline = time.monotonic() + plan["replay_timeout_s"] + 30
    replies = [vdir.reply(s["rank"]) for s in snaps]
    try:
        while not all(p.exists() for p in replies):
            dead = [s["rank"] for s, p in zip(snaps, replies) if not p.exists() and not _alive(s)]
            if dead or time.monotonic() > deadline:
                raise RecordingError(f"replay {name}: the snapshots of ranks {dead} exited before replying" if dead
                                     else f"replay {name}: no reply within {plan['replay_timeout_s'] + 30:.0f} s")
            time.sleep(0.05)
    finally:
        for relay in relays:
            relay.finish(30)
        remove_tree(exchange)  # every rank's replayed inputs: large, read by nobody now
    if link is not None:
        for r in local:
            publish_result(rt.rundir, vdir, r)
        link.store.set(f"replayed/{name}/{link.node}", "1")
        if link.node != 0:
            return []
        for n in range(link.nodes):  # every node's ranks replied and published their results
            _await_key(link, f"replayed/{name}/{n}", plan["replay_timeout_s"] + 60)
    # Results by rank index: the snapshots are one per rank, 0..world-1 (checked above).
    return load_results(rt, vdir)


def release(run_dir: Path) -> list[int]:
    """End the retained snapshots now and free their window copy; returns the
    ranks whose snapshot was still alive."""
    run_dir = RunDir(run_dir).check()
    snaps = retained(run_dir)
    ended = []
    for s in snaps:
        if s["alive"]:
            try:
                write_json(run_dir.retained_orders(s["rank"]) / f"{time.time_ns()}-exit.json", {"op": "exit"})
            except OSError:
                pass
            ended.append(s["rank"])
    deadline = time.monotonic() + 5
    while any(_alive(s) for s in snaps) and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in snaps:
        if _alive(s):  # busy with a replay: it holds nothing we still want
            try:
                os.kill(s["pid"], signal.SIGKILL)
            except OSError:
                pass
    for sub in (run_dir.retained_window, run_dir.retained_orders(0).parent):
        shutil.rmtree(sub, ignore_errors=True)
    return ended
