"""Recovering a collective whose transport failed, without a restart (Track A).

When a gloo collective fails (a peer's connection reset or closed, a
transient network fault, or an abort by the per-operation timeout of a
collective stuck on a link that lost its traffic, transport.py) the wrapped
group's transport is dead for good, and without Watcher the job crashes.  Under `--policy recover` every member of
the group, on seeing the same collective fail:

1. checks that the failed operation left its inputs as they were issued (the
   input checksum taken at issue; a reduction interrupted midway is restored
   from the copy taken at issue) and tells the others, through the job's own
   c10d store;
2. if every member's inputs are intact, builds a fresh gloo transport for the
   group on that store (a new key prefix per failed collective, so every
   member meets in the same place), puts it under the same wrapper, and
   issues the collective again there;
3. hands the result to whoever waits on the original work (DDP's reducer,
   the user's wait()), which never sees the failure.

The rebuild takes a few milliseconds here.  If any member's inputs were
modified, or a member never joins, the original error goes to the training
code as it would have, and the incident says why.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch.distributed as dist

from ..incident import Incident, save_incident
from ..rundir import read_json
from . import supervisor, transport
from .checksum import tensors_sum

JOIN_TIMEOUT_S = 60.0
DEATH_REPORT_WAIT_S = 5.0  # for a dead member's supervisor to report it (it does as it reaps it)


def can_relink(rt, group) -> bool:
    return rt.mode == "live" and rt.policy in ("recover", "apply") and not rt.disabled and _is_gloo(group)


def _is_gloo(group) -> bool:
    if group.gloo is None:  # asked once per group, not per collective
        try:
            group.gloo = "gloo" in str(group.inner.name()).lower()
        except Exception:
            group.gloo = False
    return group.gloo


def relink(rt, group, op: str, args: tuple, meta: dict, ins: list, error: BaseException, saved: list | None = None):
    """Rebuild `group`'s transport and run the collective again; returns the
    retried work's result.  Raises `error` when it cannot.  `saved` is a copy
    of the inputs as issued, for a reduction the failure interrupted midway."""
    t0 = time.monotonic_ns()
    store = rt.job_store()
    prefix = f"watcher/relink/{group.gid}/{meta['seq']}/"
    me, size = group.inner.rank(), group.inner.size()
    intact = tensors_sum(ins) == meta["in_sum"]
    if not intact and saved is not None and tensors_sum(saved) == meta["in_sum"]:
        for t, s in zip(ins, saved):
            t.copy_(s)
        meta["inputs_restored"] = True
        intact = tensors_sum(ins) == meta["in_sum"]
    store.set(f"{prefix}intact/{me}", "1" if intact else "0")
    keys = [f"{prefix}intact/{r}" for r in range(size)]
    why, died = _await_members(rt, store, keys, group.ranks)
    if died:
        _wait_for_rescue(rt, group.ranks)  # returns only if the death is let go
    if why is None and not all(store.get(k) == b"1" for k in keys):
        why = "the failed operation modified a member's inputs: the collective cannot be retried"
    if why is None:
        before = transport.socket_inodes()
        new = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), me, size,
                                    datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        group.sockets = transport.opened_since(before)
        group.replace_inner(new)
        work = getattr(new, op)(*args)
        work.wait()
        result = work.result() if hasattr(work, "result") else None
    if me == 0 and not died:  # a dead member's collective is part of its crash incident (watcher/crash.py)
        _record(rt, group, meta, error, why, t0)
    if why is not None:
        raise error
    return result


def _await_members(rt, store, keys: list[str], ranks: list[int]) -> tuple[str | None, bool]:
    """Wait for every member's word; why not, if one never comes, and whether
    that is because a member died.  A member
    that died (its launcher marks it gone, watcher/rank_deaths.py) is not
    waited for: the failure was its death, and no rebuild can bring it back."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not store.check(keys):
            dead = [g for g in ranks if rt.ctl.gone(g)]
            if dead:
                return f"rank {dead[0]} died: the group cannot be rebuilt without it", True
            if time.monotonic() > deadline:
                return f"not every member of the group joined the rebuild within {JOIN_TIMEOUT_S:g} s", False
            time.sleep(0.02)
    except Exception as e:
        # The store itself may be gone with the launcher, tearing the job down
        # after a member's death: that death is still the failure.
        dead = [g for g in ranks if rt.ctl.gone(g)]
        if dead:
            return f"rank {dead[0]} died: the group cannot be rebuilt without it", True
        return f"not every member of the group joined the rebuild: {e}", False
    return None, False


