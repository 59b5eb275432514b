"""Holding a library load until its probes are on (the other half of hold.c).

Libraries the command will load are probed ahead where they can be found
(preattach.py); one found only when it is loaded (a path computed at run
time, a container's own copy) is held at the load: the loader's audit hook
(hold.c, through LD_AUDIT in the command's environment) asks this server,
which probes the file and answers, and only then does the load go on.  A
load that waits more than the timeout goes on unprobed (fail open), and the
recording says so.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path

from ..runtime import native

SOURCE = Path(__file__).with_name("hold.c")
TIMEOUT_MS = 5000


class HoldServer:
    """Answers the loads held by hold.c: `on_load(pid, path)` attaches the
    probes, then the loading thread is let go."""

    def __init__(self, libraries: list[str], on_load, cache_dir: Path):
        self.libraries = libraries
        self.on_load = on_load
        self.held = 0          # loads held and answered
        self.errors: list[str] = []
        self.module = native.build(SOURCE, ["-shared", "-fPIC", "-O2"], cache_dir)
        self._dir = tempfile.mkdtemp(prefix="watcher-hold-")
        self.path = os.path.join(self._dir, "sock")
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Listen; False (and no hold) when the audit module cannot be built."""
        if self.module is None or not self.libraries:
            return False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        os.chmod(self.path, 0o666)  # ranks that drop privileges still reach it
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="watcher-hold", daemon=True)
        self._thread.start()
        return True

    def environment(self, env: dict) -> dict:
        """`env` with the audit module added (after any the user set)."""
        if self._sock is None:
            return env
        env = dict(env)
        env["LD_AUDIT"] = ":".join(x for x in (env.get("LD_AUDIT"), str(self.module)) if x)
        env["WATCHER_HOLD_LIBS"] = ":".join(self.libraries)
        env["WATCHER_HOLD_SOCK"] = self.path
        env["WATCHER_HOLD_TIMEOUT_MS"] = str(TIMEOUT_MS)
        return env

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            # One thread per held load: a slow attach for one library never
            # holds another process's load behind it.
            threading.Thread(target=self._answer, args=(conn,), name="watcher-hold-load", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(TIMEOUT_MS / 1000)
                line = b""
                while not line.endswith(b"\n") and len(line) < 8192:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    line += chunk
                pid, path = line.decode(errors="replace").rstrip("\n").split(" ", 1)
                try:
                    self.on_load(int(pid), path)
                except Exception as e:  # a failed attach still lets the load go on
                    self.errors.append(f"probing {path} for pid {pid}: {type(e).__name__}: {e}")
                self.held += 1
                conn.sendall(b"1")
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass
