"""A coordinated replay across nodes: the replayed collective inputs relayed
through the job's store.

The replay children of one round trade their inputs through files in an
exchange directory (exchange.py), which is per node (tmpfs).  The children
are sandboxed and may not open a socket, so on a multi-node job the live
ranks, halted meanwhile, carry the bytes: each rank appends its own child's
exchange file to the store as it grows, in chunks (x/<tag>/<rank>/<i>, with
the count in x/<tag>/<rank>/n), and copies the chunks of the other nodes'
ranks it is assigned into local files under their names, where the local
children read them as if their peers were next door.  Every remote rank is
copied in by exactly one local rank; the relay of a remote rank ends with the
"end" record its snapshot writes when its replay is over.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from .exchange import exchange_path

CHUNK = 4 << 20
POLL_S = 0.002


class ExchangeRelay:
    def __init__(self, store, tag: str, directory: Path, rank: int, pulls: list[int]):
        self.store, self.tag, self.dir, self.rank = store, f"x/{tag}", Path(directory), rank
        self.pulls = pulls                    # remote ranks this rank copies in
        self.sent = 0                         # bytes of our own file published
        self.pushed = 0                       # chunks published
        self.got = {r: 0 for r in pulls}      # chunks copied in, per remote rank
        self.done_pull = {r: False for r in pulls}
        self.own_done = threading.Event()     # our replay is over: publish the rest, then stop pushing
        self.stop = threading.Event()
        self.bytes_relayed = 0
        self._ended = False
        self.thread = threading.Thread(target=self._run, name="watcher-exchange-relay", daemon=True)

    def start(self) -> "ExchangeRelay":
        self.thread.start()
        return self

    def finish(self, timeout: float) -> None:
        """Our replay ended: publish what is left, and keep copying the
        remote ranks in until they ended too (local peers may still need them)."""
        self.own_done.set()
        self.thread.join(timeout)
        self.stop.set()
        if not self._ended:  # whatever happened, the pullers of our stream must not wait for more
            try:
                self.store.set(f"{self.tag}/{self.rank}/end", "1")
                self._ended = True
            except Exception:
                pass

    def keys(self) -> list[str]:
        """Every key this rank's stream used in the store."""
        base = f"{self.tag}/{self.rank}"
        return [f"{base}/{i}" for i in range(self.pushed)] + [f"{base}/n", f"{base}/end"]

    def _run(self) -> None:
        errors = 0
        while not self.stop.is_set():
            try:
                moved = self._push(final=self.own_done.is_set())
                moved |= self._pull()
            except Exception:  # a file gone, the store busy: try again, a few times
                errors += 1
                if errors > 50:
                    return
                time.sleep(0.05)
                continue
            if self.own_done.is_set() and all(self.done_pull.values()) and not moved:
                self._push(final=True)
                return
            if not moved:
                time.sleep(POLL_S)

    def _push(self, final: bool) -> bool:
        path = exchange_path(self.dir, self.rank)
        try:
            size = os.path.getsize(path)
        except OSError:
            return False
        if size <= self.sent:
            if final and not self._ended:
                self.store.set(f"{self.tag}/{self.rank}/end", "1")
                self._ended = True
            return False
        with open(path, "rb") as f:
            f.seek(self.sent)
            data = f.read(min(size - self.sent, CHUNK))
        self.store.set(f"{self.tag}/{self.rank}/{self.pushed}", data)
        self.pushed += 1
        self.sent += len(data)
        self.store.set(f"{self.tag}/{self.rank}/n", str(self.pushed))
        self.bytes_relayed += len(data)
        return True

    def _pull(self) -> bool:
        moved = False
        for r in self.pulls:
            if self.done_pull[r]:
                continue
            key = f"{self.tag}/{r}/n"
            n = int(self.store.get(key)) if self.store.check([key]) else 0
            ended = self.store.check([f"{self.tag}/{r}/end"])
            if self.got[r] < n:
                with open(exchange_path(self.dir, r), "ab") as f:
                    while self.got[r] < n:
                        data = self.store.get(f"{self.tag}/{r}/{self.got[r]}")
                        f.write(data)
                        self.got[r] += 1
                        self.bytes_relayed += len(data)
                moved = True
            elif ended:
                # The end flag is set after the last chunk's count: read the count again.
                last = int(self.store.get(key)) if self.store.check([key]) else 0
                if last == self.got[r]:
                    self.done_pull[r] = True
        return moved


def assigned_pulls(local_ranks: list[int], world: int, me: int) -> list[int]:
    """The remote ranks this local rank copies in: one local rank each."""
    remote = [r for r in range(world) if r not in local_ranks]
    i = local_ranks.index(me)
    return [r for j, r in enumerate(remote) if j % len(local_ranks) == i]
