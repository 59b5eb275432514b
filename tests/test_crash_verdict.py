"""The crash verdict's rules, on the documents they read: a crash is
persistent only when the replay dies the same death, and on many nodes every
node acts on one choice of crash and snapshot step."""

from __future__ import annotations

import signal

from watcher.crash import _decide
from watcher.replay.verdict import crash_replay_verdict

SEGV = {"exit_signal": int(signal.SIGSEGV), "exit_code": None, "how": "signal SIGSEGV"}
ERROR_EXIT = {"exit_signal": None, "exit_code": 1, "how": "exit code 1"}


def test_the_same_signal_again_is_a_repeat_and_another_signal_is_no_answer():
    again = crash_replay_verdict({"exit_code": -int(signal.SIGSEGV)}, {}, 8, SEGV)
    assert (again["crashed_again"], again["replay_signal"]) == (True, "SIGSEGV")
    # The sandbox's SIGSYS, or a SIGKILL from outside: not the rank's death.
    for other in (signal.SIGSYS, signal.SIGKILL):
        v = crash_replay_verdict({"exit_code": -int(other)}, {}, 8, SEGV)
        assert v["crashed_again"] is None and other.name in v["reason"]
    past = crash_replay_verdict({"exit_code": 0}, {"status": "done", "steps": {9: {}, 10: {}}}, 8, SEGV)
    assert (past["crashed_again"], past["replayed_steps"]) == (False, [9, 10])


def test_an_exception_repeats_an_error_exit_but_not_a_signal():
    raised = {"status": "exception", "steps": {}}
    assert crash_replay_verdict({"exit_code": 1}, raised, 8, ERROR_EXIT)["crashed_again"] is True
    assert crash_replay_verdict({"exit_code": 1}, raised, 8, SEGV)["crashed_again"] is None
    short = crash_replay_verdict({"exit_code": 0}, {"status": "out_of_record", "steps": {}}, 8, ERROR_EXIT)
    assert short["crashed_again"] is None and "out_of_record" in short["reason"]


def _death(rank, node, wall, sig=None, code=None, last=11):
    return {"rank": rank, "node": node, "died_wall": wall, "exit_signal": sig, "exit_code": code, "last_step": last}


def test_node_0_picks_the_signal_death_and_the_newest_snapshot_every_rank_has():
    found = {
        # Node 0's rank 1 failed on the dead rank's closed connection, a little later.
        0: {"crash": _death(1, 0, 100.2, code=1), "next_id": "inc-0002", "snaps": {"0": [4, 8], "1": [4, 8]}},
        1: {"crash": _death(3, 1, 100.0, sig=11), "next_id": "inc-0001", "snaps": {"2": [4, 8], "3": [4, 8, 12]}},
    }
    d = _decide(found, nodes=2, world=4)
    assert (d["crash"]["rank"], d["incident_id"], d["snap_step"]) == (3, "inc-0002", 8)
    assert "reason" not in d
    # The earliest among deaths of one kind.
    found[0]["crash"] = _death(1, 0, 99.0, sig=6)
    assert _decide(found, nodes=2, world=4)["crash"]["rank"] == 1


def test_no_replay_without_every_node_or_a_common_snapshot():
    one = {0: {"crash": _death(0, 0, 1.0, sig=11), "next_id": "inc-0001", "snaps": {"0": [4], "1": [4]}}}
    d = _decide(one, nodes=2, world=4)
    assert d["snap_step"] is None and "nodes [1]" in d["reason"]
    both = {**one, 1: {"crash": None, "next_id": "inc-0001", "snaps": {"2": [], "3": []}}}
    d = _decide(both, nodes=2, world=4)
    assert d["snap_step"] is None and "before every rank had a snapshot" in d["reason"]
    assert _decide({0: dict(one[0], crash=None)}, nodes=1, world=2) == {"crash": None}
