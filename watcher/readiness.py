"""`watcher check`: is this machine ready to record, and if not, the fix."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from . import health
from .errors import PermissionProblem
from .privileges import require_bpf_privileges


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def _kernel() -> Check:
    rel = os.uname().release
    m = re.match(r"(\d+)\.(\d+)", rel)
    ok = m and (int(m.group(1)), int(m.group(2))) >= (5, 8)
    return Check("kernel", "ok" if ok else "fail", rel,
                 "" if ok else "BPF ring buffers need Linux 5.8 or newer")


def _btf() -> Check:
    ok = os.path.exists("/sys/kernel/btf/vmlinux")
    return Check("btf", "ok" if ok else "warn", "/sys/kernel/btf/vmlinux" + ("" if ok else " missing"),
                 "a kernel built with CONFIG_DEBUG_INFO_BTF=y (optional: bcc compiles against headers)")


def _tracefs() -> Check:
    for base in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"):
        if os.path.exists(f"{base}/events/raw_syscalls/sys_enter"):
            return Check("tracefs", "ok", f"{base} (raw_syscalls tracepoints present)")
    return Check("tracefs", "fail", "raw_syscalls tracepoints not found",
                 "sudo mount -t tracefs nodev /sys/kernel/tracing")


def _headers() -> Check:
    rel = os.uname().release
    ok = os.path.exists(f"/lib/modules/{rel}/source/include/linux/kconfig.h")
    return Check("kernel headers", "ok" if ok else "fail", f"/lib/modules/{rel}/build",
                 "bash scripts/setup (links Debian's linux-headers-amd64 there)")


def _privileges() -> Check:
    try:
        require_bpf_privileges()
        return Check("privileges", "ok", "root" if os.geteuid() == 0 else "CAP_BPF and CAP_PERFMON")
    except PermissionProblem as e:
        return Check("privileges", "fail", str(e), "run as root: sudo watcher ...")


def _bcc() -> Check:
    try:
        import bcc  # noqa: F401
    except ImportError:
        return Check("bcc", "fail", "python module bcc not importable",
                     "bash scripts/setup (apt install python3-bpfcc, linked into the venv)")
    if os.geteuid() != 0:
        return Check("bcc", "warn", "importable; compile test needs root")
    try:
        from bcc import BPF

        BPF(text=b"int probe(void *ctx) { return 0; }").cleanup()
        return Check("bcc", "ok", "importable, compiles a test program")
    except Exception as e:
        return Check("bcc", "fail", f"cannot compile: {str(e).strip().splitlines()[-1]}",
                     "bash scripts/setup (kernel headers shim)")


def _libraries(pid: int | None) -> list[Check]:
    wanted = {"libtorch": re.compile(r"libtorch(_cpu|_cuda)?\.so"),
              "libcudart": re.compile(r"libcudart\.so"), "libnccl": re.compile(r"libnccl\.so")}
    found: dict[str, str] = {}
    where = f"pid {pid}" if pid else "this environment"
    if pid:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.split()[-1] if "/" in line else ""
                    for name, rx in wanted.items():
                        if rx.search(path):
                            found.setdefault(name, path)
        except OSError as e:
            return [Check("libraries", "fail", f"cannot read /proc/{pid}/maps: {e.strerror}",
                          "check the pid; run as root")]
    else:
        import importlib.util
        import glob

        spec = importlib.util.find_spec("torch")
        if spec and spec.origin:
            libdir = os.path.join(os.path.dirname(spec.origin), "lib")
            for name, rx in wanted.items():
                for path in sorted(glob.glob(os.path.join(libdir, "*.so*"))):
                    if rx.search(os.path.basename(path)):
                        found.setdefault(name, path)
        import site

        for sp in site.getsitepackages():
            for path in glob.glob(os.path.join(sp, "nvidia", "*", "lib", "*.so*")):
                for name, rx in wanted.items():
                    if rx.search(os.path.basename(path)):
                        found.setdefault(name, path)
    out = []
    for name in wanted:
        if name in found:
            out.append(Check(name, "ok", found[name]))
        else:
            out.append(Check(name, "warn", f"not found in {where}",
                             "expected without a GPU build of torch" if name != "libtorch" else
                             "pip install torch==2.13.0 in the venv"))
    return out


def _gpus() -> Check:
    """What NVML says of each GPU's health (health.py's thresholds); absent NVML is a fact, not an error."""
    devs = health.nvml_devices()
    if devs is None:
        return Check("gpus", "warn", "NVML not available: no NVIDIA driver (device health from CPU cores only)",
                     "fine on a CPU-only machine; otherwise install the NVIDIA driver")
    bad = {d["index"]: health.bad_signals(d) for d in devs}
    text = "; ".join(f"GPU {d['index']} {d['name']} ({d['uuid']}): "
                     + (", ".join(bad[d["index"]]) or "healthy") for d in devs) or "0 GPUs"
    if any(bad.values()):
        return Check("gpus", "fail", text, "drain the GPUs named (watcher health lists the node's quarantine)")
    return Check("gpus", "ok", f"{len(devs)} visible through NVML: {text}")


def run_checks(pid: int | None = None) -> list[Check]:
    return [_kernel(), _btf(), _tracefs(), _headers(), _privileges(), _bcc(), *_libraries(pid), _gpus()]
