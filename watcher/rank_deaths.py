"""The launcher's watch over its node's ranks: a rank that dies is marked gone
for the whole job within a tenth of a second.

A rank killed by a signal writes nothing on its way out, so its peers would
wait for it wherever they meet it next: at an incident's halt, or rebuilding
a failed collective's transport (runtime/relink.py), up to that wait's
timeout.  `watcher run` outlives its ranks, so it tells them: each rank
names its process in DIR/runtime/rank<r>.process.json, and once that process
is gone (or a zombie) the launcher marks the rank gone in the node's control
block and, on a multi-node job, in the job's store (gone/<rank>, then
gone_n raised), where every other node's link adopts it (runtime/nodes.py).
A rank that ended normally is marked too: nothing should wait for it either.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from .launcher_link import multi_node
from .rescue import Rescuer
from .rundir import RunDir, read_json
from .runtime.control import Control, process_state

EVERY_S = 0.1


class RankDeaths:
    def __init__(self, run_dir: RunDir, ctl: Control, rescue: bool = False):
        self.run_dir, self.ctl = run_dir, ctl
        # The rescue (on unless --no-rescue): deaths the ranks' supervisors report are answered here (rescue.py).
        self.rescuer = Rescuer(run_dir, ctl, job_store=self._job_store) if rescue else None
        self.known: dict[int, tuple[int, int]] = {}   # rank -> (pid, start ticks)
        self.gone: list[int] = []
        self.store = None
        self.store_failed = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="watcher-rank-deaths", daemon=True)

    def start(self) -> "RankDeaths":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        if self.rescuer is not None:
            self.rescuer.finish()

    def _loop(self) -> None:
        while not self.stopped.wait(EVERY_S):
            try:
                self.check()
            except Exception:
                pass  # the watch is a courtesy to the ranks; the job never depends on it

    def check(self) -> list[int]:
        """Mark the ranks that died since the last look; returns them."""
        if self.rescuer is not None and self.rescuer.poll(self.known):
            # Every rank is a new process now, none of them gone.
            self.known, self.gone = {}, []
        for rank, path in self.run_dir.rank_process_files():
            if rank not in self.known:
                try:
                    p = read_json(path)
                    self.known[rank] = (int(p["pid"]), p.get("start_ticks"))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
        died = []
        for rank, (pid, start) in self.known.items():
            if rank in self.gone:
                continue
            state = process_state(pid)
            if state is None or state[0] in "ZX" or (start is not None and state[1] != start):
                self.ctl.mark_gone(rank)
                self.gone.append(rank)
                died.append(rank)
        if died:
            self._tell_the_job(died)
        return died

    def _tell_the_job(self, ranks: list[int]) -> None:
        store = self._job_store()
        if store is None:
            return
        for r in ranks:
            store.set(f"gone/{r}", "1")
        store.add("gone_n", len(ranks))

    def _job_store(self):
        """The job's store, under Watcher's prefix (runtime/nodes.py), on a multi-node job only."""
        if self.store is not None or self.store_failed:
            return self.store
        try:
            job = read_json(self.run_dir.job)
        except (OSError, ValueError):
            return None  # not written yet
        if not multi_node(job):
            self.store_failed = True
            return None
        try:
            client = dist.TCPStore(job["master_addr"], int(job["master_port"]), is_master=False,
                                   timeout=timedelta(seconds=5), wait_for_workers=False)
            self.store = dist.PrefixStore(f"watcher/{job['run_id']}", client)
        except Exception:
            self.store_failed = True  # the job's store is gone: the job is over
        return self.store
