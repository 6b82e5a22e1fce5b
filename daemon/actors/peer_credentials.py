"""Who is on the other end of a connection: the peer's uid and gid on a Unix socket
(SO_PEERCRED), the uid that owns the client's end of a loopback TCP connection (from
/proc/net/tcp), and whether that user is an administrator of the daemon (sees and
aborts every user's requests)."""
from __future__ import annotations

import grp
import os
import pwd
import socket
import struct

_PEERCRED = struct.Struct("3i")


def peer_ids(sock: socket.socket | None) -> tuple[int, int]:
    """(uid, gid) of a Unix socket's peer (SO_PEERCRED); (-1, -1) when it cannot be told."""
    try:
        _pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return uid, gid
    except (OSError, AttributeError):
        return -1, -1


def is_admin(uid: int, gid: int, admin_group: str | None) -> bool:
    """Root, the daemon's own user, and members of `admin_group` (by primary group or
    membership) are administrators."""
    if uid in (0, os.getuid()):
        return True
    if not admin_group:
        return False
    try:
        group = grp.getgrnam(admin_group)
    except KeyError:
        return False
    if gid == group.gr_gid:
        return True
    try:
        return pwd.getpwuid(uid).pw_name in group.gr_mem
    except KeyError:
        return False


def tcp_peer_uid(peer: tuple | None, local: tuple | None) -> int:
    """The uid that owns the client's end of a loopback TCP connection: the row of
    /proc/net/tcp (or tcp6) whose local address is the peer's and remote address ours.
    -1 when it cannot be told (another network namespace, a closed socket)."""
    if not peer or not local:
        return -1
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    table = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    want = (_proc_address(family, peer[0], peer[1]), _proc_address(family, local[0], local[1]))
    try:
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if (fields[1], fields[2]) == want:
                    return int(fields[7])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return -1


def _proc_address(family: int, host: str, port: int) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word in host byte order, in hex."""
    raw = socket.inet_pton(family, host.split("%", 1)[0])
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"
