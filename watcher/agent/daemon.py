"""`watcher agent`: one privileged process per node records every training job on it.

One set of BPF programs for the whole node: a job found by discovery.py is
added to the kernel's traced set (which then follows its forks), and every
job's events go to one in-memory ring bounded by time and size.  Nothing in
the jobs changes and nothing restarts them.

When something goes wrong the agent keeps the job's part of the ring as a
recording of its own (keep.py): a rank that dies by a signal or an error
exit (kept once the job has ended, or after a few seconds), a job whose
ranks all stop calling collectives for the hang limit, SIGUSR1 to the agent
(every running job), or `POST /keep?job=ID` on the metrics port.  A job
that ends well is not kept unless --keep-all.

State a restarted agent needs is in the processes themselves: it finds the
running jobs again on its first scan.  What it had in memory (the ring) is
gone with it; recordings it kept are complete files.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..bpf.recorder import ALL_PROBES, DEFAULT_RING_PAGES, KernelRecorder, RecorderConfig
from ..collector import Collector, monotonic_ns
from ..errors import UsageError
from ..privileges import explain_compile_failure, require_bcc, require_bpf_privileges
from ..session import _descendants, _ppid
from ..store import RecordingWriter
from ..uprobes.preattach import PREATTACH
from .discovery import LAUNCHER_MODULES, Discovery, Found
from .keep import export_parquet, keep_job, safe_name
from .metrics import WINDOW_NS, MetricsServer, SnapshotCollector, collective_counts, is_loopback, rank_numbers, \
    self_usage

# Kernel rings a quarter of `watcher record`'s (those are sized for syscall
# storms of 1.3 M/s): the syscall ring still holds ~87k records, 0.1 s of
# 870k/s, and the agent's memory is counted on every node.  Drops are counted
# and exported (watcher_agent_dropped_events_total) as always.
AGENT_RING_PAGES = {ring: max(64, pages // 4) for ring, pages in DEFAULT_RING_PAGES.items()}
HEALTH_EVERY_S = 10.0
# Probed ahead, from the agent's own environment: libtorch (a job's first
# collectives come within seconds of its load) and what preattach.py names.
AHEAD = PREATTACH | {"libtorch"}
BUSY_POLL_S, IDLE_POLL_S = 0.1, 0.5  # the ledger and NVML are read this often
CRASH_SETTLE_S = 3.0   # after a rank dies, how long the rest of the job gets to go down before the keep


@dataclass
class AgentConfig:
    root: Path                          # kept recordings: ROOT/<job>/<time>-<reason>.duckdb
    ring_minutes: float = 10.0
    ring_max_bytes: int = 256 << 20
    host: str = "127.0.0.1"
    port: int = 9464
    token: str | None = None
    match: str | None = None            # regex over the command line: only these jobs
    parquet: Path | None = None         # also export kept recordings to this tree
    node: str = field(default_factory=socket.gethostname)
    scan_interval: float = 0.5
    hang_s: float = 300.0
    keep_all: bool = False              # keep every job's ring at its end, not only failures
    forget_after_s: float = 300.0       # an ended job stays in the metrics this long
    probes: tuple[str, ...] = ALL_PROBES
    health_dir: Path | None = None      # the node's device health ledger (`watcher run --health-dir`)
    quiet: bool = False

    def validate(self) -> None:
        if self.ring_minutes <= 0:
            raise UsageError("--ring-minutes must be positive")
        if self.ring_max_bytes < 1 << 20:
            raise UsageError("--ring-max-size must be at least 1M")
        if self.scan_interval <= 0 or self.hang_s <= 0:
            raise UsageError("--scan-interval and --hang-seconds must be positive")
        if not is_loopback(self.host) and not self.token:
            raise UsageError(f"--listen {self.host} is reachable from other machines: give --token "
                             "(or WATCHER_AGENT_TOKEN), or listen on 127.0.0.1")
        unknown = [p for p in self.probes if p not in ALL_PROBES]
        if unknown:
            raise UsageError(f"unknown probe {unknown[0]!r}; choose from {','.join(ALL_PROBES)}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot use --root {self.root}: {e.strerror}") from None
        if not os.access(self.root, os.W_OK):
            raise UsageError(f"cannot use --root {self.root}: not writable")


@dataclass
class Job:
    found: Found
    id: str
    roots: list                         # upids of its root processes: the launcher, or each rank a scheduler started
    started_wall: float
    state: str = "running"
    ended_mono: float | None = None
    incidents: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)
    pending_keep: str | None = None     # a reason to keep, once settled
    keep_at: float | None = None
    hang_open: bool = False
    collectives: dict = field(default_factory=dict)  # upid -> running total
    last_collective: dict = field(default_factory=dict)  # upid -> ts of its latest collective (the ring may have pruned it)

    def kept_for(self, reason: str) -> bool:
        return any(k.endswith(f"-{safe_name(reason)}.duckdb") for k in self.kept)

    def doc(self, ranks: list[dict]) -> dict:
        return {"id": self.id, "pid": self.found.pid, "kind": self.found.kind, "run_id": self.found.run_id,
                "cmdline": self.found.cmdline, "started": self.started_wall, "state": self.state,
                "incidents": {k: v for k, v in self.incidents.items() if k != "_keys"}, "kept": list(self.kept), "ranks": ranks}


class AgentCollector(Collector):
    """The collector, with library probes attached off the recording loop.

    Attaching to a library the first time resolves its symbols (seconds for
    libtorch_cpu.so): done inline it would stall discovery, the flushes and
    the metrics of every other job on the node.  A worker thread attaches
    instead; the kernel probes start missing nothing they can see, since the
    traced set already holds the job (only calls made before the attach are
    not seen, as with `watcher attach`)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._scan_q: queue.Queue = queue.Queue()
        self._scanner = threading.Thread(target=self._scan_worker, name="watcher-attach", daemon=True)
        self._scanner.start()

    def _scan_worker(self) -> None:
        while True:
            pids = self._scan_q.get()
            if pids is None:
                return
            try:
                if pids == "ahead":
                    self._ahead()
                else:
                    self._scan(pids)
            except Exception as e:  # a library we cannot probe must not stop the agent
                if self.on_warning:
                    self.on_warning(f"warning: cannot probe libraries of {pids}: {e}")
            shed_compiler_memory()  # resolving a library's symbols leaves heap behind

    def attach_ahead(self) -> None:
        """Probe the libraries of the agent's own Python environment before
        any job needs them (uprobes live on files: every process that maps
        them is covered).  A job from that environment then has its first
        collectives seen even when it calls them within the seconds an attach
        to libtorch takes; one from another environment is probed when it
        loads its libraries, as before."""
        self._scan_q.put("ahead")

    def _ahead(self) -> None:
        self.preattach_libraries([sys.executable], dict(os.environ), AHEAD)

    def scan_later(self, pids: list[int]) -> None:
        self._scan_q.put(list(pids))

    def scan_libraries(self) -> None:
        self.scan_later([p.pid for p in self.model.processes if p.end_ts is None])

    def _scan_loaded(self) -> None:
        with self._pending_lock:
            pids, self._loaded_in = self._loaded_in, set()
        self.scan_later(sorted(pids))

    def close_scanner(self) -> None:
        self._scan_q.put(None)
        self._scanner.join(timeout=30)


