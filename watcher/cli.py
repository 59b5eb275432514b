"""The `watcher` command: thin wiring over the library.

Every command builds a validated config object and calls the library; every
failure is a WatcherError printed as one line with a nonzero exit code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .errors import RecordingError, UsageError, WatcherError

# Imports inside functions: each command imports the modules it runs inside its
# own function, not here: `watcher --help`, `watcher sql` and the other
# read-only commands then start fast and load neither bcc (recording) nor
# torch (replay, `watcher diagnose`).
app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Watcher records every rank of a distributed PyTorch job with eBPF, into DuckDB "
         "recordings you query with SQL.",
)

PROBES_HELP = ("Comma-separated probe set: syscall,futex,proc,signal,file (eBPF tracepoints) and "
               "libtorch,libtorch_cuda,libcudart,libnccl (uprobes from uprobes/*.toml). Default: all.")
OPS_HELP = ("Also probe PyTorch operators at::_ops::<op>::call whose op name matches this regex "
            "(opt-in: ~1.5-3 us a hit), e.g. 'mm|addmm|softmax'.")


def _parse_size(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise UsageError(f"bad size {text!r}: use e.g. 500M or 2G") from None


def _default_out(label: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in label)[:32] or "rec"
    return Path(f"watcher-{safe}-{time.strftime('%Y%m%d-%H%M%S')}.duckdb")


PY_STACKS_HELP = ("Record the calling thread's Python stack (file:line) with every library call, read "
                  "from outside the process (CPython 3.11). Columns api_call.py_stack and py_site.")


def _session_config(out, probes, duration, max_size, ring_minutes, live, label, ops=None, py_stacks=True):
    from .session import SessionConfig

    probe_list = tuple(p.strip() for p in probes.split(",") if p.strip()) if probes else None
    kw = {}
    if probe_list:
        kw["probes"] = probe_list
    return SessionConfig(out=Path(out) if out else _default_out(label), duration=duration,
                         max_size=_parse_size(max_size), ring_minutes=ring_minutes, live=live, ops=ops,
                         py_stacks=py_stacks, **kw)


@app.command(epilog="Examples:\n\n  sudo watcher attach --pid 1234\n\n"
                    "  sudo watcher attach --pid $(pgrep -f torchrun) --duration 60 --out hang.duckdb\n\n"
                    "  sudo watcher attach --pid 1234 --ring-minutes 5   # flight recorder; kill -USR1 to dump")
def attach(
    pid: int = typer.Option(..., "--pid", "-p", help="Process to record, with its threads and children."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Recording file (.duckdb)."),
    duration: Optional[float] = typer.Option(None, help="Stop after this many seconds."),
    probes: Optional[str] = typer.Option(None, help=PROBES_HELP),
    max_size: Optional[str] = typer.Option(None, help="Cap the recording (e.g. 500M); oldest events are pruned first."),
    ring_minutes: Optional[float] = typer.Option(None, help="Flight recorder: keep only the last N minutes in memory; write on SIGUSR1 and at exit."),
    live: bool = typer.Option(False, help="Show a live terminal view, refreshed every second."),
    ops: Optional[str] = typer.Option(None, help=OPS_HELP),
    py_stacks: bool = typer.Option(True, "--py-stacks/--no-py-stacks", help=PY_STACKS_HELP),
):
    """Record a running process tree until it exits or Ctrl-C."""
    from .session import Session

    cfg = _session_config(out, probes, duration, max_size, ring_minutes, live, f"pid{pid}", ops, py_stacks)
    Session(cfg).attach(pid)


@app.command(epilog="Examples:\n\n  sudo watcher record -- python train.py\n\n"
                    "  sudo watcher record --out run.duckdb -- torchrun --nproc_per_node=2 train.py")
def record(
    cmd: list[str] = typer.Argument(..., help="Command to launch and record, after --."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Recording file (.duckdb)."),
    duration: Optional[float] = typer.Option(None, help="Stop recording after this many seconds (the command keeps running)."),
    probes: Optional[str] = typer.Option(None, help=PROBES_HELP),
    max_size: Optional[str] = typer.Option(None, help="Cap the recording (e.g. 500M); oldest events are pruned first."),
    ring_minutes: Optional[float] = typer.Option(None, help="Flight recorder: keep only the last N minutes in memory."),
    live: bool = typer.Option(False, help="Show a live terminal view, refreshed every second."),
    ops: Optional[str] = typer.Option(None, help=OPS_HELP),
    py_stacks: bool = typer.Option(True, "--py-stacks/--no-py-stacks", help=PY_STACKS_HELP),
):
    """Launch a command and record it from its first instruction. Exits with the command's exit code."""
    from .session import Session

    cfg = _session_config(out, probes, duration, max_size, ring_minutes, live, Path(cmd[0]).name, ops,
                          py_stacks)
    result = Session(cfg).record(list(cmd))
    raise typer.Exit(result.target_exit or 0)


