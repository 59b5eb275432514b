"""Where a rank died: the faulting thread's native and Python frames.

Each rank arms, at start, two handlers of the fatal signals (SIGSEGV, SIGBUS,
SIGFPE, SIGILL, SIGABRT) writing to its file DIR/runtime/rank<r>.crash.txt:
crashsite.c's, which writes the native frames and hands the signal on, and
Python's faulthandler, which writes the Python frames and lets the signal
kill the process.  A replay child arms them again on a file of its round
(replay/snapshot.py), so a crash replay that dies says where, and the crash
verdict compares the two deaths: same signal at the same site (`same_site`).

Without a C compiler only the Python frames are written.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import signal
from pathlib import Path

from . import native

SOURCE = Path(__file__).with_name("crashsite.c")
ENV = "WATCHER_CRASHSITE"
FLAGS = ["-O2", "-shared", "-fPIC"]
_PY_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_NATIVE_FRAME = re.compile(r"^(.*?)\((.*?)\)\s*\[(0x[0-9a-f]+)\]$")

_file = None  # the open crash file: faulthandler holds its descriptor, not the object


def build(cache_dir: Path) -> Path | None:
    return native.build(SOURCE, FLAGS, cache_dir)


def arm(path: Path) -> int | None:
    """Write this process's crash site to `path` (created empty) if it dies of
    a fatal signal.  Called again in a fork to write elsewhere.  Returns the
    file's descriptor (a replay child keeps it out of the sandbox's traps)."""
    global _file
    try:
        f = open(path, "w")
    except OSError:
        return None
    faulthandler.enable(file=f, all_threads=False)  # retargets when already enabled
    lib_path = os.environ.get(ENV)
    if lib_path:
        try:
            ctypes.CDLL(lib_path).wcs_arm(f.fileno())
        except (OSError, AttributeError):
            pass
    old, _file = _file, f
    if old is not None:
        try:
            old.close()
        except OSError:
            pass  # an orphaned snapshot closed every descriptor it had
    return f.fileno()


def read(path: Path) -> dict | None:
    """The crash site in a crash file, or None if the process did not die there.

    {"signal": "SIGSEGV", "address": "0x0", "native": [{"object", "symbol",
    "offset", "address"}, ...] innermost first, from the faulting frame (the handler's
    own frames dropped), "python": [{"file", "line", "function"}, ...]
    innermost first}."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    if not text.strip():
        return None
    site = {"signal": None, "address": None, "native": [], "python": []}
    in_native = python_done = False
    for line in text.splitlines():
        if line.startswith("native signal "):
            parts = line.split()
            site["signal"] = _signame(int(parts[2]))
            site["address"] = parts[4] if len(parts) > 4 else None
            in_native = True
        elif line == "end native":
            in_native = False
        elif in_native:
            m = _NATIVE_FRAME.match(line.strip())
            if m:
                sym, _, off = m.group(2).rpartition("+")
                site["native"].append({"object": os.path.basename(m.group(1)), "symbol": sym or None,
                                       "offset": "+" + off if off else None, "address": m.group(3)})
        elif line.startswith("Fatal Python error:") and site["signal"] is None:
            site["signal"] = _signal_from_text(line)
        elif not python_done:
            m = _PY_FRAME.match(line)
            if m:
                site["python"].append({"file": m.group(1), "line": int(m.group(2)), "function": m.group(3)})
            elif site["python"] and not line.strip():
                python_done = True  # the faulting thread's frames only
    site["native"] = _past_handler(site["native"])
    if site["signal"] is None and not site["python"]:
        return None
    return site


def _past_handler(frames: list[dict]) -> list[dict]:
    """Drop the handler's own frame and the signal trampoline below it."""
    for i, f in enumerate(frames):
        if f["object"].startswith("crashsite"):
            return frames[i + 2:]
    return frames


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _signal_from_text(line: str) -> str | None:
    words = {"Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS", "Floating point exception": "SIGFPE",
             "Illegal instruction": "SIGILL", "Aborted": "SIGABRT"}
    return next((name for text, name in words.items() if text in line), None)


def innermost(site: dict) -> dict:
    """The place a death is compared by: the faulting native frame (its object
    and offset, the same in a fork and across address-space layouts), the
    nearest native frame with a name, and the innermost Python frame."""
    frames = site.get("native") or []
    at = frames[0] if frames else None
    named = next((f for f in frames if f.get("symbol")), None)
    py = (site.get("python") or [None])[0]
    return {"native": f"{at['object']}{at['symbol'] or ''}{at['offset'] or ''}" if at else None,
            "native_named": f"{named['symbol']}{named['offset'] or ''} ({named['object']})" if named else None,
            "python": f"{py['file']}:{py['line']} in {py['function']}" if py else None}


def same_site(a: dict | None, b: dict | None) -> bool | None:
    """Did two deaths happen at the same place?  None when either site is unknown."""
    if not a or not b:
        return None
    pa, pb = innermost(a), innermost(b)
    known = [k for k in ("native", "python") if pa[k] and pb[k]]
    if not known:
        return None
    return a.get("signal") == b.get("signal") and all(pa[k] == pb[k] for k in known)


def describe(site: dict) -> str:
    w = innermost(site)
    native = w["native"] and (w["native"] + (f" (through {w['native_named']})" if w["native_named"] else ""))
    return " <- ".join(x for x in (native, w["python"]) if x) or "an unknown place"
