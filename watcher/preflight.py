"""`watcher preflight -- CMD`: try the job for a few steps before launching it
for real, and say what would go wrong.

The command runs with Watcher's runtime in every rank (no recorder, no
snapshots: no privileges needed) for `steps` steps; each rank reports from
inside (runtime/preflight_probe.py: batch, dtypes, threads, DataLoader
workers, a grad scaler, memory, an allreduce over the job's own link) and
stops.  Here, those reports meet what the node gives: the memory limit of the
job's cgroup (v1 or v2) and of the host, OOM kills during the try, the CPUs
and any CPU quota, the devices.  Each finding has a severity and a fix:

    fail  the run would fail (out of memory, ranks that disagree on dtypes,
          more ranks than devices, the job did not get through the steps)
    warn  the run would be slow or fragile (CPUs oversubscribed, memory
          close to the limit, fp16 without a scaler, bf16 emulated)

The verdict is "ready" or "fix before launch"; the exit status is 1 when
anything fails, 0 otherwise.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .rundir import STOP_EXIT_CODE, RunDir, read_json
from .run import RunConfig

MEMORY_TIGHT = 0.85  # of the limit: warn above it
UNLIMITED = 1 << 60


@dataclass
class PreflightConfig:
    cmd: list[str]
    steps: int = 20
    timeout_s: float = 300.0
    out: Path | None = None  # where the job's output and the ranks' reports go (a temporary directory if None)

    def validate(self) -> None:
        if not self.cmd:
            raise UsageError("nothing to try: give a command after --, e.g. watcher preflight -- torchrun train.py")
        if self.steps < 1:
            raise UsageError("--steps must be at least 1")
        if self.timeout_s <= 0:
            raise UsageError("--timeout must be positive (seconds)")


@dataclass
class Finding:
    check: str
    severity: str      # ok, warn, fail
    message: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return {"check": self.check, "severity": self.severity, "message": self.message, "fix": self.fix}


@dataclass
class PreflightReport:
    ranks: list[dict]
    findings: list[Finding]
    node: dict
    wall_s: float
    job_exit: int | None
    output_tail: str = ""

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "fail"]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    @property
    def verdict(self) -> str:
        return "fix before launch" if self.failed else "ready"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "exit_code": self.exit_code, "wall_s": self.wall_s,
                "job_exit": self.job_exit, "node": self.node, "ranks": self.ranks,
                "findings": [f.to_dict() for f in self.findings]}

    def text(self) -> str:
        lines = [f"watcher preflight: {len(self.ranks)} rank(s) in {self.wall_s:.1f} s"]
        for f in self.findings:
            lines.append(f"  {f.severity.upper():<4}  {f.check}: {f.message}" + (f"\n        fix: {f.fix}" if f.fix else ""))
        lines.append(f"verdict: {self.verdict}" + (f" ({len(self.failed)} failing)" if self.failed else ""))
        return "\n".join(lines)


# -- what the node gives ---------------------------------------------------------------------

def _cgroup_paths(pid: int) -> dict[str, str]:
    """controller -> path of the process's cgroup ("" for the v2 unified hierarchy)."""
    out = {}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in (controllers.split(",") if controllers else [""]):
                    out[c] = path
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _walk_up(root: Path, rel: str):
    """The cgroup directory and its parents, up to the hierarchy's root."""
    p = root / rel.lstrip("/")
    while True:
        yield p
        if p == root or root not in p.parents:
            return
        p = p.parent


def memory_limit(pid: int) -> tuple[int, str]:
    """The memory the process's tree may use (bytes) and what sets it: the
    tightest cgroup limit on the way up (v1 or v2), or the host's memory."""
    with open("/proc/meminfo") as f:
        host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    best, source = host, "the host's memory"
    paths = _cgroup_paths(pid)
    candidates = []
    if "memory" in paths:
        candidates = [(d / "memory.limit_in_bytes", d) for d in _walk_up(Path("/sys/fs/cgroup/memory"), paths["memory"])]
    elif "" in paths:
        candidates = [(d / "memory.max", d) for d in _walk_up(Path("/sys/fs/cgroup"), paths[""])]
    for f, d in candidates:
        v = _read_int(f)
        if v is not None and v < best:
            best, source = v, f"cgroup {d}"
    return best, source