@app.command(epilog="Examples:\n\n  watcher sql run.duckdb \"SELECT * FROM top_syscall LIMIT 10\"\n\n"
                    "  watcher sql node0.duckdb node1.duckdb \"SELECT recording, count(*) FROM syscall GROUP BY 1\"\n\n"
                    "  echo 'SELECT * FROM blocked_thread' | watcher sql run.duckdb - --format json")
def sql(
    args: list[str] = typer.Argument(..., metavar="REC... [QUERY|-]",
                                     help="One or more recordings, then the query ('-' reads it from stdin)."),
    format: str = typer.Option("table", "--format", "-f", help="table, csv or json."),
):
    """Run SQL over one or more recordings as one database."""
    from .query import format_rows, split_recordings_and_query
    from .store import Recordings

    if format not in ("table", "csv", "json"):
        raise UsageError(f"unknown --format {format!r}: use table, csv or json")
    paths, query = split_recordings_and_query(args, sys.stdin)
    with Recordings(paths) as recs:
        cols, rows = recs.query(query)
    sys.stdout.write(format_rows(cols, rows, format))


@app.command()
def info(rec: list[str] = typer.Argument(..., help="Recording(s) to summarise.")):
    """Summarise a recording: target, time span, events per table, drops, processes."""
    from .query import summarise
    from .store import Recordings

    with Recordings(rec) as recs:
        sys.stdout.write(summarise(recs))


@app.command(epilog="Examples:\n\n  watcher analyze hang run.duckdb\n\n"
                    "  watcher analyze crash node0.duckdb node1.duckdb --format json")
def analyze(
    kind: str = typer.Argument(..., help="hang or crash"),
    rec: list[str] = typer.Argument(..., help="Recording(s) of the job (several nodes are merged)."),
    format: str = typer.Option("text", "--format", "-f", help="text or json."),
):
    """Which rank, stuck or dead where, in which collective, and who never arrived."""
    from .analysis.incidents import analyze_crash, analyze_hang, render_text
    from .store import Recordings

    if kind not in ("hang", "crash"):
        raise UsageError(f"unknown analysis {kind!r}: use hang or crash")
    if format not in ("text", "json"):
        raise UsageError(f"unknown --format {format!r}: use text or json")
    with Recordings(rec) as recs:
        report = analyze_hang(recs) if kind == "hang" else analyze_crash(recs)
    sys.stdout.write(json.dumps(report, default=str, indent=2) + "\n" if format == "json" else render_text(report))


@app.command(epilog="Examples:\n\n  watcher report run1\n\n  watcher report run1/recording.duckdb --html run1.html")
def report(
    rec: list[str] = typer.Argument(..., help="Run directory or recording(s)."),
    html: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML page here."),
):
    """Incidents of a run: verdict, attribution, causal chain, prescription; optionally as an HTML page with plots."""
    from .report import report as make_report

    sys.stdout.write(make_report(rec, Path(html) if html else None))
    if html:
        print(f"wrote {html}", file=sys.stderr)


