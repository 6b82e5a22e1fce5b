"""Who is on the other end of a connection: the peer's uid and gid on a Unix socket
(SO_PEERCRED), the uid that owns the client's end of a loopback TCP connection (one
NETLINK_SOCK_DIAG query for its 4-tuple; /proc/net/tcp where netlink is unavailable),
and whether that user is an administrator of the daemon (sees and aborts every user's
requests)."""
from __future__ import annotations

import errno
import grp
import itertools
import logging
import os
import pwd
import socket
import struct

logger = logging.getLogger("llmd.peer")

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
    """The uid that owns the client's end of a loopback TCP connection (`peer` is the
    client's address as our socket sees it, `local` ours). One NETLINK_SOCK_DIAG query
    for the exact 4-tuple, whose cost does not grow with the machine's connection count;
    where netlink cannot be used, a scan of /proc/net/tcp (or tcp6). Both block: call it
    in a thread, never on the event loop. -1 when it cannot be told (another network
    namespace, a closed socket)."""
    if _sock_diag_usable:
        try:
            uid = tcp_peer_uid_sock_diag(peer, local)
            # Not found: if our own end is found, the client's is really gone; if not,
            # either the connection is gone or this kernel's sock_diag does not know TCP
            # (no tcp_diag module, which also answers "no such socket"): ask /proc.
            if uid != -1 or tcp_peer_uid_sock_diag(local, peer) != -1:
                return uid
            uid = tcp_peer_uid_proc(peer, local)
            if uid != -1:
                _disable_sock_diag("it finds no TCP socket that /proc/net/tcp lists")
            return uid
        except SockDiagUnavailable as exc:
            _disable_sock_diag(exc)
    return tcp_peer_uid_proc(peer, local)


class SockDiagUnavailable(OSError):
    """This process cannot ask the kernel over NETLINK_SOCK_DIAG (no such protocol, a
    seccomp filter, a kernel without inet_diag)."""


_sock_diag_usable = True


def _disable_sock_diag(why: object) -> None:
    global _sock_diag_usable
    if _sock_diag_usable:
        _sock_diag_usable = False
        logger.warning("NETLINK_SOCK_DIAG is unavailable (%s): TCP peers are found by scanning /proc/net/tcp", why)


# Netlink and inet_diag wire formats (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h).
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
TCP_LISTEN = 10
_NLMSGHDR = struct.Struct("=IHHII")           # len, type, flags, seq, pid
_NLMSGERR = struct.Struct("=i")               # -errno, then the request's header
_REQ_HEAD = struct.Struct("=BBBBI")           # family, protocol, ext, pad, states
_SOCKID = struct.Struct(">HH16s16s")          # sport, dport (network order), src, dst
_SOCKID_TAIL = struct.Struct("=III")          # if, cookie[2] (host order)
_MSG_HEAD = struct.Struct("=BBBB")            # family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")           # expires, rqueue, wqueue, uid, inode
_SOCKID_SIZE = _SOCKID.size + _SOCKID_TAIL.size  # 48
_DIAG_MSG_SIZE = _MSG_HEAD.size + _SOCKID_SIZE + _MSG_TAIL.size  # 72
# errnos that mean "this process cannot use sock_diag" rather than "no such socket".
_UNAVAILABLE = {errno.EPERM, errno.EACCES, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EOPNOTSUPP,
                errno.ENOSYS, errno.EINVAL}
_seq = itertools.count(1)


