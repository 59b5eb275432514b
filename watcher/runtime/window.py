"""The replay window on disk: what a replay needs that happened after a snapshot.

Each snapshot opens a segment file; every batch the rank fetches goes to the
current segment as it is fetched, and at each step end one record holds the
step's fingerprint and its collectives (checksums, and the outputs a replay
must be served).  A replay from snapshot v reads the segments from
v onward, so it has everything the rank saw since v even if the rank itself
has died (a crash), but for the collectives of the step it died in: those a
coordinated replay computes from its peers (replay/state.py) go unchecked.
A torn last record (the rank killed mid-write) is ignored.

Segments older than the oldest retained snapshot are not deleted but kept as
the spare that the next segment overwrites: on this kind of VM a tmpfs write
into fresh pages costs ~0.6 ms per MB (allocation and zeroing), a write into
pages the file already holds ~0.2 ms.  Records therefore carry their
segment's tag (its first step) in a header and a trailer, so a reader stops
at the first byte left over from the file's previous life.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import threading
from pathlib import Path

import torch


# Records up to this size are written by the caller; larger ones (copies of
# big collective outputs, large batches) by the writer thread.
INLINE_BYTES = 256 << 10


class SegmentWriter:
    def __init__(self, directory: Path, rank: int, max_bytes: int = 4 << 30):
        self.dir = Path(directory)
        self.rank = rank
        self.fd = None
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.idle = threading.Condition(self.lock)
        self.queue: collections.deque = collections.deque()
        self.thread = None
        self.pending_writes = 0
        self.writing = False
        self.max_bytes = max_bytes
        self.bytes = 0             # in the segments still kept
        self.sizes: dict = {}      # segment path -> bytes
        self.truncated = False
        self.segments: list[tuple[int, Path]] = []  # (from_step, path), oldest first
        self.spare: Path | None = None  # a dropped segment whose pages the next one reuses
        self.spare_bytes = 0
        self.tag = 0                    # the current segment's first step
        self.offset = 0                 # where its next record goes

    def after_fork(self) -> None:
        """In a forked copy that goes on writing (a rescued rank): the writer
        thread and whatever it held stayed in the parent."""
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.idle = threading.Condition(self.lock)
        self.queue.clear()
        self.thread, self.writing, self.pending_writes = None, False, 0

    def start(self, from_step: int) -> None:
        path = self.dir / f"rank{self.rank}.seg{from_step}.pkl"
        self.flush()
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            if self.spare is not None:
                try:
                    os.rename(self.spare, path)
                    self.bytes -= self.spare_bytes
                except OSError:
                    flags |= os.O_TRUNC
                self.spare, self.spare_bytes = None, 0
            else:
                flags |= os.O_TRUNC
            self.fd = os.open(path, flags, 0o600)
            self.segments.append((from_step, path))
            self.tag, self.offset = from_step, 0
            self.truncated = False

    def put(self, record: tuple, copy: bool = False) -> None:
        """Write a record: small ones at once, large ones through a writer
        thread (os.pwritev releases the GIL, so training does not wait for
        the copy into the page cache).  The thread is woken for every large
        record: a rank killed by a signal loses what is still queued, and a
        crash replay needs the crashing step's batch and collectives."""
        if self.fd is None:
            return
        parts = encode(record)
        size = sum(len(p) for p in parts) + 2 * _HEAD.size
        if copy and size > INLINE_BYTES:
            # Written later by the thread: freeze the tensors' bytes now (the
            # user may modify them in place meanwhile).
            parts = parts[:2] + [bytes(p) for p in parts[2:]]
        with self.lock:
            if self.fd is None:
                return
            if self.bytes + size > self.max_bytes:
                # The window outgrew its cap (snapshots too rare for this much
                # data): stop here; a replay will say its record ran out.
                self.truncated = True
                return
            self.bytes += size
            self.sizes[self.segments[-1][1]] = self.sizes.get(self.segments[-1][1], 0) + size
            parts = framed(parts, self.tag)
            offset, self.offset = self.offset, self.offset + size
            if size <= INLINE_BYTES:
                # A small record (a batch of token ids, a fingerprint, a
                # checksum) is written here: one pwritev of a few KB costs less
                # than waking the writer thread and handing the GIL back and forth.
                try:
                    os.pwritev(self.fd, parts, offset)
                except OSError:
                    pass
                return
            if self.thread is None:
                self.thread = threading.Thread(target=self._write_loop, name="watcher-window", daemon=True)
                self.thread.start()
            self.queue.append((self.fd, offset, parts))
            self.wake.notify()

    def _write_loop(self) -> None:
        while True:
            with self.lock:
                while not self.queue:
                    self.wake.wait()
                fd, offset, parts = self.queue.popleft()
                self.writing = True
            try:
                os.pwritev(fd, parts, offset)
            except OSError:
                pass  # the segment was dropped meanwhile
            with self.lock:
                self.writing = False
                self.pending_writes = len(self.queue)
                if not self.queue:
                    self.idle.notify_all()

    def flush(self) -> None:
        """Wait until everything queued is on its way to disk."""
        with self.lock:
            if self.queue:
                self.wake.notify()
            while self.queue or self.writing:  # a record in the middle of its write counts too
                self.idle.wait(timeout=1.0)


    def drop_before(self, from_step: int, recycle: bool = True) -> None:
        """Forget the segments before `from_step`.  The newest of them becomes
        the spare (renamed out of the readers' sight); the rest are deleted."""
        keep, dropped = [], []
        current = self.current_path()
        for s, p in self.segments:
            (dropped if s < from_step else keep).append((s, p))
        self.segments = keep
        with self.lock:
            for i, (s, p) in enumerate(dropped):
                size = self.sizes.pop(p, 0)
                self.bytes -= size
                spare = self.dir / f"rank{self.rank}.spare.pkl"
                if recycle and i == len(dropped) - 1 and p != current:
                    try:
                        self._unlink_spare()
                        os.rename(p, spare)
                        self.spare, self.spare_bytes = spare, size
                        self.bytes += size  # its pages are still held
                        continue
                    except OSError:
                        pass
                _unlink(p)
            if not recycle:
                self._unlink_spare()

    def current_path(self) -> Path | None:
        return self.segments[-1][1] if self.segments else None

    def _unlink_spare(self) -> None:
        if self.spare is not None:
            _unlink(self.spare)
            self.bytes -= self.spare_bytes
            self.spare, self.spare_bytes = None, 0

    def close(self) -> None:
        self.flush()
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _unlink(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def segment_step(p: Path) -> int:
    """A segment's first step, from its name `rank<R>.seg<STEP>.pkl`."""
    return int(p.name.split(".seg", 1)[1][:-len(".pkl")])


def segment_paths(directory: Path, rank: int, from_step: int) -> list[Path]:
    found = []
    for p in Path(directory).glob(f"rank{rank}.seg*.pkl"):
        s = segment_step(p)
        if s >= from_step:
            found.append((s, p))
    return [p for _, p in sorted(found)]


class Window:
    """Everything recorded after a snapshot, indexed for replay."""

    def __init__(self):
        self.batches: dict[int, object] = {}          # fetch index -> batch (or StopIteration marker)
        self.outputs: dict[tuple, list] = {}          # (group, seq) -> output tensors
        self.colls: dict[tuple, dict] = {}            # (group, seq) -> collective record
        self.steps: dict[int, dict] = {}              # step -> fingerprint

    @classmethod
    def load(cls, paths: list[Path]) -> "Window":
        w = cls()
        for p in paths:
            tag = segment_step(p)
            with open(p, "rb") as f:
                while True:
                    try:
                        rec = decode(f, tag)
                    except Exception:
                        break  # end of file, or the torn tail of a killed writer
                    if rec is None:
                        break
                    w._add(rec)
        return w

    def _add(self, rec: tuple) -> None:
        kind = rec[0]
        if kind == "batch":
            self.batches[rec[1]] = rec[2]
        elif kind == "step":  # ("step", fingerprint line, collective lines, their kept outputs)
            fp = json.loads(rec[1])
            self.steps[fp["step"]] = fp
            self._add_colls(rec[2], rec[3])
        elif kind == "colls":  # collectives after the last step (logged at exit)
            self._add_colls(rec[1], rec[2])

    def _add_colls(self, lines: list, outputs: list) -> None:
        for line, outs in zip(lines, outputs):
            meta = json.loads(line)
            key = (meta["group"], meta["seq"])
            self.colls[key] = meta
            self.outputs[key] = outs


END_OF_DATA = "__watcher_end_of_iterator__"

# -- record encoding -------------------------------------------------------------------------------
# A record is a small pickle in which every tensor is replaced by a reference,
# followed by the tensors' raw bytes: pickling a tensor through torch's own
# reducer costs ~0.17 ms per MB and a copy; this is one writev from the
# tensors' memory.
#
#   u64 body length | u64 tag | body | u64 record length | u64 tag
#   body = u64 header length | header pickle | raw bytes of tensor 0 | tensor 1 | ...
#
# The tag is the segment's first step.  A record counts only if both its tags
# match the segment's: a recycled file's stale bytes, or a record torn by a
# killed writer (pwritev fills the file in order), end the segment there.
#
# Tensors are swapped for references by `reducer_override`, which pickle
# calls only for objects that are not plain containers or scalars (the
# tuples, ints and strings of a record never reach Python code); a
# `persistent_id` hook would be called for every object (a batch record
# cost 21 us to encode that way, 8 us this way).  Unpickling meets the
# references in the order the tensors' bytes follow the header.

_U64 = struct.Struct("<Q")
_HEAD = struct.Struct("<QQ")


def _raw_tensor(dtype: str, shape: tuple, nbytes: int, requires_grad: bool):
    """Stands for a tensor in a record's header; the reader resolves it (`_decode_body`)."""
    raise RuntimeError("a window record's tensor is read by window.decode, not by pickle")


class _Pickler(pickle.Pickler):
    """Pickles into its own buffer; the tensors it meets go to `tensors`."""

    def __init__(self):
        self.buf = io.BytesIO()
        super().__init__(self.buf, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list | None = None

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cpu and obj.layout == torch.strided:
            t = obj.detach().contiguous()
            self.tensors.append(t)
            return _raw_tensor, (str(t.dtype)[6:], tuple(t.shape), t.numel() * t.element_size(), t.requires_grad)
        return NotImplemented


# One pickler per OS thread, kept between records: with a new Pickler for
# each record, encoding a collective's record cost 3.0 us here; reusing one,
# 1.2 us.  Records are written from the training thread and gloo's threads.
# Keyed by thread id, not threading.local: gloo's threads enter Python
# through a fresh thread state for every callback, and a thread-local dies
# with it.  The few OS threads a rank has keep theirs for its life.  A
# forked child (a snapshot) starts afresh: a thread of its own may reuse the
# id of a parent's thread that was mid-record at the fork.
_picklers: dict[int, _Pickler] = {}
os.register_at_fork(after_in_child=_picklers.clear)


def encode(record) -> list:
    ident = threading.get_ident()
    p = _picklers.get(ident)
    if p is None:
        if len(_picklers) >= 64:  # threads come and go: the oldest id goes
            _picklers.pop(next(iter(_picklers)), None)
        p = _picklers[ident] = _Pickler()
    buf = p.buf
    p.tensors = tensors = []
    buf.seek(0)
    buf.truncate()
    try:
        p.dump(record)
    finally:
        # The memo refers to everything pickled: let go of the record now,
        # not at this thread's next one (a rarely used group's thread may
        # have none for the rest of the run).
        p.clear_memo()
        p.tensors = None
    head = buf.getvalue()
    parts = [_U64.pack(len(head)), head]
    for t in tensors:
        if t.numel():
            try:  # numpy's view of the memory: a third of the cost of torch's byte view
                parts.append(memoryview(t.numpy()).cast("B"))
            except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16, float8)
                parts.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return parts


def framed(parts: list, tag: int) -> list:
    """An encoded record between its header and trailer (see above)."""
    body = sum(len(p) for p in parts)
    return [_HEAD.pack(body, tag), *parts, _HEAD.pack(body + 2 * _HEAD.size, tag)]


def decode(f, tag: int):
    """The next record of a segment tagged `tag`, or None where the segment ends."""
    raw = f.read(_HEAD.size)
    if len(raw) < _HEAD.size:
        return None
    body_len, got = _HEAD.unpack(raw)
    if got != tag or body_len > os.fstat(f.fileno()).st_size - f.tell():
        return None
    body = f.read(body_len)
    trailer = f.read(_HEAD.size)
    if len(body) < body_len or len(trailer) < _HEAD.size or _HEAD.unpack(trailer) != (body_len + 2 * _HEAD.size, tag):
        return None
    return _decode_body(io.BytesIO(body))


class _Unpickler(pickle.Unpickler):
    """Rebuilds a record, reading each referenced tensor's bytes from `data` in turn."""

    def __init__(self, head: bytes, data):
        super().__init__(io.BytesIO(head))
        self.data = data

    def find_class(self, module, name):
        if module == __name__ and name == "_raw_tensor":
            return self._tensor
        return super().find_class(module, name)

    def _tensor(self, dtype: str, shape: tuple, nbytes: int, requires_grad: bool):
        data = self.data.read(nbytes)
        if len(data) < nbytes:
            raise EOFError("torn record")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        t = t.view(getattr(torch, dtype)).reshape(shape)
        return t.requires_grad_(requires_grad) if requires_grad else t


def _decode_body(f):
    raw = f.read(8)
    (n,) = _U64.unpack(raw)
    head = f.read(n)
    if len(head) < n:
        raise EOFError("torn record")
    return _Unpickler(head, f).load()