class Agent:
    def __init__(self, config: AgentConfig):
        config.validate()
        require_bcc()
        require_bpf_privileges()
        self.config = config
        self.jobs: dict[str, Job] = {}
        self.metrics = SnapshotCollector()
        self.requests: queue.Queue = queue.Queue()
        self.discovery = Discovery(config.match, ignore={os.getpid()})
        self._next_scan = 0.0
        self._high_mark = -1
        self._stop = False
        self.server: MetricsServer | None = None
        self._health: dict = {}
        self._next_health = 0.0

    # -- running ------------------------------------------------------------
    def run(self) -> int:
        c = self.config
        try:
            self.recorder = KernelRecorder(RecorderConfig(probes=c.probes, ring_pages=AGENT_RING_PAGES))
        except Exception as e:  # bcc raises plain Exception on compile/attach failure
            raise explain_compile_failure(e) from None
        shed_compiler_memory()
        writer = RecordingWriter(c.root / "ring.duckdb", in_memory=True)
        self.collector = AgentCollector(self.recorder, writer, ring_window_ns=int(c.ring_minutes * 60e9),
                                   max_size=c.ring_max_bytes, on_flush=lambda _c: self._after_flush())
        self.collector.on_warning = self._say
        self.collector.attach_ahead()
        self.collector.write_start_meta(target_pid=None, cmdline="", mode="agent", probes=c.probes)
        self._after_flush()  # numbers from the first scrape on, the node's health among them
        try:
            self.server = MetricsServer(c.host, c.port, self.metrics, self._request_keep, c.token)
        except OSError as e:
            self.recorder.close()
            raise UsageError(f"cannot listen on {c.host}:{c.port}: {e.strerror}") from None
        self.server.start()
        old = {s: signal.signal(s, self._on_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: self.requests.put((None, "signal")))
        self._say(f"watcher agent on {c.node}: metrics on http://{c.host}:{self.server.port}/metrics, "
                  f"ring {c.ring_minutes:g} min / {c.ring_max_bytes >> 20} MiB, kept recordings in {c.root}")
        self._write_state()
        xids = None
        if c.health_dir is not None:  # a GPU's XID events reach the node's ledger as they happen
            from .. import health  # NVML is imported there, only when asked
            ledger = health.Ledger(None, c.health_dir)
            xids = health.XidListener(lambda x: ledger.add(health.xid_event(f"agent@{c.node}", x))).start()
            self._say(f"XID events: {xids.state}")
        try:
            self.collector.run(self._tick)
        finally:
            if xids is not None:
                xids.stop()
            for s, h in old.items():
                signal.signal(s, h)
            self.server.close()
            self.collector.close_scanner()
            self.recorder.close()
            self._say("watcher agent stopped")
        return 0

    def _on_stop(self, *_):
        self._stop = True
        self.collector.stop()

    def _say(self, msg: str) -> None:
        if not self.config.quiet:
            print(f"[agent] {msg}", file=sys.stderr, flush=True)

    def _tick(self) -> bool:
        """Between the collector's flushes: discovery, keep requests, job ends."""
        if self._stop:
            return True
        now = time.monotonic()
        if now >= self._next_scan:
            self._next_scan = now + self.config.scan_interval
            new = self.discovery.scan(now, self.recorder.is_traced)
            for found in new:
                self._follow(found)
            if new:
                self._after_flush()  # in /jobs and the metrics at once, not at the next flush
        while not self.requests.empty():
            job_id, reason = self.requests.get_nowait()
            for job in self._select(job_id):
                self._keep(job, reason)
        for job in list(self.jobs.values()):
            if job.keep_at is not None and now >= job.keep_at:
                self._keep(job, job.pending_keep)
                job.keep_at, job.pending_keep = None, None
        return False

    # -- jobs -----------------------------------------------------------------
    def _follow(self, found: Found) -> None:
        m = self.collector.model
        t0 = monotonic_ns()
        self.recorder.trace(found.pid)
        st = _ppid(found.pid)
        row = m.adopt_live(found.pid, st, t0)
        for child, parent in _descendants(found.pid):
            self.recorder.trace(child)
            m.adopt_live(child, parent, t0)
        self.collector.scan_later([found.pid] + [child for child, _ in _descendants(found.pid)])
        if found.kind == "rank" and found.run_id:
            # Ranks a scheduler started one by one (srun, a pod per rank): one job by its id.
            same = next((j for j in self.jobs.values() if j.found.kind == "rank" and j.state == "running"
                         and j.found.run_id == found.run_id), None)
            if same is not None:
                same.roots.append(row.upid)
                self._say(f"job {same.id}: rank process {found.pid} joins it")
                return
        stem = found.run_id or _script_name(found.cmdline)
        job = Job(found=found, id=safe_name(f"{stem}-{found.pid}"), roots=[row.upid], started_wall=time.time())
        self.jobs[job.id] = job
        self._say(f"found job {job.id} ({found.kind} pid {found.pid}): {found.cmdline[:100]}")
        self._write_state()

    def _members(self) -> dict[int, str]:
        """upid -> job id, for every process the model knows (a job is its
        root's tree: the launcher, its ranks, their forks)."""
        roots = {u: j.id for j in self.jobs.values() for u in j.roots}
        procs = self.collector.model.processes
        found: dict[int, str | None] = dict(roots)
        for p in procs:
            chain, u = [], p.upid
            while u is not None and u not in found and len(chain) < 64:
                chain.append(u)
                u = procs[u].parent_upid
            jid = found.get(u) if u is not None else None
            for v in chain:
                found[v] = jid
        return {u: j for u, j in found.items() if j is not None}

    def _select(self, job_id: str | None) -> list[Job]:
        if job_id is None:
            return [j for j in self.jobs.values() if j.state == "running"]
        return [j for j in self.jobs.values() if j.id == job_id]

    def _request_keep(self, job_id: str | None) -> tuple[bool, str]:
        """From the HTTP thread: queued for the recording loop."""
        if job_id is not None and job_id not in self.jobs:
            return False, f"no job {job_id!r} on this node"
        self.requests.put((job_id, "request"))
        return True, f"keeping {job_id or 'every running job'}"

    def _keep(self, job: Job, reason: str) -> Path | None:
        """Write the job's part of the ring to ROOT/<job>/<time>-<reason>.duckdb."""
        c = self.collector
        try:
            c.flush()
            upids = [u for u, j in self._members().items() if j == job.id]
            out = self.config.root / job.id / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe_name(reason)}.duckdb"
            n = 1
            while out.exists():
                out = out.with_name(f"{out.stem.split('~')[0]}~{n}.duckdb")
                n += 1
            p = self.collector.model.processes[job.roots[0]]
            keep_job(c.writer.con, out, upids, {
                "mode": "agent", "target_pid": job.found.pid, "target_cmdline": job.found.cmdline,
                "agent_job": job.id, "agent_node": self.config.node, "agent_reason": reason,
                "complete": "true", "end_ts": monotonic_ns(), "events": c.stats.total_events,
                "drops": c.stats.total_drops, "ring_minutes": self.config.ring_minutes,
                "job_exit_code": p.exit_code, "job_exit_signal": p.exit_signal},
                before_publish=lambda done: self._export(done, out, job))
        except Exception as e:  # a failed keep must not stop the recording of the others
            self._say(f"cannot keep {job.id}: {e}")
            return None
        job.kept.append(str(out))
        self._say(f"kept {job.id} ({reason}): {out}")
        self._write_state()
        return out

    def _export(self, rec: Path, name: Path, job: Job) -> None:
        """Into the Parquet tree, before the kept recording takes its name."""
        if self.config.parquet is None:
            return
        try:
            export_parquet(rec, self.config.parquet, self.config.node, job.id)
        except Exception as e:  # the recording is kept all the same
            self._say(f"cannot export {name} to {self.config.parquet}: {e}")

    # -- after each flush: job states, incidents, metrics --------------------
    def _after_flush(self) -> None:
        try:
            self._update()
        except Exception as e:  # numbers are never worth the recording
            self._say(f"metrics: {e}")

    def _update(self) -> None:
        c, m = self.collector, self.collector.model
        con = c.writer.con
        now_ns, now = monotonic_ns(), time.monotonic()
        members = self._members()
        busy = any(j.state == "running" or j.keep_at is not None for j in self.jobs.values())
        # Idle (no job on the node): the rings are polled 5 times less often,
        # and no query runs; the first fork or exec of a job is in the ring
        # within 0.5 s, before its first step.
        c.poll_interval = BUSY_POLL_S if busy else IDLE_POLL_S
        nums, new, latest = {}, {}, {}
        if self.jobs:
            nums = rank_numbers(con, now_ns - WINDOW_NS)
            new, latest, self._high_mark = collective_counts(con, self._high_mark)
        jobs_doc = []
        for job in list(self.jobs.values()):
            upids = [u for u, j in members.items() if j == job.id]
            ranks, dead = [], []
            for u in upids:
                p = m.processes[u]
                parent = m.processes[p.parent_upid] if p.parent_upid is not None else None
                if p.rank is None or (parent is not None and parent.rank is not None):
                    continue  # not a rank, or a rank's fork (DataLoader worker)
                job.collectives[u] = job.collectives.get(u, 0) + new.get(u, 0)
                if u in latest:
                    job.last_collective[u] = max(job.last_collective.get(u, 0), latest[u])
                d = nums.get(u, {})
                last = job.last_collective.get(u)
                ranks.append({"rank": p.rank, "pid": p.pid, "alive": p.end_ts is None,
                              "exit_code": p.exit_code, "exit_signal": p.exit_signal,
                              "collectives": job.collectives[u], "step_s": d.get("step_s"),
                              "latency_s": d.get("latency_s"),
                              "last_collective_age_s": None if last is None else (now_ns - last) / 1e9,
                              "syscalls": d.get("syscalls", 0), "syscall_s": d.get("syscall_s", 0.0),
                              "futex_s": d.get("futex_s", 0.0)})
                if p.end_ts is not None and (p.exit_signal is not None or p.exit_code not in (None, 0)):
                    dead.append(p)
            # The first to die names the keep: the launcher takes the others down after it.
            for p in sorted(dead, key=lambda p: p.end_ts):
                self._incident(job, "crash", f"crash-rank{p.rank}", once_key=f"crash:{p.pid}", now=now)
            ranks.sort(key=lambda r: r["rank"])
            self._check_hang(job, ranks, now)
            root = m.processes[job.roots[0]]
            alive = any(m.processes[u].end_ts is None for u in upids)
            if job.state == "running" and all(m.processes[u].end_ts is not None for u in job.roots) and not alive:
                job.state, job.ended_mono = "ended", now
                failed = any(m.processes[u].exit_signal is not None or m.processes[u].exit_code not in (None, 0)
                             for u in job.roots)
                self._say(f"job {job.id} ended ({_how(root)})")
                if failed:
                    self._incident(job, "job_failed", "job-failed", once_key="job_failed", now=now)
                if job.pending_keep is not None:
                    job.keep_at = now  # it has gone down: keep at once
                elif self.config.keep_all:
                    job.pending_keep, job.keep_at = "ended", now
                self._write_state()
            if job.state == "ended" and now - job.ended_mono > self.config.forget_after_s and job.keep_at is None:
                del self.jobs[job.id]
                continue
            jobs_doc.append(job.doc(ranks))
        usage = self_usage()
        if now >= self._next_health:
            self._next_health = now + HEALTH_EVERY_S
            self._health = node_health(self.config.health_dir)
        self.metrics.snapshot = {
            "jobs": jobs_doc, "health": self._health,
            "agent": {"node": self.config.node, "cpu_s": usage["cpu_s"], "rss_bytes": usage["rss_bytes"],
                      "ring_bytes": c.writer.used_bytes(), "ring_span_s": _span_s(con),
                      "events": c.stats.total_events, "drops": c.stats.total_drops}}

    def _incident(self, job: Job, kind: str, reason: str, *, once_key: str, now: float) -> None:
        seen = job.incidents.setdefault("_keys", [])
        if once_key in seen:
            return
        seen.append(once_key)
        job.incidents[kind] = job.incidents.get(kind, 0) + 1
        self._say(f"incident in {job.id}: {reason}")
        if job.pending_keep is None and not job.kept_for(reason):
            job.pending_keep = reason
            job.keep_at = now + CRASH_SETTLE_S if job.state == "running" else now

    def _check_hang(self, job: Job, ranks: list[dict], now: float) -> None:
        """Every live rank silent in collectives for the hang limit, having called them before."""
        live = [r for r in ranks if r["alive"]]
        ages = [r["last_collective_age_s"] for r in live]
        if not live or any(a is None for a in ages):
            return
        if min(ages) >= self.config.hang_s:
            if not job.hang_open:
                job.hang_open = True
                key = f"hang:{len(job.incidents.get('_keys', []))}"
                self._incident(job, "hang", "hang", once_key=key, now=now)
                job.keep_at = now
        else:
            job.hang_open = False

    def _write_state(self) -> None:
        """ROOT/agent.json: what this agent follows, for people and hooks."""
        doc = {"pid": os.getpid(), "node": self.config.node, "updated": time.time(),
               "jobs": {j.id: {"pid": j.found.pid, "state": j.state, "kept": j.kept,
                               "incidents": {k: v for k, v in j.incidents.items() if k != "_keys"}}
                        for j in self.jobs.values()}}
        tmp = self.config.root / "agent.json.tmp"
        try:
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, self.config.root / "agent.json")
        except OSError as e:
            self._say(f"cannot write {tmp}: {e.strerror}")


