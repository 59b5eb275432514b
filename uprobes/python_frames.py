"""Python stacks of library calls, read from outside the process.

When a probed call fires (a CUDA call, a c10d collective, an NCCL call), the
BPF handler finds the calling thread's interpreter state and copies the chain
of frames it is executing: for each frame the code object's address and the
instruction pointer (`uprobes/api.bpf.c`, `api_py_stack`).  Nothing runs in
the target process.  The collector turns those pairs into `file:line function`
by reading the code objects through /proc/PID/mem, once per code object.

How the handler gets from a thread to its frames, for CPython 3.11 on x86_64
(the interpreter's private structs; `check_layout` verifies every offset below
against a running 3.11 interpreter, and the test suite runs it):

    _PyRuntime.interpreters.main -> PyInterpreterState
    .threads.head -> PyThreadState, linked by .next; the one whose
                     native_thread_id is the calling thread's tid (new
                     threads go first, so the main thread is last; the
                     handler remembers each thread's state and checks it)
    .cframe -> _PyCFrame .current_frame -> _PyInterpreterFrame
    frame .f_code (PyCodeObject), .prev_instr (last instruction run: the
                     call), .previous (the caller's frame)

The thread is found by its native id rather than through the GIL holder:
torch releases the GIL around its operators, and the thread that made the call
still points at the frame that made it.  Other Python versions get no stacks
(reported once per process), never wrong ones.
"""

from __future__ import annotations

import os
import re
import struct

from ..bpf.events import PY_FRAMES
from .elf_symbols import NotAnElf, defined_symbols
from .procfs import in_root

SUPPORTED = (3, 11)
FRAMES = PY_FRAMES   # frames kept per call, innermost first (bpf/events.h)
THREAD_SCAN = 128    # thread states searched for the caller (then remembered per thread)

# Offsets in bytes (CPython 3.11, x86_64).
LAYOUT = {
    "RT_INTERP_MAIN": 48,      # _PyRuntimeState.interpreters.main
    "IS_THREADS_HEAD": 16,     # PyInterpreterState.threads.head
    "TS_NEXT": 8,              # PyThreadState.next
    "TS_CFRAME": 56,           # PyThreadState.cframe
    "TS_NATIVE_TID": 160,      # PyThreadState.native_thread_id
    "CF_CURRENT": 8,           # _PyCFrame.current_frame
    "FR_CODE": 32,             # _PyInterpreterFrame.f_code
    "FR_PREVIOUS": 48,         # _PyInterpreterFrame.previous
    "FR_PREV_INSTR": 56,       # _PyInterpreterFrame.prev_instr
}
# PyCodeObject fields the collector reads (3.11).
CODE = {"firstlineno": 72, "filename": 112, "qualname": 128, "linetable": 136, "code": 184}
CODE_HEAD = 192
LIBPYTHON = re.compile(r"(^|/)(libpython3\.\d+\S*\.so[.\d]*|python3(\.\d+)?)$")


def cflags() -> list[str]:
    return [f"-DPY_{k}={v}" for k, v in LAYOUT.items()] + [f"-DPY_FRAMES={FRAMES}", f"-DPY_THREAD_SCAN={THREAD_SCAN}"]


# -- finding the interpreter in a process --------------------------------------------------------

