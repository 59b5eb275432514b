"""The rescue across nodes: every node's `watcher run` replaces its own ranks,
on one decision.

Each node's launcher side (watcher/rescue.py) sees only its own ranks: their
death reports, their snapshots, their processes.  A rank that dies on one
node takes every rank of the job with it (they all resume from one step), so
the nodes' launchers agree through the store the launchers share: node 0's
`watcher run` hosts it (launcher_link.py, the same way torchrun's agent hosts
the job's), from the moment the job's ranks say it spans nodes, and the
other nodes' connect.  Under the prefix `watcher-after/<run_id>/rescue`:

    calls               how many rescues were called (a counter: the call's number is its attempt)
    call/<a>            the death that node D's launcher calls rescue `a` for (D decides it)
    held/<a>/<n>        the snapshot steps node n's ranks hold ({rank: [steps]}; null: it cannot take part)
    decision/<a>        from which step every rank resumes, and where they meet; or why the death is let go
    done/<a>/<n>        whether node n's ranks all resumed
    docs, doc/<k>       the rescue's incident documents, in the order the decider wrote them: every
                        node's run directory holds the same incident

Calls are answered in their order: a node that calls a rescue first answers
every earlier call (which may already cover its own death: every rank of the
job is replaced), so two deaths on two nodes at once never wait on each
other.  The resumed ranks rebuild their transports on this store too (it
outlives every rank; the job's own may not, under some launchers).
"""

from __future__ import annotations

import json
import threading
import time

from .errors import RecordingError
from .launcher_link import LauncherLink, link_address

CONNECT_RETRY_S = 1.0


class AcrossNodes:
    def __init__(self, job: dict):
        self.job = job
        self.node, self.nodes = int(job["node"]), int(job["nodes"])
        self.link: LauncherLink | None = None
        self.error: str | None = None
        self.answered = 0    # calls this node has answered or made
        self.docs_seen = 0
        self.stopped = threading.Event()
        # Connecting waits for node 0's launcher: never on the deaths watch's thread.
        threading.Thread(target=self._connect, name="watcher-rescue-link", daemon=True).start()

    def _connect(self) -> None:
        while not self.stopped.is_set():
            try:
                link = LauncherLink(self.job, "rescue")
                link.store.add("calls", 0)
                link.store.add("docs", 0)
                self.link, self.error = link, None
                return
            except (RecordingError, RuntimeError) as e:
                self.error = str(e)
                self.stopped.wait(CONNECT_RETRY_S)

    def stop(self) -> None:
        self.stopped.set()

    @property
    def store(self):
        return self.link.store

    @property
    def address(self) -> tuple[str, int]:
        return link_address(self.job)

    # -- calls ---------------------------------------------------------------------------------
    def new_call(self) -> int:
        return int(self.store.add("calls", 1))

    def call(self, a: int, death: dict) -> None:
        self.store.set(f"call/{a}", json.dumps(dict(death, node=self.node)))

    def unanswered(self, below: int | None = None) -> list[tuple[int, dict | None]]:
        """Other nodes' calls this node has not answered yet, in order (below
        `below` when given); a call whose number is taken but not yet written
        is waited for briefly."""
        last = int(self.store.add("calls", 0)) if below is None else below - 1
        out = []
        while self.answered < last:
            a = self.answered + 1
            call = self._json(f"call/{a}", 5.0)
            self.answered = a
            if call is None or call.get("node") != self.node:
                out.append((a, call))
        return out

    def share_held(self, a: int, held: dict | None) -> None:
        self.store.set(f"held/{a}/{self.node}", json.dumps(held))

    def gather_held(self, a: int, wait_s: float) -> dict[int, dict | None]:
        """Every node's held snapshot steps, by node; a node that did not say within the wait is missing."""
        keys = [f"held/{a}/{n}" for n in range(self.nodes)]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.02)
        return {n: json.loads(self.store.get(k)) for n, k in enumerate(keys) if self.store.check([k])}

    def decide(self, a: int, decision: dict) -> None:
        self.store.set(f"decision/{a}", json.dumps(decision))

    def decision(self, a: int, wait_s: float) -> dict | None:
        return self._json(f"decision/{a}", wait_s)

    def done(self, a: int, ok: bool) -> None:
        self.store.set(f"done/{a}/{self.node}", "1" if ok else "0")

    def all_done(self, a: int, wait_s: float) -> bool:
        keys = [f"done/{a}/{n}" for n in range(self.nodes) if n != self.node]
        deadline = time.monotonic() + wait_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return all(self.store.get(k) == b"1" for k in keys)

    # -- incident documents ----------------------------------------------------------------------
    def share_doc(self, doc: dict) -> None:
        k = int(self.store.add("docs", 1))
        self.store.set(f"doc/{k}", json.dumps({"node": self.node, "doc": doc}, default=str))

    def new_docs(self, wait_s: float = 2.0) -> list[dict]:
        """Documents other nodes shared since the last look."""
        last, out = int(self.store.add("docs", 0)), []
        while self.docs_seen < last:
            got = self._json(f"doc/{self.docs_seen + 1}", wait_s)
            if got is None:
                break  # its writer is between the count and the text: next look
            self.docs_seen += 1
            if got["node"] != self.node:  # this node wrote its own
                out.append(got["doc"])
        return out

    def _json(self, key: str, wait_s: float):
        deadline = time.monotonic() + wait_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return json.loads(self.store.get(key))
