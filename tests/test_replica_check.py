"""The SDC replica check over partial parameter checksums: each step's
checksum covers one of PARTS parts of the parameters, so ranks are taken
for replicas only once they agreed on every part, and a later disagreement
is an SDC incident at the step it shows."""

from types import SimpleNamespace

from watcher.analysis.detectors import Detectors
from watcher.runtime.checksum import PARTS
from watcher.runtime.rank import RankRuntime


def _rank(beacons: dict, world: int = 2, gone: tuple = ()) -> SimpleNamespace:
    """The state check_replicas reads: the ranks' beacons {(rank, step): sum}, and who failed open."""
    ctl = SimpleNamespace(beacon_at=lambda r, s: beacons.get((r, s)), gone=lambda r: r in gone)
    return SimpleNamespace(world=world, sdc_checked=-1, replicated=None, replica_votes=0, ctl=ctl,
                           detectors=Detectors())


def _check(rt, beacons: dict, steps: range) -> list:
    hits = []
    for k in steps:
        hit = RankRuntime.check_replicas(rt, k)
        if hit:
            hits.append(hit)
    return hits


def test_ranks_that_agree_on_a_part_but_not_on_all_are_not_replicas():
    # Ranks with different models that happen to share part 0 (step 0's part).
    beacons = {}
    for s in range(12):
        beacons[(0, s)] = 100 + s
        beacons[(1, s)] = 100 + s if s % PARTS == 0 else 900 + s
    rt = _rank(beacons)
    assert _check(rt, beacons, range(12)) == []
    assert rt.replicated is False


def test_replicas_that_drift_apart_raise_sdc_at_the_step_it_shows():
    beacons = {(r, s): 7 * s for r in (0, 1) for s in range(10)}
    beacons[(1, 6)] = 1  # rank 1's part for step 6 differs
    rt = _rank(beacons)
    hits = _check(rt, beacons, range(10))
    assert rt.replicated is True and rt.replica_votes == PARTS
    assert [(h["kind"], h["failing_step"]) for h in hits] == [("sdc", 6)]
    assert hits[0]["detail"]["param_sums"] == {0: 42, 1: 1}


def test_a_peer_not_yet_reported_leaves_the_step_for_later():
    beacons = {(0, s): s for s in range(6)}
    beacons.update({(1, s): s for s in range(3)})
    rt = _rank(beacons)
    assert _check(rt, beacons, range(6)) == []
    assert rt.sdc_checked == 2 and rt.replicated is None and rt.replica_votes == 3


def test_a_rank_that_failed_open_is_left_out_not_waited_for():
    # Rank 1's runtime failed open at step 3: it reports nothing more.  Ranks 0
    # and 2 go on being checked, and rank 2's drift at step 8 is still SDC.
    beacons = {(r, s): 7 * s for r in (0, 2) for s in range(10)}
    beacons.update({(1, s): 7 * s for s in range(3)})
    beacons[(2, 8)] = 5
    rt = _rank(beacons, world=3, gone=(1,))
    hits = _check(rt, beacons, range(10))
    assert rt.replicated is True
    assert [(h["kind"], h["failing_step"]) for h in hits] == [("sdc", 8)]
    assert hits[0]["detail"]["param_sums"] == {0: 56, 2: 5}
