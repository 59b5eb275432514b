"""`watcher run`: launch a training command with the recorder and the in-rank runtime.

The run directory DIR (its layout: watcher/rundir.py) holds the recording
(DIR/recording.duckdb, with the runtime's tables added after the job), the
ranks' logs and control block, and one document per incident; the replay
window's segments live on tmpfs (/dev/shm/watcher-window-*) while the job runs.

The runtime reaches every Python rank through a sitecustomize put first on
PYTHONPATH (it chains to any existing one); the user's files are not touched.
After the job ends, a rank that crashed is replayed from its newest snapshot
(which outlives the rank for a short while) to see whether it crashes again
(crash.py; across nodes on a multi-node job).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .analysis.detectors import Detectors
from .analysis.incidents import analyze_hang
from .crash import crash_incident
from . import health
from .errors import NodeUnusable, RecordingError, UsageError
from .incident import Incident, load_incidents, save_incident
from .privileges import require_bcc, require_bpf_privileges
from .rank_deaths import RankDeaths
from .report import describe_unprotected
from .rundir import RunDir, read_json, write_json
from .runtime import crashsite, supervisor, wordsum
from .runtime.control import PAUSE_RECORDER, SIZE, Control
from .session import Session, SessionConfig
from .store import Recordings, causal_link_rows, count_steps, incident_row, write_run_tables
from .uprobes.tensor_layout import CACHE

POLICIES = ("observe", "recover", "apply")
SITE_DIR = Path(wordsum.__file__).resolve().parent / "site"  # the runtime package's sitecustomize
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class RunConfig:
    cmd: list[str]
    out: Path
    policy: str = "recover"
    snapshot_budget: float = 1.0        # percent of step time
    snapshot_interval: int | None = None
    copy_interval: int | None = None    # state copies between snapshots: None adapts to the budget, 0 is off
    detect: dict = field(default_factory=dict)
    inject: dict | list | None = None   # drills only: one fault or several
    replay_check: int | None = None     # replay the window ending at this step, healthy or not
    retain_s: float = 300.0             # a persistent incident's snapshots outlive the run this long
    audit_budget: float = 0.5           # percent of the job's time the background SDC audit may use; 0 is off
    health_dir: Path | None = None      # the node's device health ledger (health.py); None: this run's only
    rescue: bool = True                 # a rank that dies is replaced while the job runs (rescue.py); acting policies only
    quiet: bool = False

    def validate(self) -> None:
        if not self.cmd:
            raise UsageError("nothing to run: give a command after --, e.g. watcher run -- torchrun train.py")
        if self.policy not in POLICIES:
            raise UsageError(f"unknown --policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if not 0 < self.snapshot_budget <= 100:
            raise UsageError("--snapshot-budget is a percentage of step time, in (0, 100]")
        if self.snapshot_interval is not None and self.snapshot_interval < 1:
            raise UsageError("--snapshot-interval must be at least 1 step")
        if self.copy_interval is not None and self.copy_interval < 0:
            raise UsageError("--copy-interval is a number of steps (0 turns state copies off)")
        if not 0 <= self.audit_budget <= 1000:
            raise UsageError("--audit-budget is a percentage of the job's time, in [0, 1000] (0 turns the audit off)")
        if not 0 <= self.retain_s <= 86400:
            raise UsageError("--retain is in seconds, from 0 (keep nothing) to 86400")

    def env(self) -> dict:
        env = dict(os.environ)
        prev = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(SITE_DIR) + (os.pathsep + prev if prev else "")
        env["WATCHER_PACKAGE_ROOT"] = str(PACKAGE_ROOT)
        env["WATCHER_RUN_DIR"] = str(self.out.resolve())
        env["WATCHER_POLICY"] = self.policy
        env["WATCHER_SNAPSHOT_BUDGET"] = str(self.snapshot_budget)
        env["WATCHER_AUDIT_BUDGET"] = str(self.audit_budget / 100)
        env["WATCHER_RETAIN_S"] = str(self.retain_s)
        if self.health_dir is not None:
            env[health.NODE_DIR_ENV] = str(Path(self.health_dir).resolve())
        else:
            env.pop(health.NODE_DIR_ENV, None)
        if self.snapshot_interval:
            env["WATCHER_SNAPSHOT_INTERVAL"] = str(self.snapshot_interval)
        if self.copy_interval is not None:
            env["WATCHER_COPY_INTERVAL"] = str(self.copy_interval)
        else:
            env.pop("WATCHER_COPY_INTERVAL", None)
        if self.replay_check is not None:
            env["WATCHER_REPLAY_CHECK"] = str(self.replay_check)
        else:
            env.pop("WATCHER_REPLAY_CHECK", None)
        if self.detect:
            env["WATCHER_DETECT"] = json.dumps(self.detect)
        if self.rescue and self.policy in ("recover", "apply"):  # observe never acts on the job
            env[supervisor.ENV] = "1"
        else:
            env.pop(supervisor.ENV, None)
        if self.inject:
            env["WATCHER_INJECT"] = json.dumps(self.inject)
        else:
            env.pop("WATCHER_INJECT", None)
        # One-pass checksums (without it the ranks sum with torch); native
        # frames of a crash (without it a crash site has its Python frames only).
        for mod in (wordsum, crashsite):
            lib = mod.build(CACHE)
            if lib is not None:
                env[mod.ENV] = str(lib)
            else:
                env.pop(mod.ENV, None)
        return env


@dataclass
class RunResult:
    out: Path
    exit_code: int
    incidents: list[dict]
    steps: int
    audit: dict | None = None           # the SDC audit's account (audit_summary)

    @property
    def recording(self) -> Path:
        return RunDir(self.out).recording


def parse_detect(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"bad --detect {item!r}: use KEY=VALUE, e.g. --detect hang_seconds=60")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    try:
        Detectors.from_dict(out)
    except (ValueError, TypeError) as e:
        raise UsageError(f"bad --detect: {e}") from None
    return out


def run(cfg: RunConfig) -> RunResult:
    cfg.validate()
    require_bcc()  # before anything is created: a refused run leaves nothing behind
    require_bpf_privileges()
    if cfg.out.exists():
        raise RecordingError(f"{cfg.out} already exists; choose another --out or remove it")
    node = health.Ledger(None, cfg.health_dir) if cfg.health_dir is not None else None
    if node is not None and node.unusable_file.exists():
        why = read_json(node.unusable_file).get("reason", "")
        raise NodeUnusable(f"this node is marked unusable ({node.unusable_file}): {why}; "
                           f"`watcher health --health-dir {cfg.health_dir} --clear` once it is repaired")
    gpus = _off_quarantined_gpus(node, cfg.quiet) if node is not None else None
    run_dir = RunDir(cfg.out)
    try:
        run_dir.create(cfg.cmd)
        ctl = Control(run_dir.runtime)  # initialised before any rank can race to create it
    except OSError as e:
        raise RecordingError(f"cannot create {cfg.out}: {e.strerror}") from None
    # Snapshots of a crashed rank are orphaned; as subreaper we get them, not init.
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # The control block's `paused` word (an overhead measurement, `just bench
    # run`) pauses the recorder, the ranks' runtime, or both.
    session = Session(SessionConfig(out=run_dir.recording, quiet=cfg.quiet,
                                    paused=lambda: ctl.paused & PAUSE_RECORDER != 0))
    status = _StatusLine(cfg.out) if sys.stderr.isatty() and not cfg.quiet else None
    window_dir = _window_dir(run_dir)
    env = cfg.env()
    env["WATCHER_WINDOW_DIR"] = str(window_dir)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    deaths = RankDeaths(run_dir, ctl, rescue=cfg.rescue).start()  # so no rank waits for a dead peer
    t_job = time.monotonic()
    ledger = health.Ledger(run_dir.root, cfg.health_dir)
    signals_at_start = _health_signals(ledger, run_dir, None)
    # XID events enter the ledger as the driver raises them (nothing without NVML).
    xids = health.XidListener(lambda x: ledger.add(health.xid_event(str(run_dir.root), x))).start()
    was_on = _off_quarantined_cores(ledger, cfg.quiet)
    try:
        try:
            result = session.record(list(cfg.cmd), env=env)
        finally:
            if was_on is not None:
                os.sched_setaffinity(0, was_on)
            deaths.stop()
            xids.stop()
            if status:
                status.stop()
        _health_signals(ledger, run_dir, signals_at_start)
        crash_incident(run_dir)
        _unfinished_incidents(run_dir)
        incidents = ingest(run_dir)
    finally:
        if window_dir != run_dir.runtime:
            shutil.rmtree(window_dir, ignore_errors=True)
    steps = count_steps(run_dir.recording)
    code = result.target_exit or 0
    audit = audit_summary(run_dir, steps, time.monotonic() - t_job)
    if not cfg.quiet:
        if audit:
            print(describe_audit(audit), file=sys.stderr)
        for line in describe_unprotected(run_dir.refusals()):
            print(f"watcher: {line}", file=sys.stderr)
        for inc in incidents:
            print(describe(inc), file=sys.stderr)
    _reap_orphans()
    return RunResult(cfg.out, code, incidents, steps, audit)


def _off_quarantined_cores(ledger: health.Ledger, quiet: bool) -> set[int] | None:
    """Launch the job off the cores the node quarantined (the ranks inherit
    this thread's CPU set); the set to restore, or None if nothing changed."""
    here = os.uname().nodename
    bad = {x[0] for q in ledger.quarantined() if (x := health.parse_cpu_device(q)) and x[1] == here}
    now = set(os.sched_getaffinity(0))
    keep = now - bad
    if not bad & now or not keep:
        return None
    os.sched_setaffinity(0, keep)
    if not quiet:
        print(f"watcher: launching on CPUs {sorted(keep)}: CPUs {sorted(bad & now)} are quarantined on this node "
              f"({ledger.quarantine_file})", file=sys.stderr)
    return now


def _off_quarantined_gpus(node: health.Ledger, quiet: bool) -> str | None:
    """CUDA_VISIBLE_DEVICES (by UUID) without the GPUs the node quarantined,
    or None to leave the job's own; refused when none would be left."""
    value, left_out = health.visible_gpus(node.quarantined(), health.nvml_devices(),
                                          os.environ.get("CUDA_VISIBLE_DEVICES"))
    if value is None:
        return None
    if not value:
        raise NodeUnusable(f"every GPU this job would use is quarantined on this node ({', '.join(left_out)}); "
                           f"see `watcher health --health-dir {node.node_dir}`")
    if not quiet:
        print(f"watcher: launching without GPUs {', '.join(left_out)} (quarantined on this node, "
              f"{node.quarantine_file}): CUDA_VISIBLE_DEVICES={value}", file=sys.stderr)
    return value


def _health_signals(ledger: health.Ledger, run_dir: RunDir, before: dict | None) -> dict | None:
    """The node's device signals (NVML, EDAC) into the ledger at the run's start and end."""
    try:
        events, state = health.signal_events(str(run_dir.root), before)
        for ev in events:
            ledger.add(ev)
        return state
    except Exception as e:  # health signals never stop a run
        print(f"watcher: device health signals not read: {e}", file=sys.stderr)
        return None


def audit_summary(run_dir: RunDir, steps: int, job_s: float) -> dict | None:
    """The background SDC audit's account of the run (runtime/audit.py), kept as DIR/audit.json."""
    summary = summarize_audits(run_dir, steps)
    if summary is None:
        return None
    ranks = max(len(run_dir.logged_ranks()), 1)
    summary["job_s"] = round(job_s, 1)
    # Each rank's audit replays against each rank's time in the job.
    summary["cost_share"] = round(summary["cpu_s"] / (ranks * job_s), 5) if job_s > 0 else None
    try:
        write_json(run_dir.audit_summary, summary)
    except OSError:
        pass
    return summary


def summarize_audits(run_dir: RunDir, steps_run: int) -> dict | None:
    """The audits of a run, from every rank's log: windows, coverage, cost, findings."""
    lines = read_audit_logs(run_dir)
    if not lines:
        return None
    by_audit: dict[int, list[dict]] = {}
    for e in lines:
        by_audit.setdefault(e["audit"], []).append(e)
    audited = set()
    for entries in by_audit.values():
        if all(e["status"] in ("clean", "mismatch") for e in entries):
            audited.update(range(entries[0]["from_step"] + 1, entries[0]["to_step"] + 1))
    return {"audits": len(by_audit),
            "clean": sum(all(e["status"] == "clean" for e in es) for es in by_audit.values()),
            "mismatched": sum(any(e["status"] == "mismatch" for e in es) for es in by_audit.values()),
            "failed": sum(any(e["status"] == "failed" for e in es) for es in by_audit.values()),
            "skipped": sum(any(e["status"] == "skipped" for e in es) for es in by_audit.values()),
            "ranks_audited": sorted({e["rank"] for e in lines if e["status"] in ("clean", "mismatch")}),
            "steps_audited": len(audited), "steps_run": steps_run,
            "coverage": round(len(audited) / steps_run, 4) if steps_run else None,
            "cpu_s": round(sum(e.get("cpu_s") or 0 for e in lines), 3)}


def read_audit_logs(run_dir: RunDir) -> list[dict]:
    """Every rank's audit lines (runtime/audit.py); a line still being written is skipped."""
    lines = []
    for r in run_dir.logged_ranks():
        p = run_dir.audit_log(r)
        if p.exists():
            for line in p.read_text().splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:
                    continue
    return lines


def describe_audit(a: dict) -> str:
    found = (f"{a['mismatched']} departed from the record (see the sdc incidents)" if a["mismatched"]
             else "every one matched the record")
    return (f"watcher: SDC audit: {a['audits']} window(s), {a['steps_audited']} of {a['steps_run']} steps "
            f"({100 * (a['coverage'] or 0):.1f}%) re-executed off the training path; {found}"
            + (f"; {a['failed']} could not run" if a["failed"] else "")
            + (f"; {a['skipped']} skipped for an incident" if a.get("skipped") else "")
            + (f"; {a['cpu_s']:.1f} CPU-s, {100 * a['cost_share']:.2f}% of the ranks' time" if a.get("cost_share")
               is not None else ""))


def _window_dir(run_dir: RunDir) -> Path:
    """Replay windows go to tmpfs (/dev/shm) when there is one: no disk writeback."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 << 30:
        return Path(tempfile.mkdtemp(prefix=f"watcher-window-{run_dir.root.name}-", dir=shm))
    return run_dir.runtime


def describe(inc: dict) -> str:
    rep = inc.get("replay") or {}
    if inc["kind"] == "replay_check":
        w = inc.get("window") or {}
        if w.get("from_step") is None:
            return f"watcher: replay check at step {inc['detected_step']}: no snapshot to replay from"
        return (f"watcher: replay check of steps {w['from_step'] + 1}..{w['to_step']}: "
                + ("every step fingerprint and collective checksum matched the record" if rep.get("exact")
                   else f"DIFFERS from the record (first divergence {rep.get('first_divergence')})"))
    if inc["kind"] == "stall":
        d = inc.get("detail") or {}
        w = d.get("where") or {}
        return (f"watcher: {inc['incident_id']}: stall: rank {inc['detected_rank']} made no progress in step "
                f"{inc['detected_step']} for {d.get('no_progress_s')} s ({d.get('times_median')}x the median step)"
                + (f" at {w['training_line']}" if w.get("training_line") else "")
                + (f", in {w['syscall']}" if w.get("syscall") else "")
                + (f"; went on after {d['stalled_s']} s" if d.get("stalled_s") is not None else "; never went on"))
    if inc["kind"] == "straggler":
        d = inc.get("detail") or {}
        return (f"watcher: {inc['incident_id']}: straggler: rank {inc['detected_rank']} at step "
                f"{inc['detected_step']}: {d.get('own_ms')} ms of its own per step against its peers' "
                f"{d.get('peers_own_ms')} ms ({d.get('ratio')}x)")
    div = rep.get("first_divergence")
    where = ""
    if div:
        c = div.get("collective") or {}
        where = (f"; first divergence on rank {div['rank']} at step {div['step']}"
                 + (f", {c.get('op')} #{c.get('seq')}" if c else "") + f" ({div['where']})")
    elif inc["kind"] == "crash" and (inc.get("detail") or {}).get("where"):
        where = f"; died at {inc['detail']['where']}" + (
            "; the replay died at the same place" if rep.get("same_site") else "")
    elif (rep.get("stall") or {}).get("outside_collective"):
        s = rep["stall"]
        w = s.get("where") or {}
        where = (f"; rank {s['rank']} stuck outside any collective in step {s['step']}"
                 + (f" at {w['training_line']}" if w.get("training_line") else "")
                 + (f", in {w['syscall']}" if w.get("syscall") else ""))
    elif rep.get("stall"):
        s = rep["stall"]
        where = f"; rank {s['rank']} entered {s['collective']['op']} #{s['collective']['seq']} at step {s['step']} {s['wait_s']} s late"
    return (f"watcher: {inc['incident_id']}: {inc['kind']} at step {inc['detected_step']} on rank "
            f"{inc['detected_rank']} -> {inc.get('classification') or 'unclassified'}"
            + (f" ({inc['transient_cause']})" if inc.get("transient_cause") else "") + where)


class _StatusLine:
    """One refreshing line on a terminal: step, ranks, incidents."""

    def __init__(self, out: Path):
        self.run_dir = RunDir(out)
        self.done = threading.Event()
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self) -> None:
        ctl = None
        while not self.done.wait(1.0):
            path = self.run_dir.control
            if ctl is None:
                if not path.exists() or path.stat().st_size < SIZE:
                    continue
                ctl = Control(self.run_dir.runtime)
            ranks = [ctl.latest_step(r) for r in range(64)]
            live = [s for s in ranks if s >= 0]
            n_inc = len(self.run_dir.incident_paths())
            if live:
                sys.stderr.write(f"\rwatcher: step {max(live)}  ranks {len(live)}  incidents {n_inc}   ")
                sys.stderr.flush()

    def stop(self) -> None:
        self.done.set()
        sys.stderr.write("\n")


# -- after the job ---------------------------------------------------------------------------

def _unfinished_incidents(run_dir: RunDir) -> None:
    """Incidents opened by a rank whose peers never reached the halt step (a
    hang that did not resolve, a rank killed meanwhile): written without a
    replay, with the recorder's view of where each rank was blocked."""
    for _, p in run_dir.opened_incidents():
        info = read_json(p)
        if run_dir.incident_path(info["incident_id"]).exists() or info.get("resolved"):
            continue  # written up, or recovered where it happened (on another node's rank, on many nodes)
        blocked = None
        try:
            with Recordings([run_dir.recording]) as recs:
                blocked = analyze_hang(recs)
        except Exception as e:  # the analysis is a bonus; the incident is written regardless
            blocked = {"error": str(e)}
        doc = Incident.opened(info["incident_id"], info["kind"], info["failing_step"], info["rank"],
                              info["detected_ts"], info.get("detail"), None, info["failing_step"],
                              info.get("unsupported")
                              or "the ranks never reached the halt step, so no window could be replayed")
        doc.recorder_view = blocked
        save_incident(run_dir, doc)


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def ingest(run_dir: RunDir) -> list[dict]:
    """Copy the runtime's logs, the incidents and the sandbox logs into the recording."""
    step_rows, coll_rows = [], []
    for r in run_dir.logged_ranks():
        for k, fp in sorted(run_dir.read_steps(r).items()):
            step_rows.append((r, k, fp["ts"], fp.get("dur"), fp.get("loss"), fp.get("grad_norm"),
                              fp.get("param_sum"), fp.get("batch_sum"), fp.get("rng"),
                              fp.get("n_coll"), fp.get("snapshot"), fp.get("watcher_us")))
        for (g, seq), c in sorted(run_dir.read_colls(r).items(), key=lambda kv: kv[1]["ts"]):
            coll_rows.append((r, g, seq, c["op"], c["step"], c.get("numel"), c.get("dtype"), c.get("reduce_op"),
                              c.get("in_sum"), c.get("out_sum"), c.get("site"), c["ts"], c.get("dur")))
    incidents = [inc.to_dict() for inc in load_incidents(run_dir)]
    inc_rows = [incident_row(inc) for inc in incidents]
    chain_rows = [row for inc in incidents for row in causal_link_rows(inc)]
    sandbox_rows = []
    for inc in incidents:
        for rank, log in run_dir.incident_dir(inc["incident_id"]).sandbox_logs():
            with open(log) as f:
                for line in f:
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    sandbox_rows.append((inc["incident_id"], rank, e["ts"], e["pid"], e["syscall"], e.get("fd"),
                                         e["action"]))
    off_rows = [(r["rank"], r["reason"], r.get("ts")) for r in run_dir.refusals()]
    audit_rows = [(e["rank"], e["audit"], e.get("from_step"), e.get("to_step"), e["status"], e.get("steps"),
                   json.dumps(e["mismatched_steps"]) if e.get("mismatched_steps") else None, e.get("cpu_s"),
                   e.get("wall_s"), e.get("error"), e.get("ts")) for e in read_audit_logs(run_dir)]
    health_rows = [(e.get("ts"), e["kind"], e.get("device"), e.get("rank"), e.get("step"), e.get("incident_id"),
                    json.dumps(e.get("detail"), default=str) if e.get("detail") is not None else None)
                   for e in health.read_events(run_dir.health_log)]
    write_run_tables(run_dir.recording, {"step": step_rows, "collective_io": coll_rows, "incident": inc_rows,
                                         "sandbox_event": sandbox_rows, "causal_link": chain_rows,
                                         "protection": off_rows, "audit": audit_rows, "health_event": health_rows})
    return incidents
