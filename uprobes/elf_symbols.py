"""Defined function symbols of an ELF shared object, read straight from its
.dynsym (and .symtab when present).  Names keep their C/C++ (mangled) form
and lose any version suffix (`cudaMalloc@@libcudart.so.13` -> `cudaMalloc`).

libtorch_cpu.so holds ~350k symbols, so names are never all decoded: the
string table is searched for the wanted names and substrings, and only the
symbols whose names were hit are kept.  That keeps a late attach fast.
"""

from __future__ import annotations

import mmap
import re
import struct

import numpy as np

SHT_SYMTAB, SHT_DYNSYM = 2, 11
STT_OBJECT, STT_FUNC, STT_GNU_IFUNC = 1, 2, 10

# Elf64_Sym: st_name u32, st_info u8, st_other u8, st_shndx u16, st_value u64, st_size u64
ELF64_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                      ("value", "<u8"), ("size", "<u8")])


class NotAnElf(ValueError):
    pass


# The string table is scanned for NULs this many bytes at a time: a mask of
# the whole table (~70 MB for libtorch_cpu.so) would be a copy of its size.
NUL_SCAN_CHUNK = 1 << 22


def _nul_offsets(buf: np.ndarray) -> np.ndarray:
    parts = [np.flatnonzero(buf[i:i + NUL_SCAN_CHUNK] == 0) + i for i in range(0, len(buf), NUL_SCAN_CHUNK)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def _select(names: np.ndarray, strings, exact: set[str], substrings: set[str]) -> np.ndarray:
    """Mask of the symbols (by st_name offset) whose name equals one of
    `exact` (optionally followed by @version) or contains one of `substrings`.

    String tables share suffixes, so a name may start in the middle of another
    string: matches are found by position, never by string starts."""
    buf = np.frombuffer(strings, dtype=np.uint8)
    ends = _nul_offsets(buf)
    name_end = ends[np.minimum(np.searchsorted(ends, names), len(ends) - 1)]
    mask = np.zeros(len(names), dtype=bool)
    for name in exact:
        starts = [m.start() for m in re.finditer(re.escape(name.encode()) + rb"(?=[\0@])", strings)]
        mask |= np.isin(names, np.array(starts, dtype=np.int64))
    for sub in substrings:
        hits = np.array([m.start() for m in re.finditer(re.escape(sub.encode()), strings)], dtype=np.int64)
        if hits.size == 0:
            continue
        i = np.searchsorted(hits, names)
        ok = i < hits.size
        mask[ok] |= hits[i[ok]] < name_end[ok]
    return mask


def function_symbols(path: str, exact: set[str] = frozenset(), substrings: set[str] = frozenset(),
                     everything: bool = False) -> dict[str, int]:
    """{name: st_value} of defined functions named in `exact`, or whose name
    contains one of `substrings` (or every function, if `everything`)."""
    return defined_symbols(path, exact, substrings, everything)


def defined_symbols(path: str, exact: set[str] = frozenset(), substrings: set[str] = frozenset(),
                    everything: bool = False, objects: bool = False) -> dict[str, int]:
    """`function_symbols`, and data objects too when `objects` (an
    interpreter's globals, for one)."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # mapped, not read: libtorch is >400 MB
    try:
        if data[:4] != b"\x7fELF" or data[4] != 2:
            raise NotAnElf(f"{path} is not a 64-bit ELF file")
        e_shoff, = struct.unpack_from("<Q", data, 0x28)
        e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
        out: dict[str, int] = {}
        for sh in sections:
            sh_type, sh_offset, sh_size, sh_link = sh[1], sh[4], sh[5], sh[6]
            if sh_type not in (SHT_DYNSYM, SHT_SYMTAB):
                continue
            base = sections[sh_link][4]
            # Searched in place, in the mapping: a copy of libtorch's string
            # table would hold ~70 MB of anonymous memory through the attach.
            strings = memoryview(data)[base:base + sections[sh_link][5]]
            try:
                syms = np.frombuffer(data, dtype=ELF64_SYM, count=sh_size // ELF64_SYM.itemsize,
                                     offset=sh_offset).copy()
                kind = syms["info"] & 0xF
                wanted = (kind == STT_FUNC) | (kind == STT_GNU_IFUNC) | (objects & (kind == STT_OBJECT))
                keep = syms[wanted & (syms["shndx"] != 0)
                            & (syms["value"] != 0)]
                del syms, kind, wanted
                if not everything:
                    keep = keep[_select(keep["name"].astype(np.int64), strings, set(exact), set(substrings))]
                for name_off, value in zip(keep["name"].tolist(), keep["value"].tolist()):
                    end = data.find(b"\0", base + name_off) - base
                    name = bytes(strings[name_off:end]).decode(errors="replace").split("@", 1)[0]
                    out.setdefault(name, value)
            finally:
                strings.release()  # the mapping cannot close while a view of it lives
        return out
    finally:
        data.close()


def demangle(names: list[str]) -> dict[str, str]:
    """{mangled: demangled} through c++filt (binutils); names it cannot
    demangle map to themselves."""
    import shutil
    import subprocess

    if not names:
        return {}
    if shutil.which("c++filt") is None:
        return {n: n for n in names}
    res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, res.stdout.splitlines()))