def oom_kills(pid: int) -> int | None:
    """OOM kills so far in the process's memory cgroup (v1 memory.oom_control, v2 memory.events)."""
    paths = _cgroup_paths(pid)
    if "memory" in paths:
        f = Path("/sys/fs/cgroup/memory") / paths["memory"].lstrip("/") / "memory.oom_control"
    elif "" in paths:
        f = Path("/sys/fs/cgroup") / paths[""].lstrip("/") / "memory.events"
    else:
        return None
    try:
        for line in f.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return 0


def usable_cpus(pid: int) -> tuple[float, str]:
    """CPUs the process may use: its affinity, or a CPU quota if tighter."""
    n, source = float(len(os.sched_getaffinity(pid))), "CPU affinity"
    paths = _cgroup_paths(pid)
    quota = None
    if "cpu" in paths:
        d = Path("/sys/fs/cgroup/cpu") / paths["cpu"].lstrip("/")
        q, per = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
        if q and per and q > 0:
            quota = q / per
    elif "" in paths:
        try:
            q, per = (Path("/sys/fs/cgroup") / paths[""].lstrip("/") / "cpu.max").read_text().split()
            if q != "max":
                quota = int(q) / int(per)
        except (OSError, ValueError):
            pass
    if quota is not None and quota < n:
        n, source = quota, "cgroup CPU quota"
    return n, source


# -- the try ----------------------------------------------------------------------------------

