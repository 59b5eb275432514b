"""Track B: persistent failures diagnosed by counterfactual replay.

Each persistent drill injects a known cause into the real 2-rank reference job
(gloo, CPU) under `watcher run`; the ground truth is that injected cause:
the rank, step and sample of a corrupt batch, the op and module of a logic
bug, the learning-rate spike, the CPUs a faulty "device" runs on.  Diagnosis
must name it, with the chain and a prescription; under --policy apply the
prescription must be applied and training finish.  The report and the trace
export are then checked on those real recordings."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from watcher.replay.snapshot import ForkSnapshot
from watcher.rundir import RunDir, write_json

from .conftest import ROOT, needs_bpf, query, watcher

PERSISTENT = ("bad_batch", "bad_op", "fp32_overflow", "lr_spike", "bad_cores", "skip_batch", "adjust_lr")


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    d = tmp_path_factory.mktemp("drills")
    card = d / "card.json"
    # Snapshots are retained long enough for `watcher diagnose` after the
    # whole drill; the release test (or the teardown) ends them.
    p = watcher("drill", "--steps", "22", "--scenario", ",".join(PERSISTENT), "--out", str(d / "d"),
                "--json", str(card), "--retain", "900", timeout=1500)
    rows = {r["scenario"]: r for r in json.loads(card.read_text())["scenarios"]}
    yield d / "d", rows, p
    for name in PERSISTENT:
        if (d / "d" / name).is_dir():
            watcher("release", str(d / "d" / name))


def incident(run: Path) -> dict:
    return json.loads((run / "incidents" / "inc-0001.json").read_text())


@needs_bpf
def test_every_persistent_drill_is_attributed_to_its_injected_cause(drills):
    out, rows, p = drills
    assert set(rows) == set(PERSISTENT)
    failed = [r for r in rows.values() if not r["pass"]]
    assert not failed, f"{failed}\n{p.stdout}\n{p.stderr[-3000:]}"
    assert p.returncode == 0
    assert {n: rows[n]["attribution"] for n in PERSISTENT} == {
        "bad_batch": "data (skip_batch)", "bad_op": "software (fix_kernel)", "fp32_overflow": "software (fix_kernel)",
        "lr_spike": "params (adjust_params)",
        "bad_cores": "hardware (quarantine_device)", "skip_batch": "data (skip_batch)",
        "adjust_lr": "params (adjust_params)"}


@needs_bpf
def test_bad_batch_names_rank_step_and_sample_and_the_chain(drills):
    out, rows, _ = drills
    inc = incident(out / "bad_batch")
    [batch] = inc["prescription"]["batches"]
    digests = batch.pop("digests")
    assert batch == {"rank": 1, "step": 12, "batch_index": 12, "samples": [5]}
    assert len(digests) == 1 and int(digests[0]) > 0  # sample 5's, kept out from then on under --policy apply
    chain = inc["causal_chain"]
    assert [link["kind"] for link in chain] == ["batch", "op", "loss", "collective", "detector"]
    assert chain[0]["rank"] == 1 and chain[0]["samples"] == [5]
    assert "non-finite values in field 2" in chain[0]["evidence"]  # the loss-weight field the drill poisoned
    assert chain[1]["op"] == "aten::mul.Tensor" and chain[1]["rank"] == 1  # the first op to consume it
    assert chain[3]["collective"]["op"] == "allreduce"  # how rank 0 got the NaN
    replays = inc["diagnosis"]["replays"]
    assert not replays["trace"]["clean"] and replays["drop_rows"]["clean"] and replays["swap_batch"]["clean"]
    assert not replays["lr_low"]["clean"]
    # The same, through SQL.
    rec = out / "bad_batch" / "recording.duckdb"
    assert query(rec, "SELECT attribution, prescription, prescription_applied FROM incident") == \
        [("data", "skip_batch", False)]
    assert query(rec, "SELECT position, kind, step, rank FROM causal_link ORDER BY position")[:2] == \
        [(0, "batch", 12, 1), (1, "op", 12, 1)]


@needs_bpf
def test_bad_op_is_software_with_a_reproducer_that_runs_without_watcher(drills, tmp_path):
    out, rows, _ = drills
    inc = incident(out / "bad_op")
    pre = inc["prescription"]
    assert (pre["action"], pre["op"], pre["module"]) == ("fix_kernel", "aten::div.Tensor", "blocks.0.mlp.1")
    assert inc["causal_chain"][0]["kind"] == "op" and "from finite inputs" in inc["causal_chain"][0]["evidence"]
    # Every counterfactual still fails: not the data, not the learning rate.
    assert not any(r["clean"] for r in inc["diagnosis"]["replays"].values())
    repro = Path(pre["reproducer"])
    text = repro.read_text()
    assert "import watcher" not in text and "from watcher" not in text
    # A copy elsewhere, run in isolated mode (no PYTHONPATH, no cwd on sys.path): it needs only torch.
    shutil.copytree(repro.parent, tmp_path / "repro")
    p = subprocess.run([sys.executable, "-I", str(tmp_path / "repro" / "repro.py")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "reproduced" in p.stdout and "aten::div.Tensor" in p.stdout


@needs_bpf
def test_fp32_overflow_is_software_clean_only_in_the_float64_reference(drills):
    out, rows, _ = drills
    inc = incident(out / "fp32_overflow")
    pre = inc["prescription"]
    assert (pre["action"], pre["op"], pre["module"]) == ("fix_kernel", "aten::exp", "blocks.0.mlp.1")
    assert "float64 is clean" in pre["precision"]
    replays = inc["diagnosis"]["replays"]
    assert replays["float64"]["clean"] and not any(o["clean"] for n, o in replays.items() if n != "float64")
    assert "replayed in float64 is clean" in inc["causal_chain"][0]["evidence"]
    # A logic bug fails in float64 as well, and says so.
    bad_op = incident(out / "bad_op")
    assert not bad_op["diagnosis"]["replays"]["float64"]["clean"] and "precision" not in bad_op["prescription"]
    assert bad_op["causal_chain"][0]["evidence"].endswith("in float64")


@needs_bpf
def test_lr_spike_is_params_and_the_prescribed_lr_works_when_applied(drills):
    out, rows, _ = drills
    inc = incident(out / "lr_spike")
    root = inc["causal_chain"][0]
    assert root["kind"] == "hyperparameter" and root["step"] == 12
    assert "jumped from 0.003 to 3 at step 12 (1000x in one step)" in root["evidence"]
    assert inc["prescription"]["params"] == [{"param_group": 0, "name": "lr", "to": pytest.approx(0.003)}]
    applied = incident(out / "adjust_lr")
    assert applied["prescription"]["applied"] is True and applied["recovered"] is True
    assert applied["steps_lost"] == 0
    row = rows["adjust_lr"]
    assert row["exit_code"] == 0 and row["steps"] == 22 and math.isfinite(row["final_loss"])
    # The spike was the only fault, so the run with the prescribed lr is the fault-free run, bit for bit.
    assert row["bit_identical"] is True


@needs_bpf
def test_bad_cores_is_hardware_and_names_the_device(drills):
    out, rows, _ = drills
    inc = incident(out / "bad_cores")
    dev = inc["prescription"]["device"]
    assert (dev["rank"], dev["kind"], dev["cpus"]) == (1, "cpu", [0])
    assert inc["prescription"]["move_to"] == {"cpus": [1]}
    replays = inc["diagnosis"]["replays"]
    assert replays["other_cores"]["clean"] and not replays["trace"]["clean"] and not replays["swap_batch"]["clean"]
    assert inc["causal_chain"][1]["module"] == "head"  # the Linear the faulty cores corrupt


@needs_bpf
def test_skip_batch_applied_finishes_training_and_records_the_ids(drills):
    out, rows, _ = drills
    row = rows["skip_batch"]
    assert row["exit_code"] == 0 and row["steps"] == 22 and math.isfinite(row["final_loss"])
    inc = incident(out / "skip_batch")
    assert inc["prescription"]["applied"] is True and inc["prescription"]["applied_at_step"] == 14
    assert inc["prescription"]["batches"][0]["samples"] == [5]
    assert (inc["recovered"], inc["resumed_at_step"], inc["steps_lost"]) == (True, 14, 0)
    rec = out / "skip_batch" / "recording.duckdb"
    assert query(rec, "SELECT prescription, prescription_applied FROM incident") == [("skip_batch", True)]
    # Every step is in the record once, and all are finite: the replayed
    # fingerprints (without the bad samples) replaced the NaN ones.
    losses = query(rec, "SELECT step, loss FROM step WHERE rank = 1 ORDER BY step")
    assert [s for s, _ in losses] == list(range(22))
    assert all(math.isfinite(v) for _, v in losses)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@needs_bpf
@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (scripts/setup installs it)")
def test_html_report_renders_in_headless_chromium(drills, tmp_path):
    out, _, _ = drills
    page = tmp_path / "report.html"
    p = watcher("report", str(out / "bad_batch"), "--html", str(page), check=True)
    assert "data (confidence 0.95)" in p.stdout and "skip_batch rank 1 step 12" in p.stdout
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "report.png"
    subprocess.run(base + [f"--screenshot={shot}", "--window-size=800,1600", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a rendered page, not a blank one
    artefacts = ROOT / "test-artifacts"
    artefacts.mkdir(exist_ok=True)
    shutil.copy(shot, artefacts / "report.png")  # kept for a person to look at
    dom = subprocess.run(base + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert '<ol class="chain">' in dom and "sample 5 has 64 non-finite values" in dom
    assert dom.count("<polyline") >= 4  # loss and grad norm, two ranks each
    # The verdict, chain and prescription lead; the curves follow.
    assert dom.index('class="verdict"') < dom.index('class="chain"') < dom.index('class="prescription"') \
        < dom.index('class="plot"')
    # Either rank may see the NaN first (the allreduce spreads it): the detector's rank is not fixed.
    assert re.search(r"inc-0001: non_finite at step 12 on rank [01] -&gt; persistent", dom)
    for svg in re.findall(r'<svg class="plot".*?</svg>', dom, re.S):
        # Axes with values, the incident's step marked, the legend below the x axis (never over the plot).
        x_axis, top = (float(y) for y in re.findall(r'class="axis" x1="[\d.]+" y1="([\d.]+)"', svg))
        assert len(re.findall(r'<text class="tick"', svg)) >= 6
        assert ">inc-0001 non_finite at step 12</text>" in svg
        legend = [float(y) for y in re.findall(r'<g class="legend"><rect x="[\d.]+" y="([\d.]+)"', svg)]
        assert len(legend) == 2 and min(legend) > x_axis + 20
        labels = [float(y) for y in re.findall(r'class="incident-label" x="[\d.]+" y="([\d.]+)"', svg)]
        assert labels and max(labels) < top  # incident labels in their band above the plot
    assert "gradient norm (L2), log scale" in dom
    # The window's timeline: a mark per rank and step, per collective, hover details on each.
    inc = incident(out / "bad_batch")
    lo, hi = inc["window"]["from_step"], inc["window"]["to_step"]
    rec = out / "bad_batch" / "recording.duckdb"
    [(n_steps,)] = query(rec, f"SELECT count(*) FROM step WHERE step > {lo} AND step <= {hi} AND dur > 0")
    [(n_colls,)] = query(rec, f"SELECT count(*) FROM collective_io WHERE step > {lo} AND step <= {hi} "
                              "AND ts IS NOT NULL")
    assert dom.count('<rect class="step"') == n_steps and dom.count('<rect class="collective"') == n_colls
    assert "<title>rank 1 step 12: " in dom
    # What Watcher cost each rank.
    assert re.search(r'<table class="cost">.*rank 0.*rank 1.*</table>', dom, re.S)


@needs_bpf
def test_perfetto_export_is_valid_chrome_trace_json(drills, tmp_path):
    out, _, _ = drills
    trace = tmp_path / "t.json"
    watcher("export", str(out / "bad_batch"), "--perfetto", str(trace), "--format", "json", check=True)
    events = json.loads(trace.read_text())["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0
        elif e["ph"] in ("b", "e"):
            assert "id" in e and "cat" in e
        else:
            assert e["ph"] == "M" and isinstance(e["args"], dict)
            if e["name"] in ("process_name", "thread_name"):
                assert isinstance(e["args"]["name"], str)
    # Complete slices nest per thread (to 1 ns: ts and dur are float microseconds).
    by_thread = {}
    for e in events:
        if e["ph"] == "X":
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends = []
        for start, end in spans:
            while open_ends and open_ends[-1] <= start + 1e-3:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3, (start, end, open_ends[-1])
            open_ends.append(end)
    # Async begin/end pair up.
    begins = {(e["cat"], e["id"]) for e in events if e["ph"] == "b"}
    assert begins == {(e["cat"], e["id"]) for e in events if e["ph"] == "e"}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"rank 0", "rank 1"} <= {n.split(" (")[0] for n in names}
    # One trace process per recorded process (upid), even where the kernel reused a pid.
    procs = [e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    (n_procs,), = query(out / "bad_batch" / "recording.duckdb", "SELECT count(*) FROM process")
    assert len(procs) == len(set(procs)) == n_procs
    steps = {e["name"] for e in events if e.get("cat") == "step"}
    assert {f"step {k}" for k in range(2, 14)} <= steps
    assert any(e["name"].startswith("allreduce #") for e in events if e.get("cat") == "collective")
    assert any(e.get("cat") == "syscall" for e in events)


@needs_bpf
def test_perfetto_export_is_a_protobuf_trace_with_every_call(drills, tmp_path):
    """The native trace, read back by the protobuf library through Perfetto's
    field numbers (tests/perfetto_proto.py): every system call and futex wait
    of every thread, every step and collective of every rank, on the right
    track under the right process, with its name."""
    from collections import Counter

    from .perfetto_proto import read

    out, _, _ = drills
    rec = out / "bad_batch" / "recording.duckdb"
    trace = tmp_path / "t.pftrace"
    watcher("export", str(out / "bad_batch"), "--perfetto", str(trace), check=True)
    packets = read(trace).packet
    assert {p.trusted_packet_sequence_id for p in packets} == {1}
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in packets if p.HasField("track_descriptor")}
    names = {e.iid: e.name for p in packets if p.HasField("interned_data") for e in p.interned_data.event_names}
    events = [p for p in packets if p.HasField("track_event")]
    begins = [p for p in events if p.track_event.type == 1]
    assert Counter(p.track_event.track_uuid for p in begins) == \
        Counter(p.track_event.track_uuid for p in events if p.track_event.type == 2)  # every slice ends

    def slices_on(track_name: str, parent_name: str) -> Counter:
        """Slice names on the track so named under the process so named."""
        [uuid] = [u for u, t in tracks.items() if t.name == track_name and tracks[t.parent_uuid].name == parent_name]
        return Counter(p.track_event.name or names[p.track_event.name_iid]
                       for p in begins if p.track_event.track_uuid == uuid)

    procs = query(rec, "SELECT upid, pid, rank, name FROM process ORDER BY start_ts NULLS FIRST, upid")
    process_tracks = [t for t in tracks.values() if t.HasField("process")]
    assert len(process_tracks) == len(procs)
    proc_name, first_of_rank = {}, {}
    for upid, pid, rank, comm in procs:
        first = rank is not None and rank not in first_of_rank
        if first:
            first_of_rank[rank] = upid
        proc_name[upid] = f"rank {rank} (pid {pid})" if first else f"{comm} (pid {pid})"
    assert sorted(t.name for t in process_tracks) == sorted(proc_name.values())
    # Every thread's calls, by name, exactly as recorded.
    for utid, upid, tid, comm in query(rec, "SELECT utid, upid, tid, name FROM thread"):
        want = Counter(dict(query(rec, f"SELECT name, count(*) FROM syscall WHERE utid = {utid} GROUP BY 1")))
        if want:
            assert slices_on(f"{comm} {tid}", proc_name[upid]) == want, (utid, comm)
        want = Counter(dict(query(rec, f"SELECT op_name, count(*) FROM futex WHERE utid = {utid} GROUP BY 1")))
        if want:
            assert slices_on(f"{comm} {tid} futex waits", proc_name[upid]) == want, (utid, comm)
    for rank in (0, 1):
        rank_proc = proc_name[first_of_rank[rank]]
        steps = [s for (s,) in query(rec, f"SELECT step FROM step WHERE rank = {rank} AND dur IS NOT NULL")]
        assert slices_on("steps", rank_proc) == Counter(f"step {s}" for s in steps)
        colls = Counter(f"{op} #{seq}" for op, seq in query(
            rec, f"SELECT op, seq FROM collective_io WHERE rank = {rank} AND ts IS NOT NULL"))
        lanes = [t.name for t in tracks.values() if t.name.startswith("collectives")
                 and tracks[t.parent_uuid].name == rank_proc]
        assert sum((slices_on(lane, rank_proc) for lane in lanes), Counter()) == colls
        [loss] = [u for u, t in tracks.items() if t.name == "loss" and tracks[t.parent_uuid].name == rank_proc]
        got = sorted(p.track_event.double_counter_value for p in events if p.track_event.track_uuid == loss)
        assert got == sorted(x for (x,) in query(rec, f"SELECT loss FROM step WHERE rank = {rank} "
                                                      "AND dur IS NOT NULL AND isfinite(loss)"))
    # A fraction of the JSON export's size.
    as_json = tmp_path / "t.json"
    watcher("export", str(out / "bad_batch"), "--perfetto", str(as_json), "--format", "json", check=True)
    assert trace.stat().st_size < 0.6 * as_json.stat().st_size


# -- the diagnosis again, after the run, from the retained snapshots ---------------------------

DIAGNOSED_AGAIN = ("bad_batch", "bad_op", "fp32_overflow", "lr_spike", "bad_cores")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_bpf
def test_watcher_diagnose_repeats_the_verdict_and_chain_from_the_retained_snapshots(drills):
    out, rows, _ = drills
    for name in DIAGNOSED_AGAIN:
        run = out / name
        held = [json.loads((run / "retained" / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [h["incident_id"] for h in held] == ["inc-0001"] * 2 and all(_alive(h["pid"]) for h in held)
        # The snapshot the run's own diagnosis replayed from, not a newer one.
        assert {h["step"] for h in held} == {incident(run)["diagnosis"]["from_step"]}
        p = watcher("diagnose", str(run), "--format", "json", timeout=600)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["same_as_recorded"] is True, (name, doc["differences"])
        assert doc["attribution"]["cause"] == rows[name]["attribution"].split()[0]
        assert doc["causal_chain"] == incident(run)["causal_chain"]
        assert Path(doc["out"]).parent == run / "incidents" / "inc-0001"  # beside the run's results, not over them
    # The repeated software verdict writes its own reproducer, and it reproduces.
    again = json.loads(watcher("diagnose", str(out / "bad_op"), "--format", "json", check=True).stdout)
    assert again["same_as_recorded"] is True and again["out"].endswith("rediagnosis-2")
    p = subprocess.run([sys.executable, "-I", again["prescription"]["reproducer"]], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and "reproduced" in p.stdout
    # Runs whose prescription was applied went on: nothing to retain.
    assert not (out / "skip_batch" / "retained").exists() and not (out / "adjust_lr" / "retained").exists()


@needs_bpf
def test_release_ends_the_snapshots_and_the_report_needs_only_the_recording(drills, tmp_path):
    out, _, _ = drills
    run = out / "bad_batch"
    pids = [json.loads((run / "retained" / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]
    p = watcher("release", str(run))
    assert p.returncode == 0 and "released the snapshots of ranks [0, 1]" in p.stderr
    assert not any(_alive(pid) for pid in pids)
    assert not (run / "retained" / "window").exists()
    p = watcher("diagnose", str(run))
    assert p.returncode == 6 and len(p.stderr.strip().splitlines()) == 1 and "are gone" in p.stderr
    # Every process of the run is gone (ranks and snapshots); the report renders from the files alone.
    ranks = [pid for (pid,) in query(run / "recording.duckdb", "SELECT pid FROM process WHERE rank IS NOT NULL")]
    assert ranks and not any(_alive(pid) for pid in ranks)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    p = watcher("report", str(copy), "--html", str(tmp_path / "r.html"), check=True)
    assert "data (confidence 0.95)" in p.stdout and (tmp_path / "r.html").stat().st_size > 5000
    p = watcher("diagnose", str(out / "nonexistent"))
    assert p.returncode == 6 and "not a `watcher run` directory" in p.stderr


def _fake_rank(tmp_path: Path):
    """What a snapshot reads from its rank's runtime, for a snapshot of this test process."""
    return SimpleNamespace(rundir=RunDir(tmp_path), run_dir=tmp_path, window_dir=tmp_path, rank=0, world=1, local_ranks=[0],
                           go_quiet=lambda: None, snap_policy=SimpleNamespace(fork_ns=[]))