@app.command(epilog="Examples:\n\n  watcher diagnose run1\n\n  watcher diagnose run1 --incident inc-0001 --format json")
def diagnose(
    run_dir: str = typer.Argument(..., help="Run directory of a `watcher run` that stopped on a persistent incident."),
    incident: Optional[str] = typer.Option(None, "--incident", help="Incident id (default: the one the snapshots were kept for)."),
    format: str = typer.Option("text", "--format", "-f", help="text or json."),
):
    """Diagnose a persistent incident again from its retained snapshots (kept `watcher run --retain` seconds
    after the run) and compare the verdict and causal chain with the run's own."""
    from .replay.rediagnose import rediagnose

    if format not in ("text", "json"):
        raise UsageError(f"unknown --format {format!r}: use text or json")
    doc = rediagnose(Path(run_dir), incident, say=lambda m: print(f"watcher: {m}", file=sys.stderr, flush=True))
    if format == "json":
        sys.stdout.write(json.dumps(doc, default=str, indent=2) + "\n")
        return
    a, p = doc["attribution"], doc["prescription"]
    lines = [f"{doc['incident_id']}: {a['cause']} (confidence {a['confidence']}), replayed steps "
             f"{doc['from_step']}..{doc['to_step']} in {doc['diagnosis_s']} s",
             f"  prescription: {p['action']}"]
    lines += [f"  {i + 1}. {link['kind']}: {link['evidence']}" for i, link in enumerate(doc["causal_chain"])]
    if doc["same_as_recorded"] is None:
        lines.append("  (the run recorded no diagnosis to compare with)")
    elif doc["same_as_recorded"]:
        lines.append("  same verdict, causal chain and prescription as the run's diagnosis")
    else:
        lines += ["  DIFFERS from the run's diagnosis:"] + [f"    {d}" for d in doc["differences"]]
    lines.append(f"  details: {doc['out']}")
    print("\n".join(lines))


@app.command(epilog="Examples:\n\n  watcher release run1")
def release(run_dir: str = typer.Argument(..., help="Run directory whose retained snapshots to end.")):
    """End a run's retained snapshots now (they end by themselves after `watcher run --retain` seconds)."""
    from .replay.rediagnose import release as release_snapshots

    ended = release_snapshots(Path(run_dir))
    print(f"released the snapshots of ranks {ended}" if ended else "no retained snapshot was alive", file=sys.stderr)


@app.command(epilog="Examples:\n\n  watcher export run1 --perfetto run1.pftrace   (open it in ui.perfetto.dev)\n\n"
                     "  watcher export node0 node1 --perfetto job.pftrace   (a job over two nodes, one trace)\n\n"
                     "  watcher export run1 --perfetto run1.json --format json   (Chrome Trace Event JSON)")
def export(
    rec: list[str] = typer.Argument(..., help="Run directory or recording(s)."),
    perfetto: Optional[str] = typer.Option(None, "--perfetto", help="Write a trace Perfetto UI opens."),
    fmt: str = typer.Option("proto", "--format", help="proto: Perfetto's protobuf trace, every call, streamed; "
                            "json: Chrome Trace Event JSON (larger, capped at 500,000 calls)."),
):
    """Export a recording as a trace: ranks as processes, steps and collectives as slices, syscalls on threads."""
    from .perfetto_trace import export as export_proto
    from .trace_export import export as export_json

    if not perfetto:
        raise UsageError("say what to export: --perfetto FILE")
    if fmt not in ("proto", "json"):
        raise UsageError(f"unknown --format {fmt!r}: proto or json")
    if fmt == "json":
        got = export_json(rec, Path(perfetto))
        print(f"wrote {perfetto}: {got['events']} slices"
              + (f" ({got['syscalls_left_out']} syscalls left out)" if got["syscalls_left_out"] else ""),
              file=sys.stderr)
        return
    got = export_proto(rec, Path(perfetto))
    print(f"wrote {perfetto}: {got['syscalls']:,} system calls, {got['futex_waits']:,} futex waits, "
          f"{got['steps']:,} steps, {got['collectives']:,} collectives ({Path(perfetto).stat().st_size / 1e6:.1f} MB)",
          file=sys.stderr)


@app.command()
def check(pid: Optional[int] = typer.Option(None, "--pid", help="Also look for libtorch/libcudart/libnccl in this process.")):
    """Readiness check: kernel, BTF, tracefs, bcc, privileges, libraries, GPUs; names the fix for each failure."""
    from .readiness import run_checks

    results = run_checks(pid)
    width = max(len(r.name) for r in results)
    for r in results:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}[r.status]
        line = f"[{mark}] {r.name:<{width}}  {r.detail}"
        if r.fix and r.status != "ok":
            line += f"\n       fix: {r.fix}"
        print(line)
    if any(r.status == "fail" for r in results):
        raise typer.Exit(1)


@app.command(epilog="Examples:\n\n  sudo watcher run -- torchrun --nproc_per_node=2 train.py\n\n"
                    "  sudo watcher run --policy observe --out run1 -- python train.py\n\n"
                    "  sudo watcher run --no-rescue -- torchrun --nproc_per_node=8 train.py\n\n"
                    "  sudo watcher run --snapshot-budget 5 --detect hang_seconds=60 -- torchrun --nproc_per_node=8 train.py\n\n"
                    "  watcher sql run1/recording.duckdb \"SELECT * FROM incident\"")