def _script_name(cmdline: str) -> str:
    """The training script's (or module's) name from a command line, for a job id."""
    args = cmdline.split()
    for i, a in enumerate(args):
        if a in ("-m", "--module") and i + 1 < len(args) and args[i + 1] not in LAUNCHER_MODULES:
            return args[i + 1].rsplit(".", 1)[-1]
        if a.endswith(".py"):
            return Path(a).stem
    return Path(args[0]).name if args else "job"


def _how(p) -> str:
    if p.exit_signal is not None:
        return f"signal {p.exit_signal}"
    return f"exit code {p.exit_code}" if p.exit_code is not None else "exit status unknown"


def _span_s(con) -> float:
    lo, hi = con.execute("SELECT min(ts), max(ts) FROM syscall").fetchone()
    return 0.0 if lo is None else (hi - lo) / 1e9


def node_health(health_dir: Path | None) -> dict:
    """The node's device ledger (failures, quarantine, unusable mark) and GPU
    counters through NVML, for the metrics; {} parts where there is none."""
    from .. import health  # NVML is imported there, only when asked

    out: dict = {"devices": {}, "unusable": False, "gpus": []}
    if health_dir is not None:
        try:
            s = health.summary(health.Ledger(None, health_dir))
            out["devices"] = {name: {"failures": d["failures"], "quarantined": bool(d.get("quarantined"))}
                              for name, d in s["devices"].items()}
            out["unusable"] = bool(s["unusable"])
        except (OSError, ValueError) as e:
            out["error"] = str(e)
    out["gpus"] = health.nvml_devices() or []
    return out


MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages: dropped, read again if touched)


def shed_compiler_memory() -> None:
    """Give back what compiling the BPF programs left resident: LLVM's and
    clang's code pages (~85 MB, needed again only to compile, and then read
    back from the file) and the freed heap.  A long-lived agent on every node
    should not carry its compiler."""
    import ctypes  # only here: the agent's one use of libc directly

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and ("libLLVM" in parts[5] or "libclang" in parts[5]):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    libc.madvise(lo, hi - lo, MADV_PAGEOUT)
        libc.malloc_trim(0)
    except (OSError, AttributeError, ValueError):
        pass  # memory is not worth failing over
