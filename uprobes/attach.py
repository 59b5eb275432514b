"""Finds the libraries each traced process mapped and attaches the spec'd
probes to exactly those files.

Resolving from /proc/PID/maps keeps venv, conda and container copies right
(a probe on a system copy the process never loaded would never fire); a
container's files are reached through /proc/PID/root.  The
collector calls `scan` at start and then periodically, so a library loaded
later (dlopen after attach, NCCL on the first collective) is picked up.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from dataclasses import dataclass, field

from .preattach import PREATTACH, candidates
from .procfs import in_root, mapped_files
from .python_frames import LIBPYTHON, interpreter
from .spec import LibrarySpec, ResolvedProbe, resolve
from .tensor_layout import cached_layout, layout_for


LOADER = re.compile(r"^ld-linux.*\.so")


class _Cfg(ctypes.Structure):
    _fields_ = [("deref_arg", ctypes.c_int32), ("deref_at_exit", ctypes.c_uint32),
                ("entry_only", ctypes.c_uint32), ("numel_off", ctypes.c_int32),
                ("dtype_off", ctypes.c_int32), ("py_stack", ctypes.c_uint32)]


def _file_key(path: str) -> tuple[int, int] | None:
    """A file's identity (uprobes are per inode): the same library reached by
    two paths, or mapped by many processes, is probed once."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@dataclass