def interpreter(pid: int) -> tuple[int | None, str]:
    """(address of _PyRuntime in `pid`, note).  The address is None when the
    process runs no supported CPython; the note says why."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = [line.rstrip("\n").split(None, 5) for line in f]  # a path may hold spaces
    except OSError as e:
        return None, f"cannot read /proc/{pid}/maps: {e.strerror}"
    files: dict[str, list[tuple[int, int]]] = {}
    for parts in maps:
        if len(parts) == 6 and LIBPYTHON.search(parts[5]):
            start = int(parts[0].split("-")[0], 16)
            files.setdefault(parts[5], []).append((start, int(parts[2], 16)))

    for path, ranges in files.items():
        try:
            syms = defined_symbols(in_root(pid, path), {"_PyRuntime", "Py_Version"}, objects=True)
        except (OSError, NotAnElf):
            continue
        if "_PyRuntime" not in syms or "Py_Version" not in syms:
            continue
        base = _load_base(in_root(pid, path), ranges)
        raw = _read(pid, base + syms["Py_Version"], 4)
        if raw is None:
            return None, f"cannot read process {pid}'s memory"
        version = struct.unpack("<I", raw)[0]
        major, minor = version >> 24, (version >> 16) & 0xFF
        if (major, minor) != SUPPORTED:
            return None, f"Python {major}.{minor} in process {pid}: Python stacks need {SUPPORTED[0]}.{SUPPORTED[1]}"
        return base + syms["_PyRuntime"], f"Python {major}.{minor} ({path})"
    return None, f"process {pid} runs no CPython with exported symbols"


def _load_base(path: str, ranges: list[tuple[int, int]]) -> int:
    """Where the file's virtual address 0 lies in the process: shared
    objects and PIE executables are relocated, fixed executables are not."""
    with open(path, "rb") as f:
        head = f.read(18)
    if struct.unpack_from("<H", head, 16)[0] == 2:  # ET_EXEC
        return 0
    return min(start - offset for start, offset in ranges)


def _read(pid: int, addr: int, n: int) -> bytes | None:
    """`n` bytes of `pid`'s memory, or None: addresses come from a live
    process's memory and may be stale or garbage."""
    if not 0 < addr < 1 << 47 or not 0 <= n < 1 << 24:
        return None
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, n, addr)
        return data if len(data) == n else None
    except (OSError, OverflowError, ValueError):
        return None
    finally:
        os.close(fd)


# -- turning (code, instruction) into file:line --------------------------------------------------

