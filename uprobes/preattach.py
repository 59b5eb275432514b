"""Libraries a command will load later, found before it starts.

Probes attached when a process maps a library (attach.py) come milliseconds
after the load; a program that loads CUDA's runtime or NCCL and calls it at
once (NCCL's first use is ncclCommInitRank, where many hangs are) has made
its first calls by then.  Uprobes live on files, not processes, so the
libraries a command can load are probed before it runs: those under its
Python's site-packages (the nvidia-* wheels, torch/lib) and its
LD_LIBRARY_PATH.  Only the libraries that are loaded at first use and
called at once are probed ahead (PREATTACH); a library found only when it
is loaded is still probed then (attach.py's scan).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

PREATTACH = {"libcudart", "libnccl"}
# Where Python wheels put the shared libraries, under a site-packages directory.
WHEEL_LIB_GLOBS = ("nvidia/*/lib/*.so*", "nvidia/*/*/lib/*.so*", "torch/lib/*.so*")


def interpreter(argv: list[str], env: dict) -> str | None:
    """The Python interpreter `argv` runs, directly or through a script's #! line."""
    exe = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    for _ in range(2):  # a script, then its interpreter (#!/usr/bin/env python3)
        if exe is None:
            return None
        if os.path.basename(exe).startswith("python"):
            return exe
        try:
            with open(exe, "rb") as f:
                first = f.readline(256)
        except OSError:
            return None
        if not first.startswith(b"#!"):
            return None
        words = first[2:].decode(errors="replace").split()
        if not words:
            return None
        name = words[1] if os.path.basename(words[0]) == "env" and len(words) > 1 else words[0]
        exe = shutil.which(name, path=env.get("PATH")) if "/" not in name else name
    return None


def site_dirs(python: str, env: dict) -> list[str]:
    code = ("import json, site, sysconfig; print(json.dumps(site.getsitepackages() + "
            "[sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']]))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=20, env=env)
        return sorted(set(json.loads(out.stdout))) if out.returncode == 0 else []
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def candidates(argv: list[str], env: dict, patterns: dict, libraries=PREATTACH) -> dict[str, str]:
    """File -> library name, for the files the command may load for
    `libraries` (`patterns`: name -> the spec's regex over file names), one
    path per file identity."""
    dirs = []
    python = interpreter(argv, env)
    if python:
        for site in site_dirs(python, env):
            dirs += [os.path.dirname(p) for g in WHEEL_LIB_GLOBS for p in glob.glob(os.path.join(site, g))]
    dirs += [d for d in (env.get("LD_LIBRARY_PATH") or "").split(":") if d]
    found: dict[str, str] = {}
    seen = set()
    for d in dict.fromkeys(dirs):
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            for lib, pattern in patterns.items():
                if lib in libraries and pattern.search(name) and os.path.isfile(path):
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        found[path] = lib
    return found