def run(
    cmd: list[str] = typer.Argument(..., help="Training command, after --."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run directory (created; must not exist)."),
    policy: str = typer.Option("recover", help="After an incident's verdict: observe (go on untouched); "
                               "recover (a transient: merge the replayed state or rebuild the failed link "
                               "and go on; a persistent fault: diagnose it, then stop cleanly, exit 75); apply (as "
                               "recover, and apply a prescription a counterfactual replay proved: skip the bad "
                               "samples, adjust lr/clipping, move off bad CPUs; then go on)."),
    snapshot_budget: float = typer.Option(1.0, help="Snapshot cost budget, percent of step time; sets the snapshot interval."),
    snapshot_interval: Optional[int] = typer.Option(None, help="Fixed snapshot interval in steps (overrides the budget)."),
    copy_interval: Optional[int] = typer.Option(None, help="Fixed interval in steps of the state copies taken between "
                                                "snapshots, which shorten replay windows (0: none; default: half the budget)."),
    detect: list[str] = typer.Option([], help="Detector setting KEY=VALUE (repeatable), e.g. loss_spike_z=10, hang_seconds=60."),
    replay_check: Optional[int] = typer.Option(None, help="At this step, replay the window on purpose and report whether it matches the record exactly."),
    audit_budget: float = typer.Option(0.5, help="Background SDC audit: percent of the job's time spent re-executing recent windows off the training path and comparing them with the record (0 turns it off; above 100, every window is audited, for drills: the audit then competes with training for CPU)."),
    retain: float = typer.Option(300.0, help="Seconds a persistent incident's frozen snapshots outlive the run, for "
                                 "`watcher diagnose` (0: none; `watcher release` frees them sooner)."),
    preflight: bool = typer.Option(False, "--preflight", help="First try the job for a few steps (`watcher preflight`); "
                                   "launch only if nothing would fail."),
    health_dir: Optional[str] = typer.Option(None, "--health-dir", help="The node's device health ledger, shared by "
                                             "every run on the node: failures count across jobs, quarantined cores "
                                             "are left out of the launch, a node marked unusable refuses it (exit 8)."),
    rescue: bool = typer.Option(True, "--rescue/--no-rescue", help="A rank that dies (a signal, an OOM kill, an "
                                "error exit) is replaced while the job runs: every rank resumes from its last snapshot "
                                "on a rebuilt transport, and the launcher (torchrun) never sees the death. On by default "
                                "under the recover and apply policies, on one node; --no-rescue lets a death end the job "
                                "(it is then replayed and judged after the job)."),
):
    """Run a training command with recording, in-rank capture, snapshots, detectors and replay."""
    from .run import RunConfig, parse_detect, run as run_job

    if preflight:
        from .preflight import PreflightConfig, print_progress, run_preflight

        report = run_preflight(PreflightConfig(cmd=list(cmd)), progress=print_progress)
        print(report.text(), file=sys.stderr)
        if report.exit_code:
            print("watcher: not launched: fix what preflight found first", file=sys.stderr)
            raise typer.Exit(report.exit_code)

    cfg = RunConfig(cmd=list(cmd), out=Path(out) if out else Path(f"watcher-run-{time.strftime('%Y%m%d-%H%M%S')}"),
                    policy=policy, snapshot_budget=snapshot_budget, snapshot_interval=snapshot_interval,
                    copy_interval=copy_interval, detect=parse_detect(detect), replay_check=replay_check, retain_s=retain,
                    audit_budget=audit_budget, health_dir=Path(health_dir) if health_dir else None, rescue=rescue)
    result = run_job(cfg)
    print(f"Run directory {result.out}: {result.steps} steps recorded, {len(result.incidents)} incident(s). "
          f"Query: watcher sql {result.recording} \"SELECT * FROM step\"", file=sys.stderr)
    raise typer.Exit(result.exit_code)


@app.command(epilog="Examples:\n\n  watcher preflight -- torchrun --nproc_per_node=8 train.py\n\n"
                    "  watcher preflight --steps 50 --json preflight.json -- python train.py\n\n"
                    "  sudo watcher run --preflight -- torchrun --nproc_per_node=8 train.py")
def preflight(
    cmd: list[str] = typer.Argument(..., help="Training command, after --."),
    steps: int = typer.Option(20, help="Steps to try before stopping the job."),
    timeout: float = typer.Option(300.0, help="Seconds the try may take."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Keep the job's output and the ranks' reports in "
                                      "this directory (created; must not exist)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
):
    """Try the job for a few steps and report what would fail or be slow: memory against the limit (with the
    largest batch that fits), CPU oversubscription, DataLoader workers, precision, devices, the link's
    bandwidth. Exit 1 if anything would fail the run.  Needs no privileges."""
    from .preflight import PreflightConfig, print_progress, run_preflight

    report = run_preflight(PreflightConfig(cmd=list(cmd), steps=steps, timeout_s=timeout,
                                           out=Path(out) if out else None), progress=print_progress)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    print(report.text())
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1))
    raise typer.Exit(report.exit_code)