class FrameResolver:
    """Names the frames of recorded stacks.  Code objects are read while the
    process lives (`learn`, right after each ring read) and kept by address;
    module-level functions live as long as the process."""

    MAX_REMEMBERED = 100_000

    def __init__(self):
        self.codes: dict[tuple[int, int], tuple[str, str, int, bytes] | None] = {}
        self.frames: dict[tuple[int, int, int], str] = {}      # (pid, code, instr) -> "file:line function"
        self.stacks: dict[tuple, list[str]] = {}               # whole stacks already named

    def learn(self, events) -> None:
        for e in events:
            pid = int(e["pid"])
            for code in e["code"][:int(e["depth"])].tolist():
                if (pid, code) not in self.codes:
                    self.codes[(pid, code)] = self._read_code(pid, code)

    def describe(self, e) -> list[str]:
        """`file:line function` per frame, innermost first.  A training loop
        makes the same calls from the same lines every step: whole stacks and
        single frames are remembered, so a repeated stack costs one lookup."""
        pid, depth = int(e["pid"]), int(e["depth"])
        codes, instrs = e["code"][:depth], e["instr"][:depth]
        key = (pid, codes.tobytes(), instrs.tobytes(), int(e["more"]))
        out = self.stacks.get(key)
        if out is not None:
            return out
        out = [self._frame(pid, code, instr) for code, instr in zip(codes.tolist(), instrs.tolist())]
        if int(e["more"]):
            out.append("...")
        if None not in (self.codes.get((pid, c)) for c in codes.tolist()):  # unnamed frames may be named later
            if len(self.stacks) >= self.MAX_REMEMBERED:
                self.stacks.clear()
            self.stacks[key] = out
        return out

    def _frame(self, pid: int, code: int, instr: int) -> str:
        key = (pid, code, instr)
        text = self.frames.get(key)
        if text is None:
            info = self.codes.get((pid, code))
            if info is None:
                return f"?:? <code 0x{code:x}>"
            filename, qualname, first, table = info
            line = addr_to_line(table, first, instr - code - CODE["code"])
            text = f"{filename}:{line if line is not None else '?'} {qualname}"
            if len(self.frames) >= self.MAX_REMEMBERED:
                self.frames.clear()
            self.frames[key] = text
        return text

    def prune(self) -> None:
        """Drop what was learnt about processes that are gone (their pids come back)."""
        gone = {pid for pid in {k[0] for k in list(self.codes)} if not os.path.exists(f"/proc/{pid}")}
        if gone:
            self.codes = {k: v for k, v in self.codes.items() if k[0] not in gone}
            self.frames = {k: v for k, v in self.frames.items() if k[0] not in gone}
            self.stacks = {k: v for k, v in self.stacks.items() if k[0] not in gone}

    def _read_code(self, pid: int, addr: int):
        head = _read(pid, addr, CODE_HEAD)
        if head is None:
            return None
        ptr = lambda off: struct.unpack_from("<Q", head, off)[0]  # noqa: E731
        first = struct.unpack_from("<i", head, CODE["firstlineno"])[0]
        filename = self._unicode(pid, ptr(CODE["filename"]))
        qualname = self._unicode(pid, ptr(CODE["qualname"]))
        table = self._bytes(pid, ptr(CODE["linetable"]))
        if filename is None or table is None:
            return None
        return filename, qualname or "?", first, table

    def _unicode(self, pid: int, addr: int) -> str | None:
        # PyASCIIObject (48 bytes) then the characters when compact and
        # ASCII; PyCompactUnicodeObject (72 bytes) then 1/2/4-byte units.
        head = _read(pid, addr, 48)
        if head is None:
            return None
        length = struct.unpack_from("<q", head, 16)[0]
        state = struct.unpack_from("<I", head, 32)[0]
        kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
        if not compact or not 0 <= length < 4096 or kind not in (1, 2, 4):
            return None
        data = _read(pid, addr + (48 if ascii_ else 72), length * kind)
        if data is None:
            return None
        return data.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], errors="replace")

    def _bytes(self, pid: int, addr: int) -> bytes | None:
        head = _read(pid, addr, 32)  # PyBytesObject: ob_size at 16, data at 32
        if head is None:
            return None
        size = struct.unpack_from("<q", head, 16)[0]
        if not 0 <= size < 1 << 20:
            return None
        return _read(pid, addr + 32, size) if size else b""


def addr_to_line(table: bytes, first_line: int, offset: int) -> int | None:
    """The source line of the instruction at byte `offset` of the code,
    from CPython 3.11's location table (Objects/locations.md): entries of
    1-8 code units (2 bytes each), each moving the line by a delta.  None
    where the table says nothing, or is cut short."""
    try:
        return _addr_to_line(table, first_line, offset)
    except IndexError:
        return None


def _addr_to_line(table: bytes, first_line: int, offset: int) -> int | None:
    line, addr, i = first_line, 0, 0
    n = len(table)
    while i < n:
        head = table[i]
        i += 1
        code, units = (head >> 3) & 15, (head & 7) + 1
        delta, has_line = 0, True
        if code == 15:          # no location
            has_line = False
        elif code == 14:        # long form: line delta, end line, column, end column
            delta, i = _svarint(table, i)
            for _ in range(3):
                _, i = _varint(table, i)
        elif code == 13:        # no column
            delta, i = _svarint(table, i)
        elif code >= 10:        # one-line form: the delta is in the code, two column bytes
            delta, i = code - 10, i + 2
        else:                   # short form: same line, one column byte
            i += 1
        line += delta
        end = addr + 2 * units
        if addr <= offset < end:
            return line if has_line else None
        addr = end
    return None


def _varint(b: bytes, i: int) -> tuple[int, int]:
    val = b[i] & 63
    shift = 6
    while b[i] & 64:
        i += 1
        val |= (b[i] & 63) << shift
        shift += 6
    return val, i + 1


