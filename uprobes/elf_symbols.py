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
STT_FUNC, STT_GNU_IFUNC = 2, 10

# Elf64_Sym: st_name u32, st_info u8, st_other u8, st_shndx u16, st_value u64, st_size u64
ELF64_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                      ("value", "<u8"), ("size", "<u8")])


class NotAnElf(ValueError):
    pass


def _hit_offsets(strings: bytes, exact: set[str], substrings: set[str]) -> set[int]:
    """Offsets of the names in a string table that equal one of `exact`
    (optionally followed by @version) or contain one of `substrings`."""
    hits = set()
    for name in exact:
        for m in re.finditer(re.escape(b"\0" + name.encode()) + rb"(?=[\0@])", strings):
            hits.add(m.start() + 1)
    for sub in substrings:
        needle = sub.encode()
        i = strings.find(needle)
        while i >= 0:
            hits.add(strings.rfind(b"\0", 0, i) + 1)
            i = strings.find(needle, strings.find(b"\0", i) + 1)
    return hits


def function_symbols(path: str, exact: set[str] = frozenset(), substrings: set[str] = frozenset(),
                     everything: bool = False) -> dict[str, int]:
    """{name: st_value} of defined functions named in `exact`, or whose name
    contains one of `substrings` (or every function, if `everything`)."""
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
            strtab = sections[sh_link]
            strings = bytes(data[strtab[4]:strtab[4] + strtab[5]])
            syms = np.frombuffer(data, dtype=ELF64_SYM, count=sh_size // ELF64_SYM.itemsize,
                                 offset=sh_offset).copy()
            kind = syms["info"] & 0xF
            keep = syms[((kind == STT_FUNC) | (kind == STT_GNU_IFUNC)) & (syms["shndx"] != 0)
                        & (syms["value"] != 0)]
            if not everything:
                hits = _hit_offsets(strings, set(exact), set(substrings))
                keep = keep[np.isin(keep["name"], np.fromiter(hits, dtype=np.uint32, count=len(hits)))]
            for name_off, value in zip(keep["name"].tolist(), keep["value"].tolist()):
                end = strings.index(b"\0", name_off)
                name = strings[name_off:end].decode(errors="replace").split("@", 1)[0]
                out.setdefault(name, value)
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
