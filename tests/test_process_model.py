"""Which recorded processes are ranks: a rank is a process that exec'd with
RANK in its environment; its forks that never exec (DataLoader workers,
Watcher's snapshots, and the replays forked from a snapshot) share that
environment but are not ranks.  Ground truth: the test's own process tree."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from watcher.process_model import ProcessModel


@pytest.fixture
def ranked_pid():
    """A live process whose environment holds RANK (every row below reads it)."""
    p = subprocess.Popen(["sleep", "60"], env=dict(os.environ, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4"))
    # Popen returns once exec closed its error pipe, which the kernel does
    # before it lays out the new environment: until then /proc/PID/environ
    # reads empty.  Wait for the environment the test gave it.
    deadline = time.monotonic() + 10
    while b"RANK=3\0" not in Path(f"/proc/{p.pid}/environ").read_bytes():
        assert time.monotonic() < deadline, "sleep's environment never appeared"
        time.sleep(0.01)
    yield p.pid
    p.kill()
    p.wait()


def test_forks_of_a_rank_and_forks_of_those_are_not_ranks(ranked_pid):
    me = ranked_pid
    m = ProcessModel()
    launcher = m.new_process(me, None, 1)
    launcher.execd = True
    rank = m.new_process(me, me, 2)
    rank.parent_upid, rank.execd = launcher.upid, True
    snapshot = m.new_process(me, me, 3)
    snapshot.parent_upid = rank.upid
    replay = m.new_process(me, me, 4)
    replay.parent_upid = snapshot.upid
    exec_child = m.new_process(me, me, 5)
    exec_child.parent_upid, exec_child.execd = snapshot.upid, True
    m.refresh_names()
    rows = [launcher, rank, snapshot, replay, exec_child]
    assert [r.rank for r in rows] == [3, 3, None, None, 3]
    assert [m.forked_from_rank(r) for r in rows] == [False, False, True, True, False]


def test_a_rank_split_from_its_supervisor_is_the_rank_even_if_it_ended_before_the_split_was_seen(ranked_pid):
    """Under `watcher run` the process the launcher started becomes a
    supervisor (runtime/supervisor.py) and its fork goes on as the rank.  On
    a busy machine a short job's rank may end before the collector reads the
    supervisor's new name: the fork is still the rank, the supervisor not."""
    me = ranked_pid
    m = ProcessModel()
    sup = m.new_process(me, None, 1)
    sup.execd, sup.name = True, "python"
    sup.rank, sup.local_rank, sup.world_size = 3, 1, 4  # as read at its exec
    rank = m.new_process(me, me, 2)
    rank.parent_upid, rank.name = sup.upid, "python"
    worker = m.new_process(me, me, 3)  # a DataLoader worker of the rank
    worker.parent_upid, worker.name = rank.upid, "python"
    snapshot = m.new_process(me, me, 4)
    snapshot.parent_upid, snapshot.name = rank.upid, "w-snap-3"
    for p in (rank, worker, snapshot):
        p.end_ts = 9
    assert not m.settle_rank(rank)  # ended, its parent not known as a supervisor yet
    sup.name = "w-supervisor"  # read at last (at its exit, or a later refresh)
    assert m.settle_rank(sup)
    assert [(p.rank, p.local_rank, p.world_size) for p in (sup, rank, worker, snapshot)] == \
        [(None, None, None), (3, 1, 4), (None, None, None), (None, None, None)]
