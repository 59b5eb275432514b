"""Finding PyTorch training jobs on a node from /proc, with no help from them.

A job is found by its launcher (torchrun, `python -m torch.distributed.run`
or `.launch`), or, where a scheduler starts the ranks itself (Slurm's srun,
a Kubernetes pod per rank), by a rank: a process whose environment holds
RANK and WORLD_SIZE with MASTER_ADDR or TORCHELASTIC_RUN_ID.  Ranks started
by a launcher the agent already follows belong to its job.

A scan lists /proc and reads only pids it has not classified yet, and
re-reads for a few seconds those that might still exec (a shell or a
`python` about to become the launcher), so an idle node costs one directory
listing per scan.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
RECHECK_S = 5.0  # a young process is re-read this long: it may still exec


@dataclass
class Found:
    """A process that starts a job: a launcher, or a rank with no launcher."""
    pid: int
    start: int           # start time in clock ticks since boot: (pid, start) is unique
    kind: str            # 'launcher' or 'rank'
    cmdline: str
    run_id: str | None   # TORCHELASTIC_RUN_ID or a scheduler's job id, where known

    @property
    def key(self) -> str:
        return f"{self.pid}-{self.start}"


def read_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def read_environ(pid: int, keys: tuple[str, ...]) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, _, v = item.partition(b"=")
        k = k.decode(errors="replace")
        if k in keys:
            out[k] = v.decode(errors="replace")
    return out


def stat_of(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in ticks), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def is_launcher(argv: list[str]) -> bool:
    for i, a in enumerate(argv[:4]):
        if os.path.basename(a) == "torchrun":
            return True
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] in LAUNCHER_MODULES:
            return True
    return False


_RANK_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def rank_env(pid: int) -> dict[str, str] | None:
    """The rank variables of a training process, or None if it is not one."""
    env = read_environ(pid, _RANK_KEYS)
    if "RANK" in env and "WORLD_SIZE" in env and ("MASTER_ADDR" in env or "TORCHELASTIC_RUN_ID" in env):
        return env
    return None


class Discovery:
    """Incremental scans of /proc for processes that start training jobs."""

    def __init__(self, match: str | None = None, ignore: set[int] | None = None):
        self.match = re.compile(match) if match else None
        self.ignore = ignore or {os.getpid()}
        self._seen: dict[int, tuple[int, float]] = {}   # pid -> (start ticks, first seen)
        self._settled: set[int] = set()                  # classified for good
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._boot = _boot_time()

    def scan(self, now: float, followed: Callable[[int], bool]) -> list[Found]:
        """New job starters since the last scan.  `followed(pid)`: the pid is
        already recorded (the recorder follows forks in the kernel, so a
        recorded job's children are followed from their first instruction)."""
        found = []
        live = set()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            live.add(pid)
            if pid in self._settled or pid in self.ignore:
                continue
            st = stat_of(pid)
            if st is None:
                continue
            ppid, start = st
            first = self._seen.setdefault(pid, (start, now))
            if first[0] != start:  # a recycled pid
                self._seen[pid] = first = (start, now)
            hit = self._classify(pid, ppid, start, followed)
            if hit is not None:
                found.append(hit)
                self._settled.add(pid)
            elif now - first[1] > RECHECK_S or self._age_s(start) > RECHECK_S:
                self._settled.add(pid)  # old enough: it will not become a job now
        # Forget what has exited, so recycled pids are looked at afresh.
        self._settled &= live
        for pid in list(self._seen):
            if pid not in live:
                del self._seen[pid]
        return found

    def _classify(self, pid: int, ppid: int, start: int, followed: Callable[[int], bool]) -> Found | None:
        if followed(pid):
            return None
        argv = read_cmdline(pid)
        if not argv:
            return None  # a kernel thread, or gone
        line = " ".join(argv)
        if self.match is not None and not self.match.search(line):
            return None
        if is_launcher(argv):
            env = read_environ(pid, ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"))
            return Found(pid, start, "launcher", line, _run_id(env, argv))
        env = rank_env(pid)
        if env is not None and not _under_a_job(ppid):
            return Found(pid, start, "rank", line, _run_id(env, argv))
        return None

    def _age_s(self, start: int) -> float:
        if self._boot is None:
            return 0.0
        import time
        return time.time() - (self._boot + start / self._ticks)


def _under_a_job(ppid: int, depth: int = 4) -> bool:
    """A launcher or a rank among the nearest ancestors: a DataLoader worker
    or a rank of a launcher that --match left out is not a job of its own."""
    for _ in range(depth):
        if ppid <= 1:
            return False
        if is_launcher(read_cmdline(ppid)) or rank_env(ppid) is not None:
            return True
        st = stat_of(ppid)
        if st is None:
            return False
        ppid = st[0]
    return False


def _run_id(env: dict[str, str], argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--rdzv-id=") or a.startswith("--rdzv_id="):
            return a.split("=", 1)[1]
        if a in ("--rdzv-id", "--rdzv_id") and i + 1 < len(argv):
            return argv[i + 1]
    rid = env.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return rid
    return env.get("SLURM_JOB_ID")


def _boot_time() -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None
