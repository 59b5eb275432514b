"""numpy mirrors of the records in events.h.

Keep each dtype next to its C struct's field order; tests/test_events_abi.py
compiles events.h with the system C compiler and checks the sizes agree.
Each ring record is prefixed by the kernel's 8-byte ring-buffer header
(u32 len with BUSY/DISCARD bits, u32 page offset), so the ring dtypes carry it.
"""

from __future__ import annotations

import numpy as np

ARGV_SLOTS = 12
ARGV_SLOT_LEN = 64
FILENAME_LEN = 128
COMM_LEN = 16
PATH_LEN = 112
PY_FRAMES = 32

RING_SYSCALL, RING_FUTEX, RING_PROC, RING_SIGNAL, RING_API, RING_FILE, RING_PYSTACK = range(7)
RING_NAMES = ("syscall", "futex", "proc", "signal", "api", "file", "pystack")
LIBRARY_RINGS = ("api", "pystack")  # loaded only with library probes

FUTEX_KIND_WAIT, FUTEX_KIND_WAKE = 1, 2
PROC_FORK, PROC_THREAD, PROC_EXEC, PROC_EXIT, PROC_REAP, PROC_DLOPEN = 1, 2, 3, 4, 5, 6
SIGNAL_GENERATE, SIGNAL_DELIVER = 1, 2

# struct syscall_event
SYSCALL_EVENT = np.dtype([
    ("ts", "<u8"), ("dur", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("ret", "<i8"),
    ("args", "<u8", (6,)), ("nr", "<u4"), ("cpu", "<u4"),
])

# struct futex_event
FUTEX_EVENT = np.dtype([
    ("ts", "<u8"), ("dur", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("uaddr", "<u8"),
    ("ret", "<i8"), ("timeout_ns", "<i8"), ("op", "<u4"), ("val", "<u4"), ("kind", "<u4"),
    ("waker_tid", "<u4"), ("wake_ts", "<u8"),
])

# struct proc_event
PROC_EVENT = np.dtype([
    ("ts", "<u8"), ("kind", "<u4"), ("pid", "<u4"), ("tid", "<u4"), ("ppid", "<u4"),
    ("ptid", "<u4"), ("code", "<i4"), ("flags", "<u8"), ("comm", f"S{COMM_LEN}"),
    ("filename", f"S{FILENAME_LEN}"), ("argv", f"S{ARGV_SLOT_LEN}", (ARGV_SLOTS,)),
])

# struct signal_event
SIGNAL_EVENT = np.dtype([
    ("ts", "<u8"), ("kind", "<u4"), ("sig", "<i4"), ("pid", "<u4"), ("tid", "<u4"),
    ("target_tid", "<u4"), ("code", "<i4"), ("result", "<i4"), ("group", "<i4"),
])

# struct api_event
API_EVENT = np.dtype([
    ("ts", "<u8"), ("dur", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("slot", "<u4"), ("flags", "<u4"),
    ("ret", "<i8"), ("args", "<u8", (6,)), ("deref", "<u8", (2,)), ("tensor", "<u8", (2,)),
])

# struct file_event
FILE_EVENT = np.dtype([
    ("ts", "<u8"), ("dur", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("ret", "<i8"), ("flags", "<u4"),
    ("nr", "<u4"), ("path", f"S{PATH_LEN}"),
])

# struct py_stack_event
PY_STACK_EVENT = np.dtype([
    ("ts", "<u8"), ("pid", "<u4"), ("tid", "<u4"), ("depth", "<u4"), ("more", "<u4"),
    ("code", "<u8", (PY_FRAMES,)), ("instr", "<u8", (PY_FRAMES,)),
])

EVENT_DTYPES = {
    "syscall": SYSCALL_EVENT,
    "futex": FUTEX_EVENT,
    "proc": PROC_EVENT,
    "signal": SIGNAL_EVENT,
    "api": API_EVENT,
    "file": FILE_EVENT,
    "pystack": PY_STACK_EVENT,
}

RINGBUF_HDR = 8


def with_ring_header(dtype: np.dtype) -> np.dtype:
    """The dtype of one ring record: kernel header, then the event."""
    assert dtype.itemsize % 8 == 0, "events must be multiples of 8 bytes"
    return np.dtype([("rb_len", "<u4"), ("rb_pgoff", "<u4"), ("ev", dtype)])
