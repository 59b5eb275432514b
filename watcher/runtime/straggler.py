"""Stragglers: a rank persistently slower than its peers, reported with its ratio.

In a synchronous job every rank's step takes as long as the slowest rank's,
so step times cannot tell who is slow.  What differs is where the time goes:
the straggler computes while its peers wait for it inside collectives.  So
each rank measures its own time per step, the step minus the time it spent
inside collectives (the union of their issue-to-completion intervals, on its
own clock: no clock is compared across ranks or nodes), and every W/2 steps
publishes its median over the last W steps in its control slot (control.py;
relayed to other nodes with the slots, nodes.py).  A rank whose median is
F times its peers' median, and D ms more, at two checks in a row, reports
itself: a `straggler` incident, closed as it opens (nothing halts), with the
ratio.  Once reported it is reported again only after it has caught up.
"""

from __future__ import annotations

import sys
import time

from ..incident import Incident, save_incident


def own_time_ns(step_ns: int, colls: list[dict]) -> int:
    """The step's time outside collectives: `step_ns` minus the union of the
    collectives' [issue, issue + duration] intervals."""
    spans = sorted((c["ts"], c["ts"] + c["dur"]) for c in colls if c.get("ts") and c.get("dur") is not None)
    inside, end = 0, None
    for a, b in spans:
        if end is None or a > end:
            inside += b - a
            end = b
        elif b > end:
            inside += b - end
            end = b
    return max(step_ns - inside, 0)


class StragglerWatch:
    """One rank's straggler checks (its training thread calls `step_ended`)."""

    def __init__(self, rt):
        self.rt = rt
        self.own: list[int] = []
        self.hits = 0
        self.reported = False

    def step_ended(self, step: int, step_ns: int | None, colls: list[dict]) -> None:
        rt, det = self.rt, self.rt.detectors
        if not det.straggler or step_ns is None or rt.world < 2:
            return
        self.own.append(own_time_ns(step_ns, colls))
        w = max(det.straggler_window, 4)
        if len(self.own) > w:
            del self.own[0]
        if step % (w // 2) or len(self.own) < w:
            return
        mine = sorted(self.own)[len(self.own) // 2]
        rt.ctl.set_pace(rt.rank, step, mine)
        peers = [p for r in range(rt.world) if r != rt.rank
                 for p in [rt.ctl.pace(r)] if p is not None and abs(p[0] - step) <= w]
        if not peers:
            return
        peer = sorted(v for _, v in peers)[len(peers) // 2]
        slow = mine >= det.straggler_factor * max(peer, 1) and (mine - peer) / 1e6 >= det.straggler_min_ms
        if not slow:
            self.hits, self.reported = 0, False  # caught up: a later slowdown is reported anew
            return
        self.hits += 1
        if self.hits >= 2 and not self.reported:
            self.reported = True
            self._report(step, mine, peer, len(peers), w)

    def _report(self, step: int, mine: int, peer: int, n_peers: int, window: int) -> None:
        rt = self.rt
        ratio = round(mine / max(peer, 1), 2)
        detail = {"ratio": ratio, "own_ms": round(mine / 1e6, 2), "peers_own_ms": round(peer / 1e6, 2),
                  "peers": n_peers, "window_steps": window, "slower_by_ms": round((mine - peer) / 1e6, 2),
                  "measure": "median over the window of the step's time outside collectives"}
        now = time.monotonic_ns()
        seq = rt.ctl.open_incident({"kind": "straggler", "rank": rt.rank, "failing_step": step, "halt_step": None,
                                    "resolved": True, "detected_ts": now, "detected_unix": time.time()})
        if seq is None:
            self.reported = False  # another incident is open: try again at the next check
            return
        iid = f"inc-{seq:04d}"
        doc = Incident.opened(iid, "straggler", step, rt.rank, now, detail, None, None)
        doc.replay = {"reproduced": None, "first_divergence": None,
                      "reason": "a straggler is reported, not replayed: the job was not halted"}
        save_incident(rt.rundir, doc)
        rt.ctl.verdict_seq = max(rt.ctl.verdict_seq, seq)  # closed as it opens: the next incident may open
        print(f"watcher: {iid}: rank {rt.rank} is a straggler at step {step}: {detail['own_ms']} ms of its own per "
              f"step against its peers' {detail['peers_own_ms']} ms ({ratio}x), over the last {window} steps",
              file=sys.stderr, flush=True)
