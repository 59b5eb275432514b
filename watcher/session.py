"""A recording session: `watcher attach` and `watcher record` as library calls.

A session validates its config before touching anything (bad combinations
fail fast), loads the BPF programs, marks the target tree as traced, and runs
the collector until the target is gone, the duration ends, or it is told to
stop (SIGINT/SIGTERM).  It always finishes the recording, so an interrupted
session still leaves a complete, readable file.
"""

from __future__ import annotations

import os
import signal

import duckdb
import sys
import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from .bpf.recorder import ALL_PROBES, KernelRecorder, RecorderConfig
from .collector import Collector, monotonic_ns
from .errors import RecordingError, TargetError, UsageError
from .live import LiveView
from .privileges import explain_compile_failure, require_bcc, require_bpf_privileges
from .process_model import decode_wait_status
from .runtime.supervisor import terminal_sent_it
from .store import RecordingWriter, give_to_invoking_user
from .uprobes.hold import HoldServer
from .uprobes.preattach import PREATTACH
from .uprobes.tensor_layout import CACHE


@dataclass
class SessionConfig:
    out: Path
    probes: tuple[str, ...] = ALL_PROBES
    duration: float | None = None
    max_size: int | None = None          # bytes
    ring_minutes: float | None = None    # flight-recorder mode
    live: bool = False
    log_idle_polls: bool = False
    ops: str | None = None               # opt-in operator probes (regex over op names)
    py_stacks: bool = True               # Python stack of every library call (uprobes/python_frames.py)
    flush_interval: float = 1.0
    quiet: bool = False
    extra_meta: dict = field(default_factory=dict)
    # Polled by the collector loop: while it returns True the recorder is
    # paused (`watcher run`: the control block's `paused` word, set only by
    # an overhead measurement).  The paused time is written to the recording.
    paused: Callable[[], bool] | None = None

    def validate(self) -> None:
        unknown = [p for p in self.probes if p not in ALL_PROBES]
        if unknown:
            raise UsageError(f"unknown probe {unknown[0]!r}; choose from {','.join(ALL_PROBES)}")
        if self.duration is not None and self.duration <= 0:
            raise UsageError("--duration must be positive")
        if self.max_size is not None and self.max_size < 1 << 20:
            raise UsageError("--max-size must be at least 1M")
        if self.ring_minutes is not None and self.ring_minutes <= 0:
            raise UsageError("--ring-minutes must be positive")
        if self.ring_minutes is not None and self.max_size is not None:
            raise UsageError("--ring-minutes and --max-size cannot be combined: ring mode keeps "
                             "the last minutes in memory and writes them out once")

    def validate_output(self) -> None:
        try:
            exists = self.out.exists()
        except OSError as e:
            raise RecordingError(f"cannot write {self.out}: {e.strerror}") from None
        if exists:
            raise RecordingError(f"{self.out} already exists; choose another --out or remove it")
        parent = self.out.parent if str(self.out.parent) else Path(".")
        if not parent.is_dir():
            raise RecordingError(f"cannot write {self.out}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise RecordingError(f"cannot write {self.out}: directory {parent} is not writable")


@dataclass
class SessionResult:
    out: Path
    events: int
    drops: int
    size_bytes: int
    duration_s: float
    target_exit: int | None = None
    by_ring: dict = field(default_factory=dict)

    def summary(self) -> str:
        return (f"Recorded {self.events:,} events ({self.drops:,} dropped) in {self.duration_s:.1f} s "
                f"to {self.out} ({self.size_bytes / 1e6:.2f} MB)")


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, ppid) of root's live descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry))[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        p = stack.pop()
        for c in sorted(children.get(p, [])):
            out.append((c, p))
            stack.append(c)
    return out


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name, from the state
    on (the name is in parentheses and may itself hold spaces or ')')."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rindex(")") + 2:].split()


def _ppid(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[1])
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = _stat_fields(pid)[0]
    except OSError:
        return False
    return state not in "ZX"