def run_preflight(cfg: PreflightConfig, progress=None) -> PreflightReport:
    cfg.validate()
    tmp = None
    out = cfg.out
    if out is None:
        tmp = tempfile.mkdtemp(prefix="watcher-preflight-")
        out = Path(tmp) / "run"
    if out.exists():
        raise UsageError(f"{out} already exists; choose another --out or remove it")
    try:
        rundir = RunDir(out)
        rundir.create(cfg.cmd)
        env = RunConfig(cmd=cfg.cmd, out=out, snapshot_interval=1 << 30, copy_interval=0, audit_budget=0).env()
        env["WATCHER_PREFLIGHT_STEPS"] = str(cfg.steps)
        me = os.getpid()
        limit, limit_source = memory_limit(me)
        kills0 = oom_kills(me)
        cpus, cpu_source = usable_cpus(me)
        t0 = time.monotonic()
        log = out / "job.log"
        with open(log, "w") as f:
            try:
                proc = subprocess.Popen(cfg.cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            except OSError as e:
                raise UsageError(f"cannot start {cfg.cmd[0]}: {e.strerror}") from None
            code, timed_out = _wait(proc, cfg, rundir, progress)
        wall = time.monotonic() - t0
        kills = oom_kills(me)
        ranks = [read_json(p) for _, p in rundir.preflight_files()]
        node = {"memory_limit_mb": round(limit / 2**20), "memory_limit_source": limit_source,
                "cpus": cpus, "cpus_source": cpu_source,
                "oom_kills": (kills - kills0) if kills is not None and kills0 is not None else None}
        tail = log.read_text(errors="replace")[-4000:]
        findings = judge(ranks, node, cfg.steps, code, timed_out, tail)
        return PreflightReport(ranks, findings, node, round(wall, 1), code, tail)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _wait(proc, cfg: PreflightConfig, rundir: RunDir, progress) -> tuple[int | None, bool]:
    """The job's exit status, and whether it had to be stopped at the timeout."""
    deadline = time.monotonic() + cfg.timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None, True
        if progress:
            progress(rundir)
        time.sleep(0.2)
    return proc.returncode, False


def judge(ranks: list[dict], node: dict, steps: int, code: int | None, timed_out: bool, tail: str) -> list[Finding]:
    out: list[Finding] = []
    done = [r for r in ranks if r.get("done")]
    world = max([r.get("world", 0) for r in ranks] + [0])
    missing = sorted(set(range(world)) - {r["rank"] for r in ranks})
    limit_mb = node["memory_limit_mb"]
    local = max([r.get("local_world", 1) for r in ranks] + [1])
    batch = next((r["batch"] for r in ranks if r.get("batch")), None)

    # Did the job get through the steps?
    oomed = bool(node.get("oom_kills"))
    if oomed:
        peak = max((r.get("peak_rss_mb") or 0) for r in ranks) if ranks else 0
        fit = largest_batch(ranks, limit_mb, local, oomed=True)
        out.append(Finding("memory", "fail",
                           f"the OOM killer stopped the job ({node['oom_kills']} kill(s)) after "
                           f"{min((r.get('steps_done', 0) for r in ranks), default=0)} step(s): {peak:.0f} MB "
                           f"resident per rank at the last reading, against {limit_mb / local:.0f} MB per rank "
                           f"({limit_mb} MB for {local} ranks, {node['memory_limit_source']})",
                           f"lower the batch to at most {fit} per rank (now {batch})" if fit is not None and batch
                           else "lower the batch or the model size, or raise the memory limit"))
    elif timed_out:
        out.append(Finding("progress", "fail", f"the job did not get through {steps} steps in time "
                           f"({len(done)} of {world or '?'} ranks did)",
                           "run it alone to see where it stops (a rendezvous that never completes, a hang)"))
    elif len(done) < max(world, 1) or code not in (0, STOP_EXIT_CODE, 1):
        last = [line for line in tail.splitlines() if line.strip()][-1:] or ["(no output)"]
        out.append(Finding("progress", "fail",
                           f"the job stopped before {steps} steps (exit {code}; ranks done: "
                           f"{sorted(r['rank'] for r in done)}; never started: {missing}): {last[0][:200]}",
                           "fix the error above; the job's whole output is in the preflight's job.log"))
    if not ranks:
        return out

    # Memory that fits, with room to spare?
    if not oomed:
        peak_total = sum((r.get("peak_rss_mb") or 0) for r in ranks)
        fit = largest_batch(ranks, limit_mb, local)
        share = peak_total / limit_mb if limit_mb else 0
        sev = "warn" if share > MEMORY_TIGHT else "ok"
        out.append(Finding("memory", sev,
                           f"peak {peak_total:.0f} MB for {len(ranks)} rank(s) ({100 * share:.0f}% of {limit_mb} MB, "
                           f"{node['memory_limit_source']})" + (f"; largest batch that fits: about {fit} per rank "
                                                               f"(now {batch})" if fit is not None and batch else ""),
                           "lower the batch: a longer run (evaluation, a bigger sequence) would not fit"
                           if sev == "warn" else None))

    # CPUs: threads per rank times ranks on this node.
    threads = max(r.get("threads") or 1 for r in ranks)
    workers = max(r.get("dataloader_workers") or 0 for r in ranks)
    cpus = node["cpus"]
    want = local * threads
    if want > cpus:
        per = max(1, math.floor(cpus / local))
        out.append(Finding("cpu", "warn", f"{local} ranks x {threads} threads on {cpus:g} CPUs ({node['cpus_source']}): "
                           f"oversubscribed {want / cpus:.1f}x, every rank waits for the others' threads",
                           f"set OMP_NUM_THREADS={per} (or torch.set_num_threads({per})) in each rank"))
    else:
        out.append(Finding("cpu", "ok", f"{local} ranks x {threads} threads on {cpus:g} CPUs"))
    if workers and local * workers > cpus:
        out.append(Finding("dataloader", "warn", f"{workers} DataLoader workers per rank x {local} ranks on {cpus:g} "
                           "CPUs: the workers compete with training for CPU",
                           f"num_workers={max(0, math.floor(cpus / local) - threads)} per rank"))

    # Precision.
    dtypes = {r["rank"]: tuple(r.get("param_dtypes") or ()) for r in ranks if r.get("param_dtypes")}
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"rank {k}: {'/'.join(v)}" for k, v in sorted(dtypes.items()))
        out.append(Finding("precision", "fail", f"ranks hold their parameters in different dtypes ({shown}): "
                           "their gradients cannot be reduced together",
                           "build the model the same way on every rank (one dtype, one autocast setting)"))
    half = any("float16" in (r.get("param_dtypes") or []) or r.get("loss_dtype") == "float16" for r in ranks)
    if half and not any(r.get("grad_scaler") for r in ranks):
        out.append(Finding("precision", "warn", "float16 training with no gradient scaler: small gradients "
                           "underflow to zero and large ones overflow to inf",
                           "use torch.amp.GradScaler around the optimizer step, or bfloat16"))
    bf16 = any("bfloat16" in (r.get("param_dtypes") or []) or r.get("loss_dtype") == "bfloat16" for r in ranks)
    if bf16:
        r0 = ranks[0]
        slow = (r0.get("bf16_supported") is False if r0.get("device") == "cuda"
                else not any(c in (r0.get("cpu_capability") or "") for c in ("AVX512", "AMX")))
        if slow:
            out.append(Finding("precision", "warn", "bfloat16 without hardware support here: emulated, slow",
                               "use float32 (or float16 with a scaler) on this hardware"))
    if not any(f.check == "precision" for f in out):
        out.append(Finding("precision", "ok", "parameters in " + "/".join(sorted({d for v in dtypes.values() for d in v}))
                           + " on every rank"))

    # Devices and the link.
    r0 = next((r for r in done), ranks[0])
    if r0.get("device") == "cuda" and r0.get("devices") is not None and local > r0["devices"]:
        out.append(Finding("devices", "fail", f"{local} ranks on this node for {r0['devices']} GPU(s)",
                           f"--nproc_per_node={r0['devices']}"))
    link = next((r.get("allreduce") for r in done if r.get("allreduce")), None)
    if link:
        sev = "warn" if link["busbw_gbps"] < 1.0 else "ok"
        out.append(Finding("link", sev, f"allreduce of {link['bytes'] >> 20} MB over the job's group: "
                           f"{link['busbw_gbps']:.2f} Gbit/s bus bandwidth ({1000 * link['best_s']:.1f} ms)",
                           "check the interface the backend uses (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
                           if sev == "warn" else None))
    return out