@app.command(epilog="Examples:\n\n  sudo watcher drill\n\n  sudo watcher drill --scenario grad_bitflip\n\n"
                    "  sudo watcher drill --scenario all --json drills.json\n\n"
                    "  sudo watcher drill --ranks 4 --scenario grad_bitflip,bad_op")
def drill(
    scenario: str = typer.Option("all", help="Scenario name, or all."),
    steps: int = typer.Option(24, help="Steps of the reference workload per run."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Directory for the runs (created)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the scorecard as JSON here."),
    retain: float = typer.Option(15.0, min=0, max=86400, help="Seconds a persistent scenario's snapshots outlive its run (watcher diagnose DIR/SCENARIO)."),
    ranks: int = typer.Option(2, help="Ranks of the reference workload (faults are injected on rank 1)."),
):
    """Inject faults into the reference workload and score detection, localisation and verdict."""
    from .drill import run_drills

    raise typer.Exit(run_drills(scenario, steps, Path(out) if out else Path(f"watcher-drill-{time.strftime('%Y%m%d-%H%M%S')}"),
                                Path(json_out) if json_out else None, retain, ranks))


@app.command()
def schema(markdown: bool = typer.Option(True, help="Print docs/schema.md.")):
    """Print the recording schema (tables, columns and views, with their docs)."""
    from .schema import markdown as md

    sys.stdout.write(md())


@app.command(epilog="Examples:\n\n  watcher health --health-dir /var/lib/watcher/health\n\n"
                    "  watcher health run1\n\n"
                    "  watcher health --health-dir /var/lib/watcher/health --gate   (in a Slurm prolog: exit 8 drains the node)\n\n"
                    "  watcher health --health-dir /var/lib/watcher/health --clear cpu3@node7")
def health(
    run_dir: Optional[str] = typer.Argument(None, help="A run directory (its own ledger); default: the node's, --health-dir."),
    health_dir: Optional[str] = typer.Option(None, "--health-dir", help="The node's health directory (as given to `watcher run --health-dir`)."),
    gate: bool = typer.Option(False, "--gate", help="Exit 8 when the node is marked unusable (for launch hooks)."),
    clear: Optional[str] = typer.Option(None, "--clear", help="Take a device (or 'all') off the node's quarantine, once repaired; also clears the unusable mark."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """The device health ledger: failures pinned on each device, signals, the quarantine list, the breaker."""
    from . import health as h
    from .errors import NodeUnusable
    from .rundir import RunDir

    if (run_dir is None) == (health_dir is None):
        raise UsageError("give a run directory or --health-dir (one of them)")
    if clear is not None and health_dir is None:
        raise UsageError("--clear acts on a node's ledger: give --health-dir")
    if run_dir is not None:
        if not RunDir(Path(run_dir)).manifest.exists():
            raise RecordingError(f"{run_dir} is not a watcher run directory (no manifest)")
        ledger, where = h.Ledger(Path(run_dir)), run_dir
    else:
        if not Path(health_dir).is_dir():
            raise UsageError(f"{health_dir}: no such health directory")
        ledger, where = h.Ledger(None, Path(health_dir)), f"this node ({health_dir})"
    if clear is not None:
        gone = h.clear(ledger, clear)
        print(f"cleared: {', '.join(gone)}" if gone else f"nothing to clear for {clear}", file=sys.stderr)
    s = h.summary(ledger)
    print(json.dumps(s, indent=1, default=str) if as_json else h.describe(s, where))
    if gate and s["unusable"]:
        raise NodeUnusable(f"node unusable: {s['unusable'].get('reason')}")


@app.command(epilog="Examples:\n\n  sudo watcher agent --root /var/lib/watcher/agent\n\n"
                    "  sudo watcher agent --root /var/lib/watcher/agent --parquet /shared/watcher --ring-minutes 30\n\n"
                    "  curl -s localhost:9464/metrics | grep watcher_rank_step_seconds\n\n"
                    "  curl -s -X POST 'localhost:9464/keep?job=train-4242'   (keep a job's last minutes now)\n\n"
                    "  sudo kill -USR1 $(pgrep -f 'watcher agent')            (keep every running job)")
def agent(
    root: str = typer.Option("/var/lib/watcher/agent", "--root", help="Where kept recordings go: ROOT/<job>/<time>-<reason>.duckdb, and ROOT/agent.json."),
    ring_minutes: float = typer.Option(10.0, "--ring-minutes", help="Each job's last minutes kept in memory."),
    ring_max_size: str = typer.Option("256M", "--ring-max-size", help="Cap on the in-memory ring (all jobs together); the oldest rows go first."),
    listen: str = typer.Option("127.0.0.1:9464", "--listen", help="HOST:PORT of /metrics, /jobs and POST /keep. Off loopback it needs --token."),
    token: Optional[str] = typer.Option(None, "--token", envvar="WATCHER_AGENT_TOKEN", help="Bearer token every HTTP request must carry."),
    match: Optional[str] = typer.Option(None, "--match", help="Only jobs whose command line matches this regex."),
    parquet: Optional[str] = typer.Option(None, "--parquet", help="Also export kept recordings to this Hive-partitioned Parquet tree (shared storage: fleet SQL)."),
    node: Optional[str] = typer.Option(None, "--node", help="This node's name in metrics and the Parquet tree (default: the host name)."),
    hang_seconds: float = typer.Option(300.0, "--hang-seconds", help="A job whose live ranks all call no collective for this long is kept as a hang."),
    keep_all: bool = typer.Option(False, "--keep-all", help="Keep every job's ring when it ends, not only failed ones."),
    scan_interval: float = typer.Option(0.5, "--scan-interval", help="Seconds between looks for new jobs."),
    health_dir: Optional[str] = typer.Option(None, "--health-dir", help="The node's device health ledger (as given to `watcher run --health-dir`), shown in the metrics."),
    probes: Optional[str] = typer.Option(None, help=PROBES_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log nothing but errors."),
):
    """Node agent: find and record every PyTorch training job on this node, always on, with Prometheus metrics."""
    from .agent.daemon import Agent, AgentConfig

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:9464")
    size = _parse_size(ring_max_size)
    cfg = AgentConfig(root=Path(root), ring_minutes=ring_minutes, ring_max_bytes=size, host=host.strip("[]"),
                      port=int(port), token=token, match=match, parquet=Path(parquet) if parquet else None,
                      hang_s=hang_seconds, keep_all=keep_all, scan_interval=scan_interval, quiet=quiet,
                      health_dir=Path(health_dir) if health_dir else None,
                      probes=tuple(probes.split(",")) if probes else AgentConfig.probes)
    if node:
        cfg.node = node
    raise typer.Exit(Agent(cfg).run())


@app.command()
def demo(
    steps: int = typer.Option(30, help="Training steps of the reference workload."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run directory (created)."),
):
    """`watcher run` on the bundled reference workload (2-rank DDP over gloo), with a replay check; show what was captured."""
    from .demo import run_demo

    raise typer.Exit(run_demo(steps, Path(out) if out else Path(f"watcher-demo-{time.strftime('%Y%m%d-%H%M%S')}")))


def main() -> None:
    try:
        # Without standalone mode, typer returns the code of typer.Exit.
        code = app(standalone_mode=False)
    except WatcherError as e:
        print(f"watcher: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # typer/click usage errors and exits
        code = getattr(e, "exit_code", None)
        if code is not None and type(e).__name__ == "Exit":
            sys.exit(code)
        show = getattr(e, "show", None)
        if show is not None and hasattr(e, "format_message"):
            print(f"watcher: {e.format_message()}", file=sys.stderr)
            sys.exit(2)
        if type(e).__name__ == "Abort":
            sys.exit(130)
        raise
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