def _wait_exit(pid: int, within: float) -> int | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return None


def test_a_retained_snapshot_ends_at_its_deadline_or_on_an_exit_order(tmp_path):
    window, orders = tmp_path / "window", tmp_path / "orders"
    window.mkdir()
    orders.mkdir()
    (window / "rank0.seg3.pkl").write_bytes(b"window")
    snap = ForkSnapshot.take(_fake_rank(tmp_path), 3)
    t0 = time.monotonic()
    assert snap.retain(time.time() + 1.5, window, orders)
    # Still held a second into its lifetime (counted from before the order, whatever the order took).
    assert _wait_exit(snap.pid, t0 + 1.0 - time.monotonic()) is None
    assert _wait_exit(snap.pid, 5.0) == 0
    assert 1.4 < time.monotonic() - t0 < 4.0
    assert not (window / "rank0.seg3.pkl").exists()  # its window copy went with it
    # `watcher release` ends one long before its deadline.
    snap = ForkSnapshot.take(_fake_rank(tmp_path), 3)
    assert snap.retain(time.time() + 600, window, orders)
    assert _wait_exit(snap.pid, 0.3) is None
    write_json(orders / "1-exit.json", {"op": "exit"})
    assert _wait_exit(snap.pid, 3.0) == 0


@needs_bpf
def test_skipped_samples_stay_skipped_in_later_epochs(tmp_path):
    """The corrupt sample is in the dataset itself: drawn at step 12 on rank 1,
    and again in the second epoch (128 steps a rank), wherever the shuffle puts
    it.  Under --policy apply the first meeting is diagnosed and its samples
    skipped; the second is filtered out as it arrives, with no new incident."""
    code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
            "from watcher.demo import reference_command; a = json.loads(sys.argv[1]); "
            "r = run(RunConfig(cmd=reference_command(260), out=Path(a['out']), policy='apply', snapshot_interval=4, "
            "inject={'scenario': 'bad_sample', 'rank': 1, 'step': 12, 'sample': 5}, retain_s=0, quiet=True)); "
            "sys.exit(r.exit_code)")
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", code, json.dumps({"out": str(run)})], capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    incidents = sorted((run / "incidents").glob("inc-*.json"))
    assert [i.name for i in incidents] == ["inc-0001.json"]  # met again, never failed again
    inc = json.loads(incidents[0].read_text())
    pre = inc["prescription"]
    assert (inc["attribution"]["cause"], pre["action"], pre["applied"]) == ("data", "skip_batch", True)
    assert pre["batches"][0]["samples"] == [5] and len(pre["batches"][0]["digests"]) == 1
    skipped = [json.loads(line) for r in (0, 1) if (run / "runtime" / f"rank{r}.skipped.jsonl").exists()
               for line in (run / "runtime" / f"rank{r}.skipped.jsonl").read_text().splitlines()]
    # Once in the second epoch (steps 128-255; the third starts at 256), never in the first.
    assert len([s for s in skipped if 128 <= s["step"] < 256]) == 1 and min(s["step"] for s in skipped) >= 128, skipped
    assert all(len(s["rows"]) == 1 and s["digests"] == pre["batches"][0]["digests"]
               and s["incident_id"] == "inc-0001" for s in skipped)
    rec = run / "recording.duckdb"
    losses = query(rec, "SELECT rank, count(*), count(*) FILTER (WHERE isfinite(loss)) FROM step GROUP BY 1 ORDER BY 1")
    assert losses == [(0, 260, 260), (1, 260, 260)]


def test_the_lr_jump_is_the_step_it_rose_most_not_the_warm_up():
    """A warm-up that climbs 1.5x a step, then a 10x jump at step 9: the chain
    names step 9 (the jump that lr_hold proved harmful), not step 2 (the first rise)."""
    from watcher.replay.diagnose import _lr_jump

    warm = [(s, [1e-4 * 1.5 ** (s - 1)]) for s in range(1, 9)]
    seq = warm + [(9, [warm[-1][1][0] * 10]), (10, [warm[-1][1][0] * 10])]
    step, lrs, before, ratio, earlier = _lr_jump(seq)
    assert (step, before, round(ratio, 6), round(earlier, 6)) == (9, warm[-1][1][0], 10.0, 1.5)
    assert _lr_jump([(1, [0.1]), (2, [0.1]), (3, [0.05])]) is None  # it never rose
