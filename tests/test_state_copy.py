"""State copies (replay/state_copy.py): what a copy holds must be everything a
training step changes.  Ground truth: train on from a copy's step, then load
the copy back and train the same steps again; the two results must be
bit-identical, scheduler, optimizer moments, BatchNorm statistics and RNG
included.  The forks the copies serve in `watcher run` are tested end to end
in test_recover.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from watcher.runtime.training import modules_holding
from watcher.replay.state_copy import CopyPolicy, CopyUnusable, StateCopies
from watcher.runtime.control import AGREE_EVERY
from watcher.runtime.rank import RankRuntime


def make_job(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    params = [p for g in opt.param_groups for p in g["params"]]
    rt = FakeRank(opt, modules_holding(params))
    return model, opt, sched, rt


class FakeRank:
    """What state copies read of a rank and ask of it (runtime/seam.py); the
    counters are the runtime's own methods."""

    counters = RankRuntime.counters
    restore_counters = RankRuntime.restore_counters

    def __init__(self, opt, modules):
        self.main_opt, self.modules, self.schedulers = opt, modules, None
        self.step, self.fetch_idx, self.groups = -1, 0, [types.SimpleNamespace(seq=0)]


def train(model, opt, sched, rt, n: int) -> None:
    for _ in range(n):
        x = torch.randn(32, 8)   # the global RNG: restored by the copy
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        rt.step += 1
        rt.fetch_idx += 1
        rt.groups[0].seq += 2


def state_of(model, opt, sched) -> list:
    out = [t.clone() for t in model.state_dict().values()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out + [torch.tensor(sched.last_epoch), torch.tensor(opt.param_groups[0]["lr"])]


def test_a_copy_restores_everything_a_step_changes():
    model, opt, sched, rt = make_job()
    train(model, opt, sched, rt, 3)
    copies = StateCopies(rt)
    assert copies.schedulers == [sched]
    assert copies.take(rt, rt.step)
    held = rt.step
    train(model, opt, sched, rt, 4)
    first = state_of(model, opt, sched)
    counters = (rt.step, rt.fetch_idx, rt.groups[0].seq)
    copies.load(rt, held)
    assert (rt.step, rt.fetch_idx, rt.groups[0].seq) == (2, 3, 6)
    assert sched.last_epoch == 3
    train(model, opt, sched, rt, 4)
    again = state_of(model, opt, sched)
    assert (rt.step, rt.fetch_idx, rt.groups[0].seq) == counters
    assert len(first) == len(again)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_two_slots_hold_the_two_newest_copies_and_the_older_is_gone():
    model, opt, sched, rt = make_job()
    train(model, opt, sched, rt, 1)
    copies = StateCopies(rt)
    for _ in range(3):
        train(model, opt, sched, rt, 1)
        assert copies.take(rt, rt.step)
    assert copies.held() == [2, 3]
    with pytest.raises(CopyUnusable, match="no state copy of step 1"):
        copies.load(rt, 1)
    copies.forget()
    assert copies.held() == []


def test_a_copy_into_other_tensors_is_refused():
    model, opt, sched, rt = make_job()
    train(model, opt, sched, rt, 1)
    copies = StateCopies(rt)
    assert copies.take(rt, 0)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})  # the other side holds more tensors
    with pytest.raises(CopyUnusable, match="other tensors"):
        copies.load(rt, 0)


def test_a_state_larger_than_the_slots_turns_copies_off_instead_of_overflowing():
    model, opt, sched, rt = make_job()
    train(model, opt, sched, rt, 1)
    copies = StateCopies(rt)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1 << 20))]})  # 4 MB more than the slots hold
    assert copies.take(rt, 1) is False
    assert "outgrew" in copies.off_reason
    assert copies.held() == []


def test_the_copy_interval_keeps_the_copies_within_their_budget():
    policy = CopyPolicy(0.005)
    rt = types.SimpleNamespace(step_ns=[20_000_000] * 8)           # 20 ms steps: 0.1 ms a step allowed
    copies = types.SimpleNamespace(cost_ns=[350_000, 380_000, 360_000], n_costs=3)  # 0.36 ms a copy
    assert [k for k in range(1, 17) if policy.due(k, rt, copies)] == [4, 8, 12, 16]
    assert policy.interval == 4


def test_ranks_agree_on_the_largest_interval_any_of_them_wants(tmp_path):
    # Two ranks on one node share the control block: a copy is only useful
    # when every rank holds one of the same step, so they copy at the same steps.
    from watcher.runtime.control import Control

    a, b = Control(tmp_path), Control(tmp_path)
    assert a.agree_interval(0, 2, 4) == 4
    assert b.agree_interval(1, 2, 8) == 8
    assert a.agree_interval(0, 2, 4) == 8
    assert b.agree_interval(1, 2, 2) == 4   # rank 1's cost fell: both go back to rank 0's 4
    a.beacon(0, 5, 123)
    assert b.beacon_at(0, 5) == 123 and b.arrived(1) == (0, -1)


def test_ranks_fork_at_the_interval_the_costliest_rank_wants(tmp_path):
    # Each rank measures its own fork cost; snapshots help only at steps every
    # rank forked, so the fork interval is agreed like the copy interval.
    from watcher.replay.snapshot import SnapshotPolicy
    from watcher.runtime.control import Control

    ranks = []
    for r, fork_ms in ((0, 10), (1, 30)):
        policy = SnapshotPolicy(0.01)
        policy.fork_ns = [fork_ms * 1_000_000]
        rt = types.SimpleNamespace(ctl=Control(tmp_path), rank=r, world=2, step_ns=[20_000_000] * 8)
        ranks.append((policy, rt))
    for policy, rt in ranks:  # each took a snapshot at step 1: at step 2 it learns its cost
        policy.last_snap = 1
        policy.due(2, rt)
    assert [p.want for p, _ in ranks] == [64, 256]  # 10 and 30 ms against 0.2 ms a step allowed
    ranks[0][0].due(AGREE_EVERY, ranks[0][1])  # rank 0 reads rank 1's wish at its next agreement step
    assert [p.interval for p, _ in ranks] == [256, 256]
