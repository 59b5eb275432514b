"""The device health ledger (watcher/health.py): failures pinned on a device
count across runs on a node, and a device that keeps failing is quarantined
even though each failure alone replayed clean.

The bad core is the workload's own (tests/workloads/flaky_core.py: rank 1
pinned to one core, whose gradient gets a flipped exponent bit at given
steps while it runs there, once per step, so each replay is clean); Watcher
is told nothing about it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from watcher import health

from .conftest import ROOT, needs_bpf, query, watcher
from .test_run import plain

FLAKY = str(ROOT / "tests" / "workloads" / "flaky_core.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", FLAKY]
HOST = os.uname().nodename
BAD = max(os.sched_getaffinity(0))  # the flaky core; the others stay healthy


def test_ledger_rules_repeat_breaker_and_gate(tmp_path):
    node = tmp_path / "node"
    ledger = health.Ledger(tmp_path, node)
    dev = health.cpu_device(BAD, HOST)
    for i, run in enumerate(("r1", "r2")):
        assert health.repeat_verdict(ledger, dev, f"inc-000{i + 1}", run) is None
        ledger.add({"kind": "failure", "device": dev, "rank": 1, "step": 5, "run": run, "incident_id": "inc-0001"})
    # The same incident id in another run is another failure; in this run it is this one.
    again = health.repeat_verdict(ledger, dev, "inc-0001", "r3")
    assert [(f["run"], f["incident_id"]) for f in again["failures"]] == [("r1", "inc-0001"), ("r2", "inc-0001"),
                                                                        ("r3", "inc-0001")]
    assert again["reason"].startswith(f"3 failures on {dev} within 7 days (in 2 run(s))")
    assert health.repeat_verdict(ledger, dev, "inc-0001", "r2") is None
    p = health.quarantine_prescription(ledger, dev, 1)
    others = sorted(os.sched_getaffinity(0) - {BAD})
    assert (p["action"], p["device"]["cpus"], p["move_to"]) == ("quarantine_device", [BAD], {"cpus": others})
    assert ledger.quarantine(dev, "test", "inc-0001", "r3") == {"quarantined": True}
    assert ledger.quarantined() == [dev]
    # The breaker: at most a quarter of the node's cores (at least one) out of use.
    cap = max(1, len(os.sched_getaffinity(0)) // 4)
    for c in sorted(os.sched_getaffinity(0) - {BAD})[:cap - 1]:
        assert ledger.quarantine(health.cpu_device(c, HOST), "test", "inc-9", "r9")["quarantined"]
    other = health.cpu_device(min(os.sched_getaffinity(0)) if cap == 1 else sorted(os.sched_getaffinity(0))[cap],
                              HOST)
    refused = health.quarantine_prescription(ledger, other, 0)
    assert (refused["action"], refused["node_unusable"]) == ("none", True)
    assert ledger.quarantine(other, "test", "inc-0002", "r3")["quarantined"] is False
    assert json.loads((node / "unusable.json").read_text())["device"] == other
    # The gate a launch hook calls: exit 8 while the node is unusable; clear it once repaired.
    g = watcher("health", "--health-dir", str(node), "--gate")
    assert g.returncode == 8 and "node unusable: breaker:" in g.stderr
    assert f"{dev}" in g.stdout and "QUARANTINED" in g.stdout
    c = watcher("health", "--health-dir", str(node), "--clear", "all", "--gate")
    assert c.returncode == 0, c.stderr
    assert json.loads((node / "quarantined.json").read_text()) == []
    # Bad input: one line, nonzero.
    assert watcher("health").returncode == 2
    assert watcher("health", str(tmp_path / "nope")).returncode == 6


@needs_bpf
def test_nvml_absent_is_one_clear_line():
    p = watcher("check")
    line = next(x for x in p.stdout.splitlines() if " gpus " in x)
    assert "NVML not available" in line and "[warn]" in line  # a fact on a CPU machine, not a failure


def test_xid_events_are_failures_of_their_gpu_when_critical(tmp_path):
    """No GPU here: the listener says so and starts nothing (NVML absent is a
    fact); what it hands the ledger is checked as the driver would raise it
    (the NVML event path runs in scripts/gpu_check on a GPU machine)."""
    xids = health.XidListener(lambda x: None).start()
    assert (xids.state, xids.thread) == ("NVML not available", None)
    xids.stop()
    ledger = health.Ledger(tmp_path, tmp_path / "node")
    for x in (79, 13, 48):  # fell off the bus; a graphics engine exception (an application's); a DBE
        ledger.add(health.xid_event("r1", {"xid": x, "uuid": "GPU-abc"}))
    assert [f["detail"]["xid"] for f in ledger.failures("gpu-GPU-abc")] == [79, 48]
    assert [e["kind"] for e in ledger.events()] == ["failure", "signal", "failure"]


def _run(tmp: Path, name: str, *args: str, policy: str = "apply") -> tuple:
    (tmp / f"m-{name}").mkdir()
    out = tmp / name
    p = watcher("run", "--out", str(out), "--policy", policy, "--snapshot-interval", "4", "--copy-interval", "0",
                "--audit-budget", "0", "--health-dir", str(tmp / "node"), "--",
                *TORCHRUN, "--markers", str(tmp / f"m-{name}"), "--save", str(tmp / f"{name}.sha"), *args,
                timeout=600)
    incs = [json.loads(x.read_text()) for x in sorted((out / "incidents").glob("inc-*.json"))]
    return p, out, incs


@needs_bpf
def test_a_core_that_keeps_failing_is_quarantined_across_runs(tmp_path):
    plain(TORCHRUN + ["--save", str(tmp_path / "plain.sha")], tmp_path)
    truth = (tmp_path / "plain.sha").read_text()
    dev = health.cpu_device(BAD, HOST)
    flaky = ("--core", str(BAD), "--flip-steps", "6,14")

    # Run 1: two failures on the core, each replayed clean: transient, recovered.
    p, out, incs = _run(tmp_path, "r1", *flaky)
    assert p.returncode == 0, p.stderr
    assert [(i["detected_step"], i["classification"], i["recovered"]) for i in incs] == \
        [(5, "transient", True), (13, "transient", True)]
    assert [i["replay"]["first_divergence"]["device"] for i in incs] == [dev, dev]
    assert (tmp_path / "r1.sha").read_text() == truth
    assert query(out / "recording.duckdb", "SELECT kind, device, rank, step, incident_id FROM health_event "
                 "WHERE kind = 'failure' ORDER BY step") == [("failure", dev, 1, 5, "inc-0001"),
                                                             ("failure", dev, 1, 13, "inc-0002")]

    # Run 2: the third failure on that core within the window is the core's:
    # hardware, quarantined; the window's clean state merged, rank 1 moved off
    # it, and the fault never strikes again (off the core it cannot).
    p, out, incs = _run(tmp_path, "r2", *flaky)
    assert p.returncode == 0, p.stderr
    [inc] = incs
    assert (inc["detected_step"], inc["classification"], inc["track"], inc["recovered"], inc["steps_lost"]) == \
        (5, "persistent", "B", True, 0)
    assert inc["attribution"]["cause"] == "hardware"
    assert inc["escalated"]["device"] == dev and inc["escalated"]["rank"] == 1
    assert [(f.get("run"), f["incident_id"]) for f in inc["escalated"]["failures"]] == \
        [(str(tmp_path / "r1"), "inc-0001"), (str(tmp_path / "r1"), "inc-0002"), (str(out), "inc-0001")]
    pres = inc["prescription"]
    assert (pres["action"], pres["device"]["cpus"], pres["applied"]) == ("quarantine_device", [BAD], True)
    assert pres["move_to"] == {"cpus": sorted(os.sched_getaffinity(0) - {BAD})}
    assert inc["causal_chain"][0]["kind"] == "device" and inc["causal_chain"][0]["device"] == dev
    assert not (tmp_path / "m-r2" / "struck.14").exists()
    assert (tmp_path / "r2.sha").read_text() == truth
    assert [q["device"] for q in json.loads((tmp_path / "node" / "quarantined.json").read_text())] == [dev]
    h = watcher("health", "--health-dir", str(tmp_path / "node"), "--json")
    got = json.loads(h.stdout)["devices"][dev]
    assert (got["failures"], got["quarantined"]) == (3, True)

    # Run 3: the next launch on the node leaves the quarantined core out.
    p, out, incs = _run(tmp_path, "r3", "--affinity", str(tmp_path / "aff"))
    assert p.returncode == 0, p.stderr
    assert f"CPUs [{BAD}] are quarantined on this node" in p.stderr
    for r in (0, 1):
        assert BAD not in {int(c) for c in (tmp_path / f"aff.rank{r}").read_text().split(",")}
    assert incs == [] and (tmp_path / "r3.sha").read_text() == truth


@needs_bpf
def test_a_core_that_always_fails_is_hardware_quarantined_and_the_run_finishes(tmp_path):
    """The core fails every time rank 1 runs the step on it, replays included:
    persistent; the counterfactual on the other cores is clean, so hardware;
    under --policy apply rank 1 moves off the core and the run finishes as if
    the fault never was (the second strike, later, never comes: off the core)."""
    plain(TORCHRUN + ["--save", str(tmp_path / "plain.sha")], tmp_path)
    dev = health.cpu_device(BAD, HOST)
    p, out, incs = _run(tmp_path, "r", "--core", str(BAD), "--flip-steps", "6,14", "--always")
    assert p.returncode == 0, p.stderr
    [inc] = incs
    assert (inc["detected_step"], inc["classification"], inc["attribution"]["cause"]) == (5, "persistent", "hardware")
    assert inc["diagnosis"]["replays"]["other_cores"]["clean"] and not inc["diagnosis"]["replays"]["trace"]["clean"]
    pres = inc["prescription"]
    assert (pres["action"], pres["device"]["cpus"], pres["applied"]) == ("quarantine_device", [BAD], True)
    assert (inc["recovered"], inc["steps_lost"]) == (True, 0)
    assert (tmp_path / "r.sha").read_text() == (tmp_path / "plain.sha").read_text()
    assert [q["device"] for q in json.loads((tmp_path / "node" / "quarantined.json").read_text())] == [dev]
    assert query(out / "recording.duckdb", "SELECT kind, device, step FROM health_event WHERE kind != 'signal' "
                 "ORDER BY unix_time") == [("failure", dev, 5), ("quarantine", dev, None)]



def test_a_launch_leaves_quarantined_gpus_out_by_uuid():
    """The GPU half of a quarantine, without a GPU: NVML's device list is given
    (on a GPU machine, scripts/gpu_check reads the real one)."""
    from watcher.health import visible_gpus

    gpus = [{"index": i, "uuid": f"GPU-{i}aaa"} for i in range(4)]
    q = ["gpu-GPU-2aaa", "cpu1@node7"]
    assert visible_gpus(q, gpus, None) == ("GPU-0aaa,GPU-1aaa,GPU-3aaa", ["GPU-2aaa"])
    # The job's own choice is kept, by index or UUID, less the quarantined board.
    assert visible_gpus(q, gpus, "1,2") == ("GPU-1aaa", ["GPU-2aaa"])
    assert visible_gpus(q, gpus, "GPU-2aaa,GPU-3aaa") == ("GPU-3aaa", ["GPU-2aaa"])
    # Nothing quarantined among them, or no NVML: the launch is left alone.
    assert visible_gpus(q, gpus, "0,1") == (None, [])
    assert visible_gpus(q, None, None) == (None, [])
    # All of its GPUs quarantined: nothing left to launch on.
    assert visible_gpus(["gpu-GPU-0aaa"], gpus[:1], None) == ("", ["GPU-0aaa"])
