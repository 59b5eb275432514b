"""The replay window's segment files: what a replay reads back is exactly
what the rank wrote in this segment's life, never bytes left over from the
file's previous life or a torn record."""

import os

import torch

from watcher.runtime.window import SegmentWriter, Window, segment_paths


def _records(n: int, start: int) -> list:
    return [("batch", start + i, torch.full((1000,), float(start + i))) for i in range(n)]


def test_a_recycled_segment_yields_only_its_own_records(tmp_path):
    w = SegmentWriter(tmp_path, rank=0)
    w.start(0)
    for r in _records(20, 0):
        w.put(r, copy=True)
    w.start(8)
    for r in _records(3, 100):
        w.put(r, copy=True)
    w.flush()
    w.drop_before(8)  # segment 0 becomes the spare: out of the readers' sight
    assert [p.name for p in segment_paths(tmp_path, 0, 0)] == ["rank0.seg8.pkl"]
    spare_size = os.path.getsize(tmp_path / "rank0.spare.pkl")
    w.start(16)  # reuses the spare's pages: 20 stale records lie beyond the 2 new ones
    for r in _records(2, 200):
        w.put(r, copy=True)
    w.flush()
    assert os.path.getsize(tmp_path / "rank0.seg16.pkl") == spare_size
    win = Window.load(segment_paths(tmp_path, 0, 8))
    assert sorted(win.batches) == [100, 101, 102, 200, 201]
    assert all(torch.equal(win.batches[i], torch.full((1000,), float(i))) for i in win.batches)
    w.close()
    w.drop_before(1 << 62, recycle=False)
    assert list(tmp_path.iterdir()) == []


def test_a_torn_record_ends_the_segment(tmp_path):
    w = SegmentWriter(tmp_path, rank=1)
    w.start(4)
    for r in _records(3, 0):
        w.put(r, copy=True)
    w.flush()
    w.close()
    path = tmp_path / "rank1.seg4.pkl"
    size = os.path.getsize(path)
    os.truncate(path, size - 100)  # the writer killed inside the last record
    win = Window.load([path])
    assert sorted(win.batches) == [0, 1]
    with open(path, "r+b") as f:  # a stale tail that happens to be long enough: the trailer decides
        f.seek(size - 100)
        f.write(b"\0" * 100)
    assert sorted(Window.load([path]).batches) == [0, 1]