def _wait_for_rescue(rt, ranks: list[int]) -> None:
    """Under a rescued `watcher run` a member's death may be undone: every rank
    of the job is then replaced from its snapshot (watcher/rescue.py), this
    process included, which the launcher side ends.  Wait for that; return
    if the launcher lets the death go (the failure then reaches training)."""
    if not os.environ.get(supervisor.PID_ENV):
        return
    # A peer on another node: its death report is in its node's run
    # directory, not here; its node's launcher kills this process when it
    # replaces the job's ranks, or says in the job's store that it will not.
    start = time.monotonic()
    deadline = start + supervisor.FATE_WAIT_S + supervisor.REPLACE_WAIT_S
    while time.monotonic() < deadline:
        if rt.link is not None and _let_go_across(rt):
            return
        for g in ranks:
            if not rt.ctl.gone(g):
                continue
            try:
                pid = read_json(rt.rundir.rank_process(g))["pid"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not rt.rundir.rescue_death(g, pid).exists():
                # Its supervisor reports a death as it reaps it, before the
                # launcher marks it gone: none means it ended well (a clean
                # stop, exit 75): nothing will replace it.
                if time.monotonic() - start > DEATH_REPORT_WAIT_S:
                    return
                continue
            try:
                if read_json(rt.rundir.rescue_fate(g, pid)).get("fate") != "replace":
                    return
            except (OSError, ValueError, KeyError, TypeError):
                pass  # no word yet
        time.sleep(0.05)


def _let_go_across(rt) -> bool:
    """On many nodes a dead peer's launcher says so in the job's store when it
    lets the death go (watcher/rescue.py): nothing will replace it."""
    try:
        return rt.link.store.check(["rescue/let_go"])
    except Exception:
        return True  # the job's store is gone: so is the job


def _record(rt, group, meta: dict, error: BaseException, why: str | None, t0: int) -> None:
    """The incident, written at once: nothing to halt or replay (the inputs
    were verified), so the ranks never stop."""
    seq = rt.ctl.open_incident({"kind": "collective_error", "rank": rt.rank, "failing_step": meta["step"],
                                "halt_step": None, "resolved": True, "detected_ts": t0})
    if seq is None:
        return  # another incident is being handled; this one is in the rank's stderr
    iid = f"inc-{seq:04d}"
    coll = {"group": group.gid, "seq": meta["seq"], "op": meta["op"]}
    detail = {"error": str(error).splitlines()[0][:300], "collective": coll}
    if meta.get("stalled_s") is not None:  # aborted by the per-operation timeout
        detail["stalled_s"] = meta["stalled_s"]
        detail["error"] = (f"no progress for {meta['stalled_s']:g} s with every member inside it "
                           f"(collective_timeout); transport aborted: {detail['error']}")
    doc = Incident.opened(iid, "collective_error", meta["step"], rt.rank, t0, detail, None, None)
    ok = why is None
    # Transient only when the retry worked: a collective that failed because
    # a member died is that death's consequence, judged by its crash incident.
    doc.update(classification="transient" if ok else None, track="A" if ok else None,
               transient_cause="communication" if ok else None, recovered=ok,
               resumed_at_step=meta["step"] if ok else None, steps_lost=0 if ok else None,
               recovery={"method": "rebuilt the group's gloo transport and issued the collective again",
                         "collective": coll, "reason": why,
                         "detect_to_resume_s": round((time.monotonic_ns() - t0) / 1e9, 4)})
    save_incident(rt.rundir, doc)
    rt.ctl.verdict_seq = max(rt.ctl.verdict_seq, seq)
    print(f"watcher: incident {iid}: {meta['op']} #{meta['seq']} at step {meta['step']} failed "
              f"({doc.detail['error'][:80]}); " + ("transport rebuilt, collective retried, training goes on"
                                                     if ok else f"not recovered: {why}"),
              file=sys.stderr, flush=True)
