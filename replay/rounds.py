"""One round of replays across ranks, as the incident protocol and the
diagnosis both run it: every rank replays its own snapshot into a ReplayDir
and says how it ended; rank 0 waits for all of them and reads the results."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from ..rundir import ReplayDir, exchange_dir, write_json
from ..runtime.seam import Rank

WAIT_S = float(os.environ.get("WATCHER_INCIDENT_WAIT", "600"))


def replay_here(rt: Rank, snap_step: int | None, to_step: int, out: ReplayDir, exchange_tag: str, timeout: float,
                variant: dict | None = None, state_copy: int | None = None, keep_exchange: bool = True,
                **facts) -> None:
    """This rank's replay of steps snap_step+1..to_step from its snapshot
    (coordinated through an exchange directory in the window directory);
    how it ended goes to out.replayed(rank), with `facts` added."""
    mine = {"rank": rt.rank, **facts}
    exchange = exchange_dir(rt.window_dir, exchange_tag)
    try:
        snap = rt.snapshot_at(snap_step) if snap_step is not None else None
        if snap_step is None:
            pass  # no plan to replay: the verdict says why
        elif snap is None:
            mine["error"] = f"snapshot {snap_step} is gone"
        else:
            exchange.mkdir(exist_ok=True)
            mine.update(snap.replay(to_step, out, timeout=timeout, exchange=exchange, variant=variant,
                                    state_copy=state_copy))
    except Exception as e:  # a dead snapshot, a broken pipe: this rank's replay failed, not the job
        mine["error"] = f"replay failed: {e}"
    out.make()
    write_json(out.replayed(rt.rank), mine)
    if not keep_exchange:
        remove_tree(exchange)


def await_replays(rt: Rank, out: ReplayDir, what: str = "every rank's replay") -> None:
    """Wait until every rank has said how its replay into `out` ended."""
    rt.ctl.wait(lambda: out.all_replayed(rt.world), WAIT_S, what)


def load_results(out: ReplayDir, world: int) -> list[dict]:
    """Every rank's replay result (steps, collectives, the end state)."""
    results = []
    for r in range(world):
        try:
            results.append(torch.load(out.result(r), weights_only=False))
        except Exception:
            results.append({"rank": r, "status": "no_result"})
    return results


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def say(rt: Rank, msg: str) -> None:
    """One line on the job's stderr, from rank 0 only."""
    if rt.rank == 0:
        print(f"watcher: {msg}", file=sys.stderr, flush=True)
