"""The replay window on disk: what a replay needs that happened after a snapshot.

Each snapshot opens a segment file; every batch the rank fetches, every
collective output it receives and every step fingerprint go to the current
segment as pickled records.  A replay from snapshot v reads the segments from
v onward, so it has everything the rank saw since v even if the rank itself
has died (a crash).  Segments older than the oldest retained snapshot are
deleted.  A torn last record (the rank killed mid-write) is ignored.
"""

from __future__ import annotations

import os
import pickle
import threading
from pathlib import Path


class SegmentWriter:
    def __init__(self, directory: Path, rank: int):
        self.dir = Path(directory)
        self.rank = rank
        self.fd = None
        self.lock = threading.Lock()
        self.segments: list[tuple[int, Path]] = []  # (from_step, path), oldest first

    def start(self, from_step: int) -> None:
        path = self.dir / f"rank{self.rank}.seg{from_step}.pkl"
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            self.segments.append((from_step, path))

    def put(self, record: tuple) -> None:
        # One write per record, unbuffered: a rank that crashes mid-step
        # leaves everything up to its last batch and collective on disk.
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            if self.fd is not None:
                os.write(self.fd, data)

    def flush(self) -> None:
        pass

    def drop_before(self, from_step: int) -> None:
        keep = []
        for s, p in self.segments:
            if s < from_step:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            else:
                keep.append((s, p))
        self.segments = keep

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def segment_paths(directory: Path, rank: int, from_step: int) -> list[Path]:
    found = []
    for p in Path(directory).glob(f"rank{rank}.seg*.pkl"):
        s = int(p.name[len(f"rank{rank}.seg"):-len(".pkl")])
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
            with open(p, "rb") as f:
                while True:
                    try:
                        rec = pickle.load(f)
                    except EOFError:
                        break
                    except Exception:
                        break  # torn tail of a killed writer
                    w._add(rec)
        return w

    def _add(self, rec: tuple) -> None:
        kind = rec[0]
        if kind == "batch":
            self.batches[rec[1]] = rec[2]
        elif kind == "coll":
            meta, outs = rec[1], rec[2]
            key = (meta["group"], meta["seq"])
            self.colls[key] = meta
            self.outputs[key] = outs
        elif kind == "step":
            self.steps[rec[1]["step"]] = rec[1]


END_OF_DATA = "__watcher_end_of_iterator__"
