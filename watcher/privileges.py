"""Why eBPF cannot be loaded here, in words, with the exact fix."""

from __future__ import annotations

import os

from .errors import EnvironmentProblem, PermissionProblem

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def has_cap(cap: int) -> bool:
    return bool(effective_caps() & (1 << cap))


def require_bpf_privileges() -> None:
    if os.geteuid() == 0 and has_cap(CAP_SYS_ADMIN):
        return
    if has_cap(CAP_SYS_ADMIN) or (has_cap(CAP_BPF) and has_cap(CAP_PERFMON)):
        return
    missing = [name for cap, name in ((CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"))
               if not has_cap(cap)]
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        where = " (inside a container: run it with --cap-add BPF --cap-add PERFMON, or --privileged)"
    else:
        where = ""
    raise PermissionProblem(
        f"loading eBPF programs needs root or {' and '.join(missing)}{where}; "
        f"run with sudo, e.g. `sudo watcher ...`")


def require_bcc() -> None:
    try:
        import bcc  # noqa: F401
    except ImportError:
        raise EnvironmentProblem(
            "bcc is not importable: run scripts/setup (installs Debian's python3-bpfcc "
            "and links it into the venv)") from None


def explain_compile_failure(err: Exception) -> EnvironmentProblem:
    rel = os.uname().release
    if not os.path.exists(f"/lib/modules/{rel}/source/include/linux/kconfig.h"):
        return EnvironmentProblem(
            f"cannot compile eBPF programs: no kernel headers at /lib/modules/{rel}/build; "
            "run scripts/setup (links Debian's linux-headers-amd64 there)")
    if not (os.path.exists("/sys/kernel/tracing/events") or
            os.path.exists("/sys/kernel/debug/tracing/events")):
        return EnvironmentProblem("tracefs is not mounted: `sudo mount -t tracefs nodev /sys/kernel/tracing`")
    return EnvironmentProblem(f"cannot load eBPF programs: {str(err).strip().splitlines()[-1]}")
