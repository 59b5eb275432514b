"""A process group's transport sockets, and aborting a collective stuck on them.

A network fault that loses traffic without resetting the connection (a
blackholed link, a half-open TCP connection after a switch flap) leaves a gloo
collective waiting until the group's timeout, 30 minutes by default, with
every member inside it.  Watcher's per-operation timeout (detector setting
`collective_timeout`) aborts such a collective by shutting down the group's
own sockets: the pending operation then fails on this rank, and the relink
path (relink.py) rebuilds the transport and issues it again.

A group's sockets are the ones its construction opened (gloo connects its
full mesh in the constructor), minus the c10d store's: the store must keep
working, as the rebuild meets on it.  No other socket of the program is
touched.
"""

from __future__ import annotations

import os
import socket


def socket_inodes() -> set[int]:
    """Inodes of this process's open sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def opened_since(before: set[int]) -> set[int]:
    """The sockets opened since `before`, without the c10d store's connections."""
    store_port = _store_port()
    new = set()
    for fd, inode in _fds_by_inode(socket_inodes() - before):
        if not _touches_port(fd, store_port):
            new.add(inode)
    return new


def abort(inodes: set[int]) -> int:
    """Shut down these sockets (both directions); returns how many.  Whoever
    waits on them wakes up with an error; the descriptors stay open, so no
    number is reused under gloo's feet."""
    n = 0
    for fd, _ in _fds_by_inode(inodes):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.getpeername()  # connected: never the listener, whose shutdown gloo takes as fatal
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass  # a listening or already closed socket
        finally:
            s.close()  # the duplicate only
    return n


def _store_port() -> int:
    """The port of the default c10d store (TCPStore, perhaps under PrefixStores)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        return int(getattr(store, "port"))
    except Exception:
        return int(os.environ.get("MASTER_PORT", "0") or 0)


def _fds_by_inode(inodes: set[int]):
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and int(link[8:-1]) in inodes:
            yield int(name), int(link[8:-1])


def _touches_port(fd: int, port: int) -> bool:
    if not port:
        return False
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        ends = []
        for get in (s.getsockname, s.getpeername):
            try:
                ends.append(get())
            except OSError:
                pass
        return any(isinstance(e, tuple) and len(e) >= 2 and e[1] == port for e in ends)
    finally:
        s.close()