class Session:
    def __init__(self, config: SessionConfig):
        config.validate()
        require_bcc()
        require_bpf_privileges()
        config.validate_output()
        self.config = config
        self.recorder = None
        self.collector: Collector | None = None
        self._interrupts = 0
        self._paused_pids: list[int] | None = None  # taken out of the traced set by a pause
        self._paused_since = 0.0
        self._paused_s = 0.0
        self._live = None
        self._before_finish = None
        self._finishing = False

    def _tree_alive(self) -> bool:
        """Any recorded process still running (as far as the last flush knows)?"""
        return any(p.end_ts is None and _alive(p.pid) for p in self.collector.model.processes)

    # -- set-up ----------------------------------------------------------------
    def _load(self) -> None:
        require_bcc()
        require_bpf_privileges()
        cfg = RecorderConfig(probes=self.config.probes, log_idle_polls=self.config.log_idle_polls,
                             op_pattern=self.config.ops, python_stacks=self.config.py_stacks)
        try:
            self.recorder = KernelRecorder(cfg)
        except Exception as e:  # bcc raises plain Exception on compile/attach failure
            raise explain_compile_failure(e) from None
        ring = self.config.ring_minutes is not None
        writer = RecordingWriter(self.config.out, in_memory=ring)
        on_flush = None
        if self.config.live:
            self._live = LiveView()
            on_flush = self._live.render
        self.collector = Collector(
            self.recorder, writer, flush_interval=self.config.flush_interval,
            max_size=self.config.max_size,
            ring_window_ns=int(self.config.ring_minutes * 60e9) if ring else None,
            on_flush=on_flush)
        self.collector.on_warning = self._say

    def _say(self, msg: str) -> None:
        if not self.config.quiet:
            print(msg, file=sys.stderr, flush=True)

    def _install_signals(self, on_signal) -> dict:
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, on_signal)
        if self.config.ring_minutes is not None:
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: self._dump_requested())
        return old

    def _dump_requested(self) -> None:
        self._dump_now = True

    # -- attach ------------------------------------------------------------------
    def attach(self, pid: int) -> SessionResult:
        if pid <= 0 or not _alive(pid):
            raise TargetError(f"no process with pid {pid}" + (" (it has exited)" if pid > 0 and
                                                               os.path.exists(f"/proc/{pid}") else ""))
        if pid == os.getpid():
            raise TargetError("cannot attach to watcher itself")
        self._load()
        c = self.collector
        t0 = monotonic_ns()
        try:
            self.recorder.trace(pid)
            c.model.adopt_live(pid, _ppid(pid), t0)
            for child, parent in _descendants(pid):
                self.recorder.trace(child)
                c.model.adopt_live(child, parent, t0)
            if not _alive(pid):
                raise TargetError(f"pid {pid} exited during attach")
            c.scan_libraries()
            cmdline = c.model.processes[0].cmdline
            c.write_start_meta(target_pid=pid, cmdline=cmdline, mode="attach", probes=self.config.probes)
        except BaseException:
            self._abandon()  # nothing half-written left looking valid
            raise
        self._say(f"Recording PID {pid} ({cmdline[:60].replace(chr(10), ' ')}) to {self.config.out}... Ctrl-C to stop")

        def gone() -> bool:
            return not _alive(pid) and not self._tree_alive()

        return self._run(gone, t0)

    # -- record --------------------------------------------------------------------
    def record(self, argv: list[str], env: dict | None = None) -> SessionResult:
        if not argv:
            raise UsageError("nothing to record: give a command after --")
        # The child is forked before the probes load (so it inherits none of
        # their descriptors) and held on a pipe until it is traced, so nothing
        # it does from its first instruction after exec is missed.
        self._hold = self._start_hold()
        if self._hold is not None:
            env = self._hold.environment(env if env is not None else dict(os.environ))
        r, w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.close(w)
                os.close(err_r)
                if os.read(r, 1) != b"x":
                    os._exit(126)  # the recorder failed to start
                os.close(r)
                os.set_inheritable(err_w, False)
                # The job gets default dispositions, not the ones Python set here.
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(sig, signal.SIG_DFL)
                if env is not None:
                    os.execvpe(argv[0], argv, env)
                os.execvp(argv[0], argv)
            except OSError as e:
                os.write(err_w, f"{e.strerror}".encode())
            finally:
                os._exit(127)
        try:
            self._load()
        except BaseException:
            os.close(w)
            os.waitpid(pid, 0)
            raise
        c = self.collector
        os.close(r)
        os.close(err_w)
        t0 = monotonic_ns()
        try:
            self.recorder.trace(pid)
            c.model.adopt_live(pid, os.getpid(), t0)
            c.write_start_meta(target_pid=pid, cmdline=" ".join(argv), mode="record",
                               probes=self.config.probes)
            # The child is still held: the libraries it calls at once are
            # probed before it can load them.
            c.preattach_libraries(argv, env if env is not None else dict(os.environ))
        except BaseException:
            os.close(w)  # the held child reads EOF and exits without running anything
            os.close(err_r)
            os.waitpid(pid, 0)
            self._abandon()
            raise
        os.write(w, b"x")
        os.close(w)
        failure = os.read(err_r, 512).decode()
        os.close(err_r)
        if failure:
            os.waitpid(pid, 0)
            self._abandon()
            raise TargetError(f"cannot run {argv[0]}: {failure}")
        shown = " ".join(argv).replace("\n", " ")
        self._say(f"Recording `{shown[:70]}` (pid {pid}) to {self.config.out}... Ctrl-C to stop")
        self.child = pid
        self.child_status: int | None = None

        def done() -> bool:
            if self.child_status is None:
                try:
                    wpid, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    wpid, status = pid, 0
                if wpid == pid:
                    self.child_status = status
                    self._child_exit_ns = monotonic_ns()
            if self.child_status is None:
                return False
            # Let the rest of the tree finish, within reason.
            return not self._tree_alive() or monotonic_ns() - self._child_exit_ns > 2e9

        def note_child_status() -> None:
            # We reaped the root ourselves: its wait status is exact.
            if self.child_status is not None and c.model.processes:
                root = c.model.processes[0]
                root.exit_code, root.exit_signal = decode_wait_status(self.child_status)
                c.model.dirty = True

        self._before_finish = note_child_status
        result = self._run(done, t0, forward_to=pid)
        status = self.child_status
        if status is not None:
            code = os.waitstatus_to_exitcode(status)
            result.target_exit = code if code >= 0 else 128 - code
        return result

    # -- shared loop -------------------------------------------------------------------
    def _run(self, target_done, t0: int, forward_to: int | None = None) -> SessionResult:
        c = self.collector
        deadline = None if self.config.duration is None else time.monotonic() + self.config.duration
        self._dump_now = False

        def on_signal(signum, frame):
            self._interrupts += 1
            if self._finishing:
                return
            if forward_to is not None and self._interrupts == 1:
                # The child decides when it is done; a second signal stops now.
                # A Ctrl-C at the terminal already reached the child (same
                # foreground process group): do not send it a second one.
                if not (signum == signal.SIGINT and terminal_sent_it()):
                    try:
                        os.kill(forward_to, signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)
                    except ProcessLookupError:
                        pass
                self._grace_deadline = time.monotonic() + 10
                return
            c.stop()

        self._grace_deadline = None
        self._finishing = False
        old = self._install_signals(on_signal)
        try:
            def should_stop() -> bool:
                if self.config.paused is not None:
                    self._follow_pause()
                if self._dump_now:
                    self._dump_now = False
                    self._dump_ring()
                if target_done():
                    return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return True
                return self._grace_deadline is not None and now >= self._grace_deadline

            c.run(should_stop)
        except (duckdb.Error, OSError) as e:
            self._restore(old)
            raise RecordingError(f"cannot write {self.config.out}: {e}") from None
        try:
            # A Ctrl-C while the recording is finalised only counts; the file
            # is finished either way.
            self._finishing = True
            if self._before_finish:
                self._before_finish()
            return self._finish(t0)
        except (duckdb.Error, OSError) as e:
            raise RecordingError(f"cannot finish {self.config.out}: {e}") from None
        finally:
            self._restore(old)

    def _follow_pause(self) -> None:
        try:
            want = bool(self.config.paused())
        except Exception:
            return  # a measurement switch must never stop the recording
        if want and self._paused_pids is None:
            live = [p.pid for p in self.collector.model.processes if p.end_ts is None]
            self._paused_pids = self.recorder.pause(live)
            self._paused_since = time.monotonic()
        elif not want and self._paused_pids is not None:
            self.recorder.resume(self._paused_pids)
            self._paused_pids = None
            self._paused_s += time.monotonic() - self._paused_since

    @staticmethod
    def _restore(old: dict) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    def _dump_ring(self) -> Path:
        """Flight-recorder mode: write the in-memory window out now."""
        c = self.collector
        c.flush()
        out = self.config.out
        n = 0
        while True:  # never overwrite an earlier dump, even two in one second
            try:
                os.close(os.open(out, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
                os.unlink(out)
                break
            except FileExistsError:
                n += 1
                out = self.config.out.with_name(
                    f"{self.config.out.stem}-{time.strftime('%Y%m%d-%H%M%S')}-{n}{self.config.out.suffix}")
        c.writer.con.execute(f"ATTACH '{out}' AS dump")
        try:
            c.writer.con.execute("COPY FROM DATABASE memory TO dump")
        finally:
            c.writer.con.execute("DETACH dump")
        give_to_invoking_user(out)
        self._say(f"Wrote the last {self.config.ring_minutes:g} min to {out}")
        return out

    def _start_hold(self) -> HoldServer | None:
        """Libraries called at once after loading are held at the load until
        probed, where preattach could not find them (uprobes/hold.py)."""
        libraries = sorted(lib for lib in PREATTACH if lib in self.config.probes)
        server = HoldServer(libraries, lambda pid, path: self.collector.scan_pid(pid), CACHE)
        return server if server.start() else None

    def _stop_hold(self) -> dict:
        hold, self._hold = getattr(self, "_hold", None), None
        if hold is None:
            return {}
        hold.close()
        for e in hold.errors:
            self._say(f"warning: {e}")
        return {"held_loads": str(hold.held)}

    def _finish(self, t0: int) -> SessionResult:
        c = self.collector
        if self._paused_pids is not None:  # still paused at the end
            self._paused_s += time.monotonic() - self._paused_since
        facts = {"paused_s": f"{self._paused_s:.3f}"} if self._paused_s else {}
        facts.update(self._stop_hold())
        c.finish(interrupted=str(self._interrupts > 0).lower(), **facts)
        if self.config.ring_minutes is not None:
            out = self._dump_ring()
            size = out.stat().st_size
        else:
            c.writer.close()
            out = self.config.out
            size = out.stat().st_size
        if self._live:
            self._live.close()
        self.recorder.close()
        res = SessionResult(out=out, events=c.stats.total_events, drops=c.stats.total_drops,
                            size_bytes=size, duration_s=(monotonic_ns() - t0) / 1e9,
                            by_ring=dict(c.stats.events))
        self._say(res.summary())
        return res

    def _abandon(self) -> None:
        """Undo a session that never started: no half-written file left behind."""
        self._stop_hold()
        try:
            self.collector.writer.con.close()
        except Exception:
            pass
        for p in (self.config.out, Path(str(self.config.out) + ".wal")):
            try:
                p.unlink()
            except OSError:
                pass
        self.recorder.close()