def tcp_peer_uid_sock_diag(peer: tuple | None, local: tuple | None, timeout: float = 2.0) -> int:
    """The client's uid from one inet_diag exact lookup: an inet_diag_req_v2 whose id is
    the client socket's own (src = the client, dst = us), cookie INET_DIAG_NOCOOKIE; the
    kernel finds it in its connection hash and answers one inet_diag_msg carrying
    idiag_uid. -1 when there is no such socket (or only a time-wait remnant, whose uid
    the kernel reports as 0); SockDiagUnavailable when netlink cannot be used at all."""
    ends = _ends(peer, local)
    if ends is None:
        return -1
    family, (src, sport), (dst, dport) = ends
    seq = next(_seq)
    request = (_REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
               + _SOCKID.pack(sport, dport, src, dst)
               + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    message = _NLMSGHDR.pack(_NLMSGHDR.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + request
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except (OSError, AttributeError) as exc:  # AttributeError: no AF_NETLINK (not Linux)
        raise SockDiagUnavailable(str(exc)) from exc
    try:
        nl.settimeout(timeout)
        try:
            nl.sendto(message, (0, 0))
            while True:
                data = nl.recv(8192)
                uid = _diag_reply(data, seq, family, ends)
                if uid is not None:
                    return uid
        except socket.timeout:
            return -1
        except OSError as exc:
            if exc.errno in _UNAVAILABLE:
                raise SockDiagUnavailable(str(exc)) from exc
            return -1
    finally:
        nl.close()


def _diag_reply(data: bytes, seq: int, family: int, ends) -> int | None:
    """The uid in a reply datagram to request `seq`; None when the datagram answers
    another request (read on). Raises OSError(errno) for an error reply other than
    "no such socket"."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, reply_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            return -1
        body = offset + _NLMSGHDR.size
        offset += (length + 3) & ~3
        if reply_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            (error,) = _NLMSGERR.unpack_from(data, body)
            if error == 0 or -error in (errno.ENOENT, errno.ESTALE):
                return -1
            raise OSError(-error, os.strerror(-error))
        if kind != SOCK_DIAG_BY_FAMILY or length - _NLMSGHDR.size < _DIAG_MSG_SIZE:
            return -1
        got_family, state, _timer, _retrans = _MSG_HEAD.unpack_from(data, body)
        sport, dport, src, dst = _SOCKID.unpack_from(data, body + _MSG_HEAD.size)
        if got_family == socket.AF_INET6 and src[:12] == dst[:12] == _V4_MAPPED:
            # An IPv6 socket in an IPv4 connection (::ffff:a.b.c.d) is the one asked for.
            got_family, src, dst = socket.AF_INET, src[12:].ljust(16, b"\0"), dst[12:].ljust(16, b"\0")
        _expires, _rq, _wq, uid, inode = _MSG_TAIL.unpack_from(data, body + _MSG_HEAD.size + _SOCKID_SIZE)
        (_, (want_src, want_sport), (want_dst, want_dport)) = ends
        # The kernel's exact lookup falls back to a listening socket on the client's
        # port; a time-wait remnant (inode 0) reports uid 0. Neither is the client.
        if (got_family != family or state == TCP_LISTEN or inode == 0
                or (sport, dport, src, dst) != (want_sport, want_dport, want_src, want_dst)):
            return -1
        return uid
    return None


def tcp_peer_uid_proc(peer: tuple | None, local: tuple | None) -> int:
    """The same answer from /proc/net/tcp (or tcp6): the row whose local address is the
    client's and remote address ours. Reads the whole table (a line per socket on the
    machine): the fallback where netlink is unavailable, and only off the event loop."""
    ends = _ends(peer, local)
    if ends is None:
        return -1
    family, (src, sport), (dst, dport) = ends
    table = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    want = (_proc_address(family, src, sport), _proc_address(family, dst, dport))
    try:
        with open(table) as f:
            next(f)
            for line in f:
                if want[0] not in line:  # a cheap test before splitting each line
                    continue
                fields = line.split()
                if (fields[1], fields[2]) == want:
                    # inode 0: a time-wait remnant (or an orphan), whose uid reads 0.
                    return int(fields[7]) if fields[9] != "0" else -1
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return -1


def _ends(peer: tuple | None, local: tuple | None) -> tuple[int, tuple[bytes, int], tuple[bytes, int]] | None:
    """(family, (client address, port), (our address, port)) with addresses packed as
    16 bytes (IPv4 in the first four); an IPv4 client of a dual-stack listener
    (::ffff:a.b.c.d on both ends) is an AF_INET socket and is looked up as one."""
    if not peer or not local or not isinstance(peer, tuple) or not isinstance(local, tuple):
        return None
    try:
        family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
        src = socket.inet_pton(family, peer[0].split("%", 1)[0])
        dst = socket.inet_pton(family, local[0].split("%", 1)[0])
        sport, dport = int(peer[1]), int(local[1])
    except (OSError, ValueError, TypeError, IndexError):
        return None
    if family == socket.AF_INET6 and src[:12] == dst[:12] == _V4_MAPPED:
        family, src, dst = socket.AF_INET, src[12:], dst[12:]
    return family, (src.ljust(16, b"\0"), sport), (dst.ljust(16, b"\0"), dport)


_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def _proc_address(family: int, packed: bytes, port: int) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word in host byte order, in hex."""
    raw = packed[:4] if family == socket.AF_INET else packed
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"
