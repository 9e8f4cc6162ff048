"""The link's control protocol without I/O: bytes in, typed events out.

A :class:`LinkProtocol` is what one end of an established link makes of the
bytes its control connection receives, in the manner of h11's connection
object for HTTP: it owns no socket, no loop and no timer, so a test (or a
fuzzer) drives it with any byte string cut at any point. The link's reader
(``Link._control_data``) feeds it each chunk it reads and acts on the events, in
order; answering them (a ``PROBE_ACK``, failing a link) is the reader's job.

Framing: a 20-byte header (``wire.parse_header``), then the body its length
names, decoded into the message's typed record (``wire.decode``). A frame
may arrive in any number of pieces; the object keeps at most one incomplete
frame, which is bounded by ``wire.HEADER.size + wire.MAX_BODY`` (a header
naming a longer body is an error at once, before any of the body arrives).

Events, one per message, classified as the link acts on them:

- :class:`Probe`: a ``PROBE``, to be answered with ``PROBE_ACK`` and its id.
- :class:`Ping`: a ``PING``; nothing to do but note the peer is alive.
- :class:`Unlink`: an ``UNLINK``, to be acknowledged before the link closes.
- :class:`Abort`: an ``ABORT``; ``peers_request`` when its id is a request
  the peer made (nonzero and of the peer's parity), which this end may be
  serving, rather than one of ours.
- :class:`Reply`: a ``RESP``, ``DONE``, ``PROBE_ACK`` or ``UNLINK_ACK``
  carrying one of OUR request ids (:meth:`LinkProtocol.is_mine`): the answer
  to a request this end is waiting for.
- :class:`Nixl`: a ``NIXL`` record, whatever its id.
- :class:`PeerRequest`: everything else, for the link's request handler:
  ``PULL_REQ``, ``PUSH_REQ``, ``PUSH_LOCAL``, and ``RESP``, ``DONE``,
  ``PROBE_ACK`` or ``UNLINK_ACK`` with one of the peer's ids (a requester's
  ``DONE`` after a transfer this end served).

Request ids have a parity (``Link.new_req_id``): the client's are odd, the
server's even, so an id alone says which end made the request; id 0 is the
server's parity.

A handshake message (``HELLO``, ``HELLO_ACK``, ``AUTH``, ``LINK_OK``) on an
established link is well-formed, so it is not a protocol error: it becomes a
:class:`PeerRequest` and the request handler ignores it
(``owner.handle_request`` serves transfer requests only). A peer gains
nothing by it, and dropping the link for it would be a behaviour change
nothing calls for.

Errors: the first malformed frame (``wire.ProtocolError``) puts the object in
a failed state, kept in :attr:`LinkProtocol.error`. From then on every
:meth:`LinkProtocol.receive` raises that same error and parses nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from aio_datadist import wire
from aio_datadist.wire import Msg, ProtocolError

__all__ = ["Abort", "Event", "LinkProtocol", "Nixl", "PeerRequest", "Ping", "Probe", "Reply", "Unlink"]

#: Messages that answer a request; they are a :class:`Reply` when they carry one of our ids.
REPLIES = frozenset({Msg.RESP, Msg.DONE, Msg.PROBE_ACK, Msg.UNLINK_ACK})


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """The peer's heartbeat ``PROBE``: answer ``PROBE_ACK`` with ``req_id``."""

    req_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Ping:
    """A ``PING``: the peer is alive; nothing to answer."""

    req_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unlink:
    """The peer unlinks: acknowledge with ``UNLINK_ACK`` and ``req_id``, then close."""

    req_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """An ``ABORT``: reset data channel ``record.channel`` if it is still at ``record.generation``;
    with ``peers_request``, also stop serving the peer's request ``req_id``."""

    req_id: int
    record: wire.Abort
    peers_request: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """``RESP``, ``DONE``, ``PROBE_ACK`` or ``UNLINK_ACK`` answering our request ``req_id``."""

    msg: Msg
    req_id: int
    record: wire.Resp | wire.Done | wire.Empty


