"""Many nodes: every node's control block kept a replica of the job's, through
the job's own c10d store.

Each node runs its own `watcher run` with its own run directory and its own
control block (control.py), a shared mmap the node's ranks read on the hot
path.  Across nodes they share nothing but the network, and the one
distributed mechanism every torchrun, Slurm or Kubernetes job already has:
the rendezvous store at MASTER_ADDR:MASTER_PORT (a c10d TCPStore).  Watcher
keeps its keys under a prefix of its own there:

    incident_seq, plan_seq, verdict_seq   the control block's header words, global
    incident/<seq>                        an incident as its rank opened it
    gone/<rank>, gone_n                   a rank that died, as its node's launcher saw it (rank_deaths.py)
    node/<n>                              node n's ranks' slots (arrived, wanted intervals, beacons)
    run/<path>                            run-directory documents (rundir.RunDir.put)
    x/<tag>/<rank>/...                    a replay's collective inputs (replay/relay.py)

The node's leader (local rank 0) runs a relay thread that publishes its
node's slots and copies the other nodes' into the local block every 20 ms
(unchanged ones skipped), so replica checks, interval agreement and arrival waits read
the mmap as on one node.  Opening an incident is a compare-and-set on
incident_seq.  The one hard guarantee, that no rank steps past the halt step,
comes from the leader reading the store at every step end (one round trip,
~55 us on loopback here) and the halt step being two steps after detection
on a multi-node job: the leader cannot finish step k+1 before the detecting
rank entered it (every step has a collective every rank joins), so it sees
the incident by then and publishes it to its node before step k+2, whose end
every local rank reaches only after that.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..rundir import write_json
from .control import GONE, HEADER, PACE_AT, RING, RING_AT, SLOT, Control

# The relay's period: replica checks tolerate a lag of several steps (they
# look back 7) and arrival waits are the cold path; every period costs the
# leader a few store round trips and the other nodes' slots copied in.
RELAY_EVERY_S = 0.02
WORDS = ("incident_seq", "plan_seq", "verdict_seq")
_QQ = struct.Struct("<qq")
_Q = struct.Struct("<q")


@dataclass
class NodeLayout:
    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int
    nodes: int
    master_addr: str
    master_port: int
    run_id: str

    @property
    def leader(self) -> bool:
        return self.local_rank == 0

    @classmethod
    def from_env(cls, env=os.environ) -> "NodeLayout | None":
        """The job's layout from the launcher's environment; None on one node."""
        try:
            world = int(env["WORLD_SIZE"])
            local_world = int(env.get("LOCAL_WORLD_SIZE", world))
            if local_world >= world or local_world < 1:
                return None
            rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", 0))
            # Ranks are laid out node by node (torchrun, Slurm, Kubernetes):
            # this node's are RANK - LOCAL_RANK onwards.
            return cls(rank=rank, world=world, local_rank=local_rank, local_world=local_world,
                       node=(rank - local_rank) // local_world, nodes=world // local_world,
                       master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                       run_id=env.get("TORCHELASTIC_RUN_ID", "job"))
        except (KeyError, ValueError):
            return None

    def node_of(self, rank: int) -> int:
        return rank // self.local_world

    def local_ranks(self) -> list[int]:
        return list(range(self.node * self.local_world, (self.node + 1) * self.local_world))


def connect(layout: NodeLayout, timeout_s: float = 60.0):
    """A client of the job's store of its own (the rank's c10d client serves
    the rank's threads; Watcher's traffic never queues behind it), under
    Watcher's prefix for this run."""
    client = dist.TCPStore(layout.master_addr, layout.master_port, is_master=False,
                           timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"watcher/{layout.run_id}", client)


