"""Where libtorch keeps a tensor's element count and dtype inside TensorImpl.

The layout is a private detail of each libtorch build, so it is measured, not
assumed: a helper process with the same torch creates tensors of known sizes
and dtypes and reads their TensorImpl bytes (`Tensor._cdata` is the
TensorImpl address).  The offsets found are handed to the collective probes,
which read the first tensor's numel and dtype at the call.  The result is
cached per libtorch file (path, size, mtime).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "watcher"

PROBE = r"""
import ctypes, json, sys, torch
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]
SPAN = 512
def raw(t):
    return ctypes.string_at(t._cdata, SPAN)
keep = [torch.empty(n, dtype=d) for n, d in ((123457, torch.float32), (98765, torch.float64), (4243, torch.int64))]
imgs = [raw(t) for t in keep]
numel_off = next(o for o in range(0, SPAN - 8, 8)
                 if all(int.from_bytes(im[o:o + 8], "little") == t.numel() for im, t in zip(imgs, keep)))
typed = [torch.empty(7, dtype=d) for d in DTYPES]
timgs = [raw(t) for t in typed]
same = [torch.empty(11, dtype=d) for d in DTYPES]
simgs = [raw(t) for t in same]
def u16(im, o):
    return int.from_bytes(im[o:o + 2], "little")
dtype_off = next(o for o in range(0, SPAN - 2, 2)
                 if len({u16(im, o) for im in timgs}) == len(DTYPES)
                 and all(u16(a, o) == u16(b, o) for a, b in zip(timgs, simgs)))
values = {u16(im, dtype_off): [str(d).replace("torch.", ""), t.element_size()] for im, d, t in zip(timgs, DTYPES, typed)}
print(json.dumps({"torch": torch.__version__, "numel_off": numel_off, "dtype_off": dtype_off, "dtypes": values}))
"""


def _key(libtorch: str) -> str:
    st = os.stat(libtorch)
    return f"{st.st_ino}-{st.st_size}-{int(st.st_mtime)}"


def cached_layout(libtorch: str) -> dict | None:
    try:
        path = CACHE / f"tensor-layout-{_key(libtorch)}.json"
        return _normalize(json.loads(path.read_text())) if path.exists() else None
    except (OSError, ValueError):
        return None


def layout_for(libtorch: str, python: str = sys.executable) -> dict | None:
    """Offsets for this libtorch file, or None when they cannot be measured
    (the measuring torch is not this file): numel and dtype then stay NULL."""
    try:
        key = _key(libtorch)
    except OSError:
        return None
    cached = CACHE / f"tensor-layout-{key}.json"
    if cached.exists():
        try:
            return _normalize(json.loads(cached.read_text()))
        except ValueError:
            pass
    try:
        res = subprocess.run([python, "-c", PROBE + _CHECK.format(path=libtorch)], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    out = json.loads(res.stdout.strip().splitlines()[-1])
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(out))
    except OSError:
        pass
    return _normalize(out)


def _normalize(layout: dict) -> dict:
    layout["dtypes"] = {int(k): v for k, v in layout["dtypes"].items()}  # JSON keys are text
    return layout


# Only trust offsets measured on the very file the target mapped.
_CHECK = """
import os
mine = [l.split()[-1] for l in open("/proc/self/maps") if "libtorch_cpu" in l]
if not mine or os.stat(mine[0]).st_ino != os.stat({path!r}).st_ino:
    raise SystemExit(3)
"""