def _svarint(b: bytes, i: int) -> tuple[int, int]:
    val, i = _varint(b, i)
    return (-(val >> 1) if val & 1 else val >> 1), i


def user_frame(frames: list[str]) -> str | None:
    """The innermost frame in the user's own code: not the standard library,
    not an installed package, not Watcher's in-rank runtime (`python -c`
    code, file "<string>", is the user's)."""
    own = _own_dirs()
    for f in frames:
        path = f.split(":", 1)[0]
        if path in ("?", "", "...") or path.startswith("<frozen") or path.startswith(own) \
                or "/site-packages/" in path or "/dist-packages/" in path or _STDLIB.search(path):
            continue
        return f
    return None


_STDLIB = re.compile(r"/lib(64)?/python3\.\d+/")
_OWN: tuple[str, ...] | None = None


def _own_dirs() -> tuple[str, ...]:
    """Where Watcher's in-rank code lives (its hooks sit between the user's
    line and the library call)."""
    global _OWN
    if _OWN is None:
        import importlib.util

        dirs = []
        for name in ("watcher.runtime", "watcher.replay"):
            spec = importlib.util.find_spec(name)
            dirs += [os.path.join(d, "") for d in (spec.submodule_search_locations or [])] if spec else []
        _OWN = tuple(dirs)
    return _OWN


def check_layout() -> str | None:
    """None when LAYOUT and CODE hold for the running interpreter, else what
    differs.  Only meaningful under the supported version."""
    import ctypes
    import sys
    import threading

    if sys.version_info[:2] != SUPPORTED:
        return f"running Python {sys.version_info[0]}.{sys.version_info[1]}, not {SUPPORTED}"

    def word(addr: int) -> int:
        return struct.unpack("<Q", ctypes.string_at(addr, 8))[0]

    get_ts = ctypes.pythonapi.PyThreadState_Get
    get_ts.restype = ctypes.c_void_p
    get_is = ctypes.pythonapi.PyInterpreterState_Main
    get_is.restype = ctypes.c_void_p
    ts, interp = get_ts(), get_is()
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    L = LAYOUT
    if word(runtime + L["RT_INTERP_MAIN"]) != interp:
        return "_PyRuntime.interpreters.main"
    p, seen = word(interp + L["IS_THREADS_HEAD"]), False
    for _ in range(THREAD_SCAN):
        if not p:
            break
        seen |= p == ts
        p = word(p + L["TS_NEXT"])
    if not seen:
        return "PyInterpreterState.threads.head / PyThreadState.next"
    if word(ts + L["TS_NATIVE_TID"]) != threading.get_native_id():
        return "PyThreadState.native_thread_id"
    # The frame running while memory is read belongs to ctypes.string_at
    # (a Python function) called by `word`, called by this function.
    frame = word(word(ts + L["TS_CFRAME"]) + L["CF_CURRENT"])
    chain = []
    for _ in range(4):
        if not frame:
            break
        chain.append((word(frame + L["FR_CODE"]), word(frame + L["FR_PREV_INSTR"])))
        frame = word(frame + L["FR_PREVIOUS"])
    codes = [c for c, _ in chain]
    if id(word.__code__) not in codes:
        return "PyThreadState.cframe / _PyCFrame.current_frame / _PyInterpreterFrame.f_code"
    at = codes.index(id(word.__code__))
    if at + 1 >= len(codes) or codes[at + 1] != id(check_layout.__code__):
        return "_PyInterpreterFrame.previous"
    code, instr = chain[at]
    if not 0 <= instr - code - CODE["code"] < len(word.__code__.co_code):
        return "_PyInterpreterFrame.prev_instr / code start"
    r = FrameResolver()
    info = r._read_code(os.getpid(), code)
    if info != (word.__code__.co_filename, word.__code__.co_qualname, word.__code__.co_firstlineno,
                word.__code__.co_linetable):
        return "PyCodeObject fields"
    return None
