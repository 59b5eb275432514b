"""Small C libraries of the runtime, compiled once per source on the node.

`watcher run` builds each before it starts the job and tells the ranks where
it is through an environment variable; a rank without it (no C compiler on
the machine) does without, as each library's module says.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path


def build(source: Path, flags: list[str], cache_dir: Path) -> Path | None:
    """Compile `source` into `cache_dir` (cached by the source and flags); None if it cannot be built."""
    try:
        src = Path(source).read_bytes()
        key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
        out = Path(cache_dir) / f"{Path(source).stem}-{key}.so"
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as d:
            tmp = Path(d) / out.name
            for compiler in ("cc", "gcc"):
                try:
                    r = subprocess.run([compiler, *flags, "-o", str(tmp), str(source)],
                                       capture_output=True, timeout=60)
                except FileNotFoundError:
                    continue
                if r.returncode == 0:
                    os.replace(tmp, out)  # atomic: a concurrent build never loads half a file
                    return out
    except (OSError, subprocess.SubprocessError):
        pass
    return None
