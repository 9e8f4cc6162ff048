"""File descriptors: how many links fit under ``RLIMIT_NOFILE``.

A link holds ``1 + 2 × aio.DataChannels`` sockets (a control connection and
the data channels of both directions; 5 by default), plus one share socket
when same-host sharing may be used (``aio.Transport`` ``auto`` or ``local``).
Before it makes or accepts a link an endpoint checks that those fds fit::

    open fds + fds promised to links not all open yet + fds per link + reserve <= soft RLIMIT_NOFILE

where the reserve is :data:`RESERVE` (caches, engines, event loops, a data
channel being redialled) plus, on a listening endpoint,
``5 × aio.MaxPendingHandshakes`` for connections in their handshake
(``admission.py``). A link that does not fit is refused with
``LLM_CLUSTER_NUM_EXCEED_LIMIT`` instead of failing later with ``EMFILE``.
A link's fds stay promised, less those open, until all are open or the link
ends: an accepted link opens its data channels after its handshake, when the
peer attaches them, and a dialled one opens as many as the peer's
``LINK_OK`` names (those past ``aio.DataChannels`` are claimed before they
are dialled).
So an endpoint can hold about ``(soft limit − fds open before linking −
reserve) // fds per link`` links. Where the hard limit allows, the first
endpoint of a process raises the soft limit to the hard one (at most
:data:`SOFT_TARGET`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket

from aio_datadist._forks import forks
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["ACCEPT_GONE", "ACCEPT_RETRY_S", "NO_ROOM", "RESERVE", "SOFT_TARGET", "Claim", "claim", "close_listening",
           "open_count", "per_link", "raise_soft_limit", "soft_limit"]

log = logging.getLogger("aio_datadist.links")

#: fds kept free for everything but links.
RESERVE = 64
#: How soon a listener (the link door, the same-host share socket) tries accept() again after it failed for want
#: of an fd or memory: nothing signals when one frees elsewhere in the process.
ACCEPT_RETRY_S = 0.05
#: accept() errors that mean "no fd or memory for it now": the connection stays in the backlog.
NO_ROOM = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
#: accept() errors that are about the one connection (gone before it was taken), not the listener: accept again
#: at once. Any other error (no room, or a listener gone bad: EBADF, EINVAL) waits ``ACCEPT_RETRY_S`` first.
ACCEPT_GONE = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR)
#: The soft limit is raised towards the hard one up to this many fds.
SOFT_TARGET = 1 << 20

_promised = 0  # process-wide, as the fd table is


def _after_fork_in_child() -> None:
    global _promised
    _promised = 0  # the links being made at the fork are the parent's: none of them is made in this process


os.register_at_fork(after_in_child=_after_fork_in_child)


def close_listening(sock: socket.socket) -> None:
    """Stop ``sock`` listening for good, then close it. A close only drops this fd: a child forked since holds
    the socket too, which then went on taking connections into its backlog that nobody answers (a dialler
    waited out its whole time-out) and kept the port from being listened on again. On Linux a shutdown of a
    listening socket stops it listening in every process that holds it."""
    with contextlib.suppress(OSError):  # (not connected: ENOTCONN on some kernels; nothing else to do then)
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def raise_soft_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` towards the hard limit where allowed; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = SOFT_TARGET if hard == resource.RLIM_INFINITY else min(hard, SOFT_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("raised the soft RLIMIT_NOFILE from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as exc:
            log.info("cannot raise the soft RLIMIT_NOFILE from %d: %s", soft, exc)
    return soft


def soft_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return SOFT_TARGET if soft == resource.RLIM_INFINITY else soft


def open_count() -> int:
    """The fds this process has open now (0 where ``/proc`` cannot tell; the whole soft limit when not one fd is
    left to list them with: read as empty, a full table let links through to fail on ``EMFILE``)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself used
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return soft_limit()
        return 0


def per_link(data_channels: int, shares_memory: bool) -> int:
    """The fds one link holds."""
    return 1 + 2 * data_channels + (1 if shares_memory else 0)


class Claim:
    """fds promised to one link while it is made; :meth:`less` as they open, :meth:`release` once all are open
    (or not needed)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._forks = forks()  # a claim of the parent's, released in a forked child, gives back none of the child's

    def less(self, n: int) -> None:
        """Give back ``n`` of the fds promised (at most what is left): they are open now, or not needed."""
        global _promised
        n = min(n, self.n)
        if self._forks == forks():
            _promised -= n
        self.n -= n

    def release(self) -> None:
        self.less(self.n)


def claim(n: int, reserve: int) -> Claim:
    """Promise ``n`` fds to a link being made.

    :raises LLMException: ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` naming the limit when they do not fit.
    """
    global _promised
    limit = soft_limit()
    used = open_count() + _promised
    if used + n + reserve > limit:
        raise LLMException(f"a link needs {n} more fds: {used} are open or promised to links being made, "
                           f"{reserve} are kept in reserve, and RLIMIT_NOFILE is {limit}",
                           status_code=LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT)
    _promised += n
    return Claim(n)
