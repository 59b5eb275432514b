"""One round of replays across ranks, as the incident protocol and the
diagnosis both run it: every rank replays its own snapshot into a ReplayDir
and says how it ended; rank 0 waits for all of them and reads the results.
On a multi-node job the replays' collective inputs cross nodes through the
job's store (relay.py), and each rank publishes its result for rank 0 (all
of it but the end state, which only its own merge needs)."""

from __future__ import annotations

import io
import os
import shutil
import sys
from pathlib import Path

import torch

from ..rundir import ReplayDir, exchange_dir
from ..runtime.seam import Rank
from .relay import ExchangeRelay, assigned_pulls

WAIT_S = float(os.environ.get("WATCHER_INCIDENT_WAIT", "600"))
# What this rank put in the job's store during an incident's rounds (its
# relayed exchange chunks, its published results), dropped once the incident
# is over on every node (forget_published): the store's host keeps it in memory.
_published: list[tuple[str, list[str]]] = []


def replay_here(rt: Rank, snap_step: int | None, to_step: int, out: ReplayDir, exchange_tag: str, timeout: float,
                variant: dict | None = None, state_copy: int | None = None, keep_exchange: bool = True,
                **facts) -> None:
    """This rank's replay of steps snap_step+1..to_step from its snapshot
    (coordinated through an exchange directory in the window directory);
    how it ended goes to out.replayed(rank), with `facts` added."""
    mine = {"rank": rt.rank, **facts}
    exchange = exchange_dir(rt.window_dir, exchange_tag)
    relay = None
    try:
        snap = rt.snapshot_at(snap_step) if snap_step is not None else None
        if snap_step is None:
            pass  # no plan to replay: the verdict says why
        elif snap is None:
            mine["error"] = f"snapshot {snap_step} is gone"
        else:
            exchange.mkdir(exist_ok=True)
            if rt.rundir.shared is not None:
                relay = ExchangeRelay(rt.rundir.shared, exchange_tag, exchange, rt.rank,
                                      assigned_pulls(rt.local_ranks, rt.world, rt.rank)).start()
            mine.update(snap.replay(to_step, out, timeout=timeout, exchange=exchange, variant=variant,
                                    state_copy=state_copy))
    except Exception as e:  # a dead snapshot, a broken pipe: this rank's replay failed, not the job
        mine["error"] = f"replay failed: {e}"
    if relay is not None:
        relay.finish(timeout)
        mine["relayed_mb"] = round(relay.bytes_relayed / 2**20, 3)
        _published.append((exchange_tag, relay.keys()))
    out.make()
    if _publish_result(rt, out):
        _published.append((exchange_tag, [rt.rundir.key(out.result(rt.rank))]))
    rt.rundir.put(out.replayed(rt.rank), mine)
    if not keep_exchange and rt.rundir.shared is None:
        # On many nodes the node's exchange directory serves its other ranks'
        # relays until every replay is over: removed when the incident closes.
        remove_tree(exchange)


def _publish_result(rt: Rank, out: ReplayDir) -> bool:
    if rt.rundir.shared is None:
        return False
    return publish_result(rt.rundir, out, rt.rank)


def publish_result(rundir, out: ReplayDir, rank: int) -> bool:
    """For rank 0 on another node: a rank's result without the end state
    (which only its own merge needs), through the run directory's store."""
    if not out.result(rank).exists():
        return False
    try:
        res = torch.load(out.result(rank), weights_only=False)
    except Exception:
        return False
    if "state" in res:
        res["state"] = {"param_sum": res["state"].get("param_sum"), "elsewhere": True}
    buf = io.BytesIO()
    torch.save(res, buf)
    rundir.put_bytes(out.result(rank), buf.getvalue())
    return True


def forget_published(rt: Rank, incident_id: str) -> None:
    """Drop from the job's store what this rank published for the incident's rounds."""
    keep = []
    for tag, keys in _published:
        if tag == incident_id or tag.startswith(incident_id + "-"):
            for k in keys:
                try:
                    rt.rundir.shared.delete_key(k)
                except Exception:
                    pass
        else:
            keep.append((tag, keys))
    _published[:] = keep


def await_replays(rt: Rank, out: ReplayDir, what: str = "every rank's replay") -> None:
    """Wait until every rank has said how its replay into `out` ended."""
    rt.ctl.wait(lambda: rt.rundir.has_all([out.replayed(r) for r in range(rt.world)]), WAIT_S, what)


def load_results(rt: Rank, out: ReplayDir) -> list[dict]:
    """Every rank's replay result (steps, collectives; the end state for this node's ranks)."""
    results = []
    for r in range(rt.world):
        try:
            results.append(torch.load(io.BytesIO(rt.rundir.get_bytes(out.result(r))), weights_only=False))
        except Exception:
            results.append({"rank": r, "status": "no_result"})
    return results


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def say(rt: Rank, msg: str) -> None:
    """One line on the job's stderr, from rank 0 only."""
    if rt.rank == 0:
        print(f"watcher: {msg}", file=sys.stderr, flush=True)