@dataclasses.dataclass(frozen=True, slots=True)
class PeerRequest:
    """A message for the link's request handler (see the module docstring for which)."""

    msg: Msg
    req_id: int
    record: Any  # a wire.Record: TransferReq, PushLocalReq, Done, Resp, ...


@dataclasses.dataclass(frozen=True, slots=True)
class Nixl:
    """One step of the NIXL exchange."""

    req_id: int
    record: wire.NixlRecord


#: What :meth:`LinkProtocol.receive` returns a list of.
Event = Probe | Ping | Unlink | Abort | Reply | PeerRequest | Nixl


class LinkProtocol:
    """One end of an established link's control connection, without I/O.

    ``is_client`` says which end this is: the client's request ids are odd,
    the server's even.
    """

    __slots__ = ("is_client", "error", "_buffer", "_head")

    def __init__(self, is_client: bool) -> None:
        self.is_client = is_client
        #: The error that failed this object, or None while every frame so far was well-formed.
        self.error: ProtocolError | None = None
        self._buffer = bytearray()
        self._head: tuple[Msg, int, int] | None = None  # the parsed header of the frame being received

    def is_mine(self, req_id: int) -> bool:
        """Whether ``req_id`` is of this end's parity (a request this end made)."""
        return (req_id % 2 == 1) == self.is_client

    @property
    def pending_bytes(self) -> int:
        """Bytes received of a frame not yet complete (0 between frames and once failed)."""
        return len(self._buffer) + (wire.HEADER.size if self._head is not None else 0)

    def receive(self, data: bytes) -> list[Event]:
        """The events of every frame ``data`` completes, in order.

        A malformed frame fails the object (:attr:`error`). When it came
        before any complete frame of this call, ``receive`` raises it; when
        complete frames came before it, ``receive`` returns their events and
        the caller finds :attr:`error` set (the next call raises it). Once
        failed, every call raises that same error without parsing ``data``.
        """
        return list(self.events(data))

    def events(self, data: bytes) -> Iterator[Event]:
        """:meth:`receive`'s events, each parsed as it is taken, so that a chunk of thousands of small frames
        (a flood) never holds thousands of events at once: objects that live across the collector's young
        passes get it to run full collections, each ~0.2 s of the loop with torch loaded. A caller that stops
        taking them (its link ended) leaves the rest unparsed in the buffer."""
        if self.error is not None:
            raise self.error
        buf = self._buffer
        buf += data
        pos = 0
        given = False
        try:
            while True:
                if self._head is None:
                    if len(buf) - pos < wire.HEADER.size:
                        break
                    self._head = wire.parse_header(bytes(buf[pos:pos + wire.HEADER.size]))
                    pos += wire.HEADER.size
                msg, req_id, length = self._head
                if len(buf) - pos < length:
                    break
                record = wire.decode(msg, bytes(buf[pos:pos + length]))
                pos += length
                self._head = None
                given = True
                yield self._event(msg, req_id, record)
        except ProtocolError as exc:
            self.error = exc
            self._buffer = bytearray()
            self._head = None
            pos = 0
            if not given:
                raise
        finally:
            if self.error is None:
                del buf[:pos]

    def _event(self, msg: Msg, req_id: int, record: Any) -> Event:
        if msg is Msg.PROBE:
            return Probe(req_id)
        if msg is Msg.PING:
            return Ping(req_id)
        if msg is Msg.UNLINK:
            return Unlink(req_id)
        if msg is Msg.ABORT:
            return Abort(req_id, record, peers_request=bool(req_id) and not self.is_mine(req_id))
        if msg in REPLIES and self.is_mine(req_id):
            return Reply(msg, req_id, record)
        if msg is Msg.NIXL:
            return Nixl(req_id, record)
        return PeerRequest(msg, req_id, record)
