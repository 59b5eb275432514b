"""Probe specs: one TOML file per library under uprobes/, loaded as data.

A spec says which library (a regex over the mapped file's name), and per
probe: the symbol (exact) or pattern (regex over demangled names, expanding to
one probe per match), the argument registers to keep and how to decode them,
an optional pointer argument to read (`deref`), and whether it is on by default.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from watcher.errors import UsageError

from .elf_symbols import demangle, function_symbols

HERE = Path(__file__).resolve().parent
ARG_TYPES = {"ptr", "u64", "i64", "u32", "i32", "symbol", "dim3", "cuda_memcpy_kind",
             "nccl_datatype", "nccl_redop"}
RET_TYPES = {"int", "cuda_error", "nccl_result", "ptr", "none"}
DEREF_TYPES = {"i32", "u64", "tensor_vector"}


@dataclass(frozen=True)
class Arg:
    name: str
    type: str


@dataclass(frozen=True)
class Deref:
    arg: int
    type: str
    name: str
    at_exit: bool


@dataclass(frozen=True)
class ProbeSpec:
    library: str
    name: str
    symbol: str | None
    pattern: str | None
    args: tuple[Arg, ...]
    ret: str
    deref: Deref | None
    default: bool
    family: str
    collective: str | None
    entry_only: bool
    hint: str = ""       # a substring every matching mangled name contains (cheap prefilter)
    optional: bool = False  # absent from some builds (e.g. NCCL in a CPU torch): no warning
    python_stack: bool = True  # record the calling thread's Python stack (python_frames.py)

    def arg_index(self, name: str) -> int | None:
        return next((i for i, a in enumerate(self.args) if a.name == name), None)


@dataclass(frozen=True)
class LibrarySpec:
    library: str
    file_pattern: re.Pattern
    probes: tuple[ProbeSpec, ...]


@dataclass(frozen=True)
class ResolvedProbe:
    """One symbol in one library file, ready to attach."""
    spec: ProbeSpec
    path: str
    symbol: str          # mangled name, as attached
    display: str         # demangled, or the op name for operator probes


def _probe(library: str, raw: dict) -> ProbeSpec:
    name = raw.get("name")
    if not name or ("symbol" in raw) == ("pattern" in raw):
        raise ValueError(f"{library}: probe {name!r} needs exactly one of symbol or pattern")
    args = tuple(Arg(a["name"], a["type"]) for a in raw.get("args", []))
    for a in args:
        if a.type not in ARG_TYPES:
            raise ValueError(f"{library}.{name}: unknown arg type {a.type!r}")
    ret = raw.get("ret", "int")
    if ret not in RET_TYPES:
        raise ValueError(f"{library}.{name}: unknown ret type {ret!r}")
    deref = None
    if "deref" in raw:
        d = raw["deref"]
        if d["type"] not in DEREF_TYPES:
            raise ValueError(f"{library}.{name}: unknown deref type {d['type']!r}")
        # out-parameters are read at return, inputs at entry
        deref = Deref(int(d["arg"]), d["type"], d["name"], d.get("at", "exit") == "exit")
    return ProbeSpec(library, name, raw.get("symbol"), raw.get("pattern"), args, ret, deref,
                     bool(raw.get("default", False)), raw.get("family", library), raw.get("collective"),
                     bool(raw.get("entry_only", False)), raw.get("hint", ""), bool(raw.get("optional", False)),
                     bool(raw.get("python_stack", True)))


def load_specs(directory: Path = HERE) -> list[LibrarySpec]:
    specs = []
    for path in sorted(directory.glob("*.toml")):
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        lib = raw["library"]
        specs.append(LibrarySpec(lib, re.compile(raw["file_pattern"]),
                                 tuple(_probe(lib, p) for p in raw.get("probe", []))))
    return specs


def select(specs: list[LibrarySpec], libraries: set[str], op_pattern: str | None) -> list[LibrarySpec]:
    """The default-on probes of the chosen libraries, plus operator probes
    narrowed to `op_pattern` when one is given (operators are opt-in)."""
    out = []
    for lib in specs:
        chosen = []
        for p in lib.probes:
            if p.family == "ops":
                if op_pattern:
                    chosen.append(_narrow_ops(p, op_pattern))
            elif p.default and lib.library in libraries:
                chosen.append(p)
        if chosen:
            out.append(LibrarySpec(lib.library, lib.file_pattern, tuple(chosen)))
    return out


def _narrow_ops(p: ProbeSpec, op_pattern: str) -> ProbeSpec:
    try:
        re.compile(op_pattern)
    except re.error as e:
        raise UsageError(f"bad --ops pattern {op_pattern!r}: {e}") from None
    pattern = rf"^at::_ops::(?P<op>{op_pattern})::call\("
    return ProbeSpec(p.library, p.name, None, pattern, p.args, p.ret, p.deref, True, p.family,
                     p.collective, p.entry_only, p.hint, p.optional, p.python_stack)


def resolve(lib: LibrarySpec, path: str, read_from: str | None = None) -> tuple[list[ResolvedProbe], list[str]]:
    """Concrete probes for one mapped library file, and the spec entries that
    matched nothing there (reported, never silent).  `read_from` is where
    this process can read the file when that differs from the path the
    target maps (a container's /proc/PID/root)."""
    exact = {p.symbol for p in lib.probes if p.symbol}
    hints = {p.hint for p in lib.probes if p.pattern and p.hint}
    unhinted = any(p.pattern and not p.hint for p in lib.probes)
    symbols = function_symbols(read_from or path, exact, hints, everything=unhinted)
    found, missing = [], []
    for p in lib.probes:
        if p.symbol:
            if p.symbol in symbols:
                found.append(ResolvedProbe(p, path, p.symbol, p.symbol))
            elif not p.optional:
                missing.append(f"{p.name}: symbol {p.symbol} not in {path}")
            continue
        hint = p.hint
        # Local entities (_ZZ: lambdas, statics inside a function) and compiler
        # clones (.cold, .isra) are not the function itself.
        candidates = [s for s in symbols if (hint in s if hint else True)
                      and not s.startswith("_ZZ") and "." not in s]
        rx = re.compile(p.pattern)
        matched = 0
        for mangled, pretty in demangle(candidates).items():
            m = rx.search(pretty)
            if m:
                display = m.groupdict().get("op") or pretty.split("(", 1)[0]
                found.append(ResolvedProbe(p, path, mangled, display))
                matched += 1
        if not matched and not p.optional:
            missing.append(f"{p.name}: 0 functions matched {p.pattern!r} in {path}")
    return found, missing