class NodeLink:
    """This node's control block, linked to the job's."""

    def __init__(self, ctl: Control, layout: NodeLayout, store=None):
        self.ctl, self.layout = ctl, layout
        self.store = store if store is not None else connect(layout)
        for w in WORDS + ("gone_n",):
            self.store.add(w, 0)  # created at 0 by the first rank; a no-op after
        self.gone_seen = 0
        for n in range(layout.nodes):
            self.store.add(f"nodever/{n}", 0)  # so a leader never waits on a node that has not published
        self.relay_store = None
        self.stopped = threading.Event()
        self.errors = 0
        # The leader's main thread (sync at step end) and its relay both raise
        # the local words: one at a time, or a slower one could lower them.
        self._sync_lock = threading.Lock()

    # -- the hot path (leader only, at every step end) ---------------------------------------
    def sync(self) -> None:
        """Raise the local header words to the job's (one round trip), fetching
        a newly opened incident's file first so local ranks can read it."""
        self._sync_words(self.store)

    def _sync_words(self, store) -> None:
        with self._sync_lock:
            incident, plan, verdict, gone = (int(v) for v in store.multi_get(list(WORDS) + ["gone_n"]))
            if gone != self.gone_seen:
                self._adopt_gone(store)
                self.gone_seen = gone
            have = self.ctl.incident_seq
            for seq in range(have + 1, incident + 1):
                key = f"incident/{seq}"
                if not store.check([key]):  # claimed before the words move: never waited for
                    incident = seq - 1
                    break
                info = json.loads(store.get(key))
                info.pop("claim", None)
                write_json(self.ctl.incident_path(seq), info)
            self.ctl.mirror(incident=incident, plan=plan, verdict=verdict)

    def _adopt_gone(self, store) -> None:
        """Mark the ranks other nodes' launchers saw die: no rank here waits for them."""
        for r in range(self.layout.world):
            if not self.ctl.gone(r) and store.check([f"gone/{r}"]):
                self.ctl.mark_gone(r)

    # -- cold path ---------------------------------------------------------------------------
    def open_incident(self, info: dict) -> int | None:
        cur, verdict = (int(v) for v in self.store.multi_get(["incident_seq", "verdict_seq"]))
        if cur > verdict:
            return None  # one incident at a time, job-wide
        seq = cur + 1
        info = dict(info, seq=seq, incident_id=f"inc-{seq:04d}")
        # Claim the incident's key with a payload only this call has: the
        # compare-and-set answers with the key's value, which is ours only if
        # no other rank claimed it first.  The words move after the claim, so
        # whoever sees the new seq finds its info there.
        payload = json.dumps(dict(info, claim=uuid.uuid4().hex))
        if self.store.compare_set(f"incident/{seq}", "", payload).decode() != payload:
            return None  # another rank opened this one first
        self.store.compare_set("incident_seq", str(cur), str(seq))
        write_json(self.ctl.incident_path(seq), info)
        self.ctl.mirror(incident=seq)
        return seq

    def set_word(self, name: str, value: int) -> None:
        """plan_seq and verdict_seq, which only rank 0 moves, and only up."""
        self.store.set(name, str(value))

    # -- the relay (leader only) ---------------------------------------------------------------
    def start_relay(self) -> None:
        self.relay_store = connect(self.layout)
        self.relay_thread = threading.Thread(target=self._relay, name="watcher-node-relay", daemon=True)
        self.relay_thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """End the relay and wait for it: a thread still inside the store's C++
        when the interpreter finalizes aborts the rank (see RankRuntime.quiesce)."""
        self.stopped.set()
        t = getattr(self, "relay_thread", None)
        if t is not None:
            t.join(timeout)

    def _relay(self) -> None:
        # Each node's slots go with a version counter: a period reads the
        # others' counters (a few bytes each) and fetches only what changed.
        others = [n for n in range(self.layout.nodes) if n != self.layout.node]
        seen: dict[int, int] = {}
        mine = b""
        while not self.stopped.wait(RELAY_EVERY_S):
            try:
                blob = self._local_slots()
                if blob != mine:
                    self.relay_store.set(f"node/{self.layout.node}", blob)
                    self.relay_store.add(f"nodever/{self.layout.node}", 1)
                    mine = blob
                if others:
                    vers = self.relay_store.multi_get([f"nodever/{n}" for n in others])
                    for n, v in zip(others, vers):
                        if int(v) and seen.get(n) != int(v):  # a node whose ranks moved on
                            self._adopt_slots(self.relay_store.get(f"node/{n}"))
                            seen[n] = int(v)
                self._sync_words(self.relay_store)
            except Exception:
                self.errors += 1  # the store went away (the job is ending); keep trying quietly
                time.sleep(0.1)

    def _local_slots(self) -> bytes:
        """This node's slots; a ring entry caught mid-write (its rank writes
        step -1, the checksum, then the step) goes out as absent, never as an
        old step paired with a new checksum."""
        mm = self.ctl.mm
        out = bytearray()
        for r in self.layout.local_ranks():
            base = HEADER + r * SLOT
            slot = bytearray(mm[base: base + SLOT])
            for i in range(RING):
                off = RING_AT + i * 16
                step, value = _QQ.unpack_from(slot, off)
                if step < 0 or _Q.unpack_from(mm, base + off)[0] != step:
                    _QQ.pack_into(slot, off, -1, 0)
            out += _Q.pack(r) + slot
        return bytes(out)

    def _adopt_slots(self, blob: bytes) -> None:
        """Copy another node's slots in, each ring entry as a beacon is written
        (checksum first, step last), so a reader never pairs a step with a stale sum."""
        mm, at = self.ctl.mm, 0
        while at + 8 + SLOT <= len(blob):
            r = _Q.unpack_from(blob, at)[0]
            src = blob[at + 8: at + 8 + SLOT]
            base = HEADER + r * SLOT
            mm[base + 16: base + RING_AT] = src[16:RING_AT]  # wanted intervals
            mm[base + PACE_AT: base + SLOT] = src[PACE_AT:SLOT]  # pace (one reading; straggler.py)
            for i in range(RING):
                off = RING_AT + i * 16
                step, value = _QQ.unpack_from(src, off)
                if _QQ.unpack_from(mm, base + off) != (step, value):
                    _Q.pack_into(mm, base + off, -1)
                    _Q.pack_into(mm, base + off + 8, value)
                    _Q.pack_into(mm, base + off, step)
            seq, step = _QQ.unpack_from(src, 0)
            if _Q.unpack_from(mm, base)[0] != GONE:  # once gone, gone: a blob read before the death says otherwise
                _Q.pack_into(mm, base + 8, step)
                _Q.pack_into(mm, base, seq)
            at += 8 + SLOT
