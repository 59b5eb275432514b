"""A traced process's files as seen from here, through /proc: what it maps,
and where this side can open a file it names."""

from __future__ import annotations

import os


def in_root(pid: int, path: str) -> str:
    """`pid`'s file at `path`, as this process can open it.  A process in a
    container (its own mount namespace) maps its own copies: the path names
    them only inside its root, so they are read and probed through
    /proc/PID/root, never as whatever this side has at that path."""
    via = f"/proc/{pid}/root{path}"
    try:
        os.stat(via)
        return via
    except OSError:  # the process is gone, or /proc/PID/root is not ours to follow
        return path


def mapped_files(pid: int) -> dict[str, str] | None:
    """File -> start address of its first mapping, for every file `pid` maps;
    None if the process is gone.  A rank maps thousands of regions: one read
    per scan serves both the library probes and the interpreter lookup."""
    out: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    out.setdefault(parts[5].rstrip("\n"), parts[0].split("-", 1)[0])
    except OSError:
        return None
    return out