class LibraryProber:
    bpf: object                      # the loaded bcc.BPF holding uprobes/api.bpf.c
    specs: list[LibrarySpec]
    capacity: int
    slots: list[ResolvedProbe] = field(default_factory=list)
    attached_files: dict[tuple[int, int], str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loaders: set = field(default_factory=set)
    tensor_layouts: dict = field(default_factory=dict)   # libtorch path -> measured TensorImpl layout
    python_stacks: bool = True       # record the Python stack of each call (python_frames.py)
    interpreters: dict = field(default_factory=dict)     # (pid, libpython mapping) -> _PyRuntime address or None

    def scan(self, pids) -> list[str]:
        """Attach to libraries newly mapped by `pids`; returns new warnings."""
        new_warnings = []
        for pid in {k[0] for k in self.interpreters}:
            if not os.path.exists(f"/proc/{pid}"):
                self.forget(pid)
        for pid in pids:
            maps = mapped_files(pid)
            if maps is None:
                continue
            if self.python_stacks:
                self._find_interpreter(pid, maps)
            for path in maps:
                if LOADER.search(os.path.basename(path)):
                    self._watch_loader(in_root(pid, path))
                    continue
                for lib in self.specs:
                    if not lib.file_pattern.search(os.path.basename(path)):
                        continue
                    via = in_root(pid, path)
                    key = _file_key(via)
                    if key is None or key in self.attached_files:
                        continue
                    self.attached_files[key] = path
                    try:
                        new_warnings += self._attach_library(lib, path, via)
                    except Exception as e:  # an unreadable or odd library must not stop the recording
                        new_warnings.append(f"cannot probe {path}: {type(e).__name__}: {e}")
        self.warnings += new_warnings
        return new_warnings

    def preattach(self, argv: list[str], env: dict, libraries=None) -> list[str]:
        """Before the command runs: probe the libraries it may load at first
        use and call at once (preattach.py; or `libraries`), so their first
        calls are seen."""
        new_warnings = []
        patterns = {lib.library: lib.file_pattern for lib in self.specs}
        for path, name in candidates(argv, env, patterns, libraries or PREATTACH).items():
            key = _file_key(path)
            if key is None or key in self.attached_files:
                continue
            self.attached_files[key] = path
            lib = next(s for s in self.specs if s.library == name)
            try:
                new_warnings += self._attach_library(lib, path)
            except Exception as e:
                new_warnings.append(f"cannot probe {path}: {type(e).__name__}: {e}")
        self.warnings += new_warnings
        return new_warnings

    def _find_interpreter(self, pid: int, maps: dict[str, str]) -> None:
        """Tell the BPF side where `pid`'s interpreter state lives, so calls
        from it carry their Python stack.  Keyed by where the interpreter
        is mapped: an exec (a new image, or the same one moved by ASLR)
        makes the pid be looked at afresh, and a process whose libpython is
        not mapped yet (just exec'd) is looked at again on the next scan."""
        # interpreter file -> where its first mapping starts
        where = tuple(sorted((path, start) for path, start in maps.items() if LIBPYTHON.search(path))) or None
        key = (pid, where)
        if key in self.interpreters:
            return
        if any(k[0] == pid for k in self.interpreters):
            self.forget(pid)  # exec'd since: the old address means nothing now
        if where is None:
            return  # not (yet) a Python process
        addr, note = interpreter(pid)
        if addr is None and "need" not in note:
            return
        self.interpreters[key] = addr
        if addr is None:
            self.notes.append(f"no Python stacks: {note}")
            return
        self.bpf["py_procs"][ctypes.c_uint32(pid)] = ctypes.c_uint64(addr)

    def forget(self, pid: int) -> None:
        """A process exited: its pid may come back as something else."""
        try:
            del self.bpf["py_procs"][ctypes.c_uint32(pid)]
        except (KeyError, Exception):
            pass
        for key in [k for k in self.interpreters if k[0] == pid]:
            del self.interpreters[key]

    def _watch_loader(self, path: str) -> None:
        """Follow dlopen in every process using this ld.so (once per file)."""
        key = _file_key(path)
        if key is None or key in self.loaders:
            return
        self.loaders.add(key)
        try:
            self.bpf.attach_uprobe(name=path.encode(), sym=b"_dl_debug_state", fn_name=b"dl_debug_state")
        except Exception as e:  # bcc raises plain Exception
            self.warnings.append(f"cannot follow library loads through {path}: {str(e).strip()}")

    def _attach_library(self, lib: LibrarySpec, path: str, via: str | None = None) -> list[str]:
        """Probe `lib` in the file the process maps at `path`, reached here as
        `via` (see procfs.in_root); rows and messages name `path`."""
        via = via or path
        found, missing = resolve(lib, path, read_from=via)
        warnings = list(missing)
        before = len(self.slots)
        layout = None
        tensor_slots: list[int] = []
        wants_layout = any(p.spec.deref and p.spec.deref.type == "tensor_vector" for p in found)
        if wants_layout:
            layout = cached_layout(via)
            if layout is not None:
                self.tensor_layouts[path] = layout
        for probe in found:
            if len(self.slots) >= self.capacity:
                warnings.append(f"probe capacity ({self.capacity}) reached: {probe.display} in {path} "
                                "not attached; narrow --ops")
                break
            slot = len(self.slots)
            spec = probe.spec
            tensor = layout if spec.deref and spec.deref.type == "tensor_vector" and layout else None
            cfg = _Cfg(spec.deref.arg if spec.deref else -1,
                       int(bool(spec.deref and spec.deref.at_exit)), int(spec.entry_only),
                       tensor["numel_off"] if tensor else -1, tensor["dtype_off"] if tensor else -1,
                       int(self.python_stacks and spec.python_stack))
            self.bpf["api_cfg"][ctypes.c_int(slot)] = cfg
            r, c = divmod(slot, 16)
            entry_attached = False
            try:
                self.bpf.attach_uprobe(name=via.encode(), sym=probe.symbol.encode(),
                                       fn_name=f"api_entry_{r}_{c}".encode())
                entry_attached = True
                if not spec.entry_only:
                    self.bpf.attach_uretprobe(name=via.encode(), sym=probe.symbol.encode(),
                                              fn_name=f"api_exit_{r}_{c}".encode())
            except Exception as e:  # bcc raises plain Exception
                warnings.append(f"cannot attach {probe.display} in {path}: {str(e).strip()}")
                if entry_attached:
                    # the slot is reused by the next probe: it must not keep firing for this one
                    try:
                        self.bpf.detach_uprobe(name=via.encode(), sym=probe.symbol.encode())
                    except Exception:
                        self.slots.append(probe)  # cannot free it: keep it labelled correctly
                continue
            self.slots.append(probe)
            if spec.deref and spec.deref.type == "tensor_vector":
                tensor_slots.append(slot)
        self.notes.append(f"attached {len(self.slots) - before} {lib.library} probes to {path}")
        if wants_layout and layout is None:
            # Measuring takes a torch import (~2 s): the probes fire meanwhile,
            # and numel/dtype appear once the offsets are known.
            threading.Thread(target=self._measure_layout, args=(path, via, tensor_slots), daemon=True).start()
        return warnings

    def _measure_layout(self, path: str, via: str, slots: list[int]) -> None:
        layout = layout_for(via)
        if layout is None:
            self.warnings.append(f"tensor layout of {path} not measurable with this watcher's torch: "
                                 "collective numel/dtype left NULL")
            return
        self.tensor_layouts[path] = layout
        table = self.bpf["api_cfg"]
        for slot in slots:
            cfg = table[ctypes.c_int(slot)]
            cfg.numel_off, cfg.dtype_off = layout["numel_off"], layout["dtype_off"]
            table[ctypes.c_int(slot)] = cfg

    def libraries_missing(self) -> list[str]:
        seen = {lib.library for lib in self.specs
                if any(lib.file_pattern.search(os.path.basename(p)) for p in self.attached_files.values())}
        return [lib.library for lib in self.specs if lib.library not in seen]
