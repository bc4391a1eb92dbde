"""
TCP keepalive on KCoral's connections between hosts: the services' (their
listening ports and outgoing pools) and the blocking client's.

A run forwarded to a worker may be silent for hours: its program runs and
nothing crosses the connection until the answer. If the link to the peer
goes silent meanwhile (a cable, a switch, a firewall's dropped state, a
host powered off: no reset, no ICMP error), nothing on an idle connection
ever tells either side, and the request would wait for its client's own
timeout, which a long program may not have. The kernel's keepalive probes
tell them apart: after C{idle_seconds} with nothing received it sends an
empty segment every C{interval_seconds}, and after C{count} unanswered ones
it ends the connection (ETIMEDOUT). A live peer's kernel answers each probe
whatever its processes are doing, so a long program on a live node is
never cut; the same is true of a frozen host, whose silence only its
reports show (the Router's C{--silent-node-seconds}).

Keepalive watches a connection only while it has nothing unacknowledged
to send: one whose peer went silent in the middle of a large body is
ended by the kernel's retransmission limit instead (C{net.ipv4.tcp_retries2},
about fifteen minutes by default).
"""

from __future__ import annotations

import socket

import attrs

#: Defaults of --keepalive-idle-seconds, --keepalive-interval-seconds and
#: --keepalive-count: a silent peer is found within 16 s.
IDLE_SECONDS = 10
INTERVAL_SECONDS = 2
COUNT = 3

#: Linux's limits on each socket's probes (TCP_KEEPIDLE and TCP_KEEPINTVL in
#: seconds, TCP_KEEPCNT): past them setsockopt fails, on every connection.
MOST_SECONDS = 32767
MOST_COUNT = 127


@attrs.frozen
class Keepalive:
    """The kernel's probes of a connection with nothing to send: after
    C{idle_seconds} of silence, one every C{interval_seconds}, C{count}
    unanswered ones end it."""

    idle_seconds: int = IDLE_SECONDS
    interval_seconds: int = INTERVAL_SECONDS
    count: int = COUNT

    @property
    def bound(self) -> int:
        """The longest a silent peer goes unnoticed on an idle connection."""
        return self.idle_seconds + self.interval_seconds * self.count

    def apply(self, sock: socket.socket) -> None:
        """Probe C{sock} (a TCP socket) so."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.idle_seconds)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.interval_seconds)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.count)

    def apply_to(self, transport: object) -> bool:
        """
        Probe the TCP socket under C{transport}, through any layers above it
        (a TLS protocol's C{transport} is the connection it runs on);
        returns whether there was one (a UNIX socket, a test's transport:
        no).
        """
        while transport is not None:
            # Twisted's ISystemHandle, read without importing Twisted here:
            # the blocking client uses this module too.
            get_handle = getattr(transport, "getHandle", None)
            handle = get_handle() if get_handle is not None else None
            if isinstance(handle, socket.socket) and handle.family in (
                    socket.AF_INET, socket.AF_INET6) and handle.type == socket.SOCK_STREAM:
                self.apply(handle)
                return True
            transport = getattr(transport, "transport", None)
        return False


#: The services' defaults, and the blocking client's probes.
DEFAULT_KEEPALIVE = Keepalive()