def largest_batch(ranks: list[dict], limit_mb: float, local: int, oomed: bool = False) -> int | None:
    """The batch per rank whose memory fits 90% of each rank's share of the
    limit, if memory grows linearly with the batch from what a rank held
    before its first step (the model, the optimizer) to its peak.  After an
    OOM kill the last reading may predate the peak, which was at least the
    rank's share of the limit."""
    fits = []
    for r in ranks:
        base, peak, batch = r.get("base_rss_mb"), r.get("peak_rss_mb"), r.get("batch")
        if oomed and peak is not None:
            peak = max(peak, limit_mb / local)
        if not (base and peak and batch) or peak <= base:
            continue
        per_sample = (peak - base) / batch
        fits.append(max(0, math.floor((0.9 * limit_mb / local - base) / per_sample)))
    return min(fits) if fits else None


def print_progress(rundir: RunDir) -> None:
    """One refreshing line: the steps each rank has done."""
    if not sys.stderr.isatty():
        return
    done = []
    for _, p in rundir.preflight_files():
        try:
            done.append(read_json(p).get("steps_done", 0))
        except (OSError, ValueError):
            continue
    if done:
        sys.stderr.write(f"\rwatcher preflight: step {min(done)} on {len(done)} rank(s)   ")
        sys.stderr.flush()
