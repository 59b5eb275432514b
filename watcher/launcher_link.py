"""The launchers of a multi-node job, linked once the job is over.

While the job runs, its ranks coordinate through the job's own store
(runtime/nodes.py).  That store goes with the job, yet two things need every
node afterwards: replaying a crashed rank from the snapshots all ranks left
behind (each node holds its own ranks'), and `watcher diagnose` over retained
snapshots.  So the launchers link the way torchrun's agents do: node 0's
hosts a c10d TCPStore at the job's master address, one port above the job's
(WATCHER_LINK_PORT chooses another), and the other nodes' connect to it.
Where that is comes from DIR/runtime/job.json, which the node's ranks wrote.

Each use of the link has its own prefix (a crash, a diagnosis); under it:

    found/<n>      what node n brings (its part of the decision)
    decision       what every node acts on, from the node that decides
    x/<tag>/...    the replays' collective inputs (replay/relay.py)
    run/<path>     documents and result files (rundir.RunDir.put / put_bytes)
    done           how many nodes are finished: node 0 keeps the store up until all are
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch.distributed as dist

from .errors import RecordingError

# How long a launcher waits for the others to turn up: their jobs end within
# seconds of each other (a dead rank's peers fail on its closed connections).
LINK_WAIT_S = float(os.environ.get("WATCHER_LINK_WAIT", "45"))


def multi_node(job: dict) -> bool:
    return int(job.get("nodes") or 1) > 1 and "master_addr" in job


# One store per launcher process: node 0's hosts it, and the rescue's link
# (made while the job runs, watcher/rescue.py) and the crash's (after it)
# share it, as a port is hosted only once.
_CLIENTS: dict[tuple[str, int], object] = {}


def link_address(job: dict) -> tuple[str, int]:
    """Where node 0's launcher hosts the launchers' store."""
    return job["master_addr"], int(os.environ.get("WATCHER_LINK_PORT") or int(job["master_port"]) + 1)


class LauncherLink:
    """This node's launcher, linked to the other nodes' under one prefix."""

    def __init__(self, job: dict, name: str, wait_s: float = LINK_WAIT_S):
        self.node, self.nodes = int(job["node"]), int(job["nodes"])
        self.wait_s = wait_s
        host, port = link_address(job)
        self.where = f"{host}:{port}"
        client = _CLIENTS.get((host, port))
        if client is None:
            try:
                client = dist.TCPStore(host, port, is_master=self.node == 0,
                                       timeout=timedelta(seconds=wait_s), wait_for_workers=False)
            except Exception as e:  # node 0 never came (or its port is taken)
                raise RecordingError(f"cannot link to the other nodes' launchers at {self.where}: {e}") from None
            _CLIENTS[(host, port)] = client
        self.client = client
        self.store = dist.PrefixStore(f"watcher-after/{job.get('run_id', 'job')}/{name}", client)

    def share(self, what: dict) -> None:
        self.store.set(f"found/{self.node}", json.dumps(what, default=str))

    def gather(self) -> dict[int, dict]:
        """Every node's share, by node; the nodes that did not share within
        the wait are missing from it."""
        keys = [f"found/{n}" for n in range(self.nodes)]
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.05)
        return {n: json.loads(self.store.get(k)) for n, k in enumerate(keys) if self.store.check([k])}

    def decide(self, decision: dict) -> None:
        self.store.set("decision", json.dumps(decision, default=str))

    def decision(self, wait_s: float) -> dict | None:
        got = self.wait_for("decision", wait_s)
        return None if got is None else json.loads(got)

    def wait_for(self, key: str, wait_s: float) -> bytes | None:
        """The key's value once some node set it; None after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return self.store.get(key)

    def close(self) -> None:
        """Say this node is finished; node 0 hosts the store, so it stays
        until every node has said so (or the wait is over)."""
        try:
            self.store.add("done", 1)
            deadline = time.monotonic() + self.wait_s
            while self.node == 0 and time.monotonic() < deadline and int(self.store.add("done", 0)) < self.nodes:
                time.sleep(0.05)
        except Exception:
            pass  # the host went first: nothing more to say to it
