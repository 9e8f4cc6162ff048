"""The link's control protocol without I/O (``protocol.LinkProtocol``), driven with byte strings.

No loop and no socket: frames cut at every byte, many frames in one chunk,
the classification of every message type for each end's request-id parity,
the failed state after a malformed frame, and the bound on buffered bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from aio_datadist import protocol, wire
from aio_datadist.protocol import LinkProtocol
from aio_datadist.wire import Msg, ProtocolError

REPLIES = (Msg.RESP, Msg.DONE, Msg.PROBE_ACK, Msg.UNLINK_ACK)
HANDSHAKE = (Msg.HELLO, Msg.HELLO_ACK, Msg.AUTH, Msg.LINK_OK)
IDS = (0, 1, 2, 3, 6, 2**63, 2**64 - 2, 2**64 - 1)


def record_of(msg: Msg, seed: int = 1) -> Any:
    """A valid record of ``msg`` whose fields all differ from their zero value."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(wire.RECORDS[msg]):
        fmt = f.metadata["fmt"]
        if fmt == "rows":
            fields[f.name] = (seed, seed + 1, 2**64 - 1)
        elif fmt == "text":
            fields[f.name] = f"text {seed} \u00e9"
        elif fmt == "blob":
            fields[f.name] = bytes([seed % 256]) * 7
        elif fmt.endswith("s"):
            fields[f.name] = bytes([seed % 256]) * int(fmt[:-1])
        elif f.name == "flags":
            fields[f.name] = seed % 32
        else:
            fields[f.name] = seed
    return wire.RECORDS[msg](**fields)


def frame(msg: Msg, req_id: int, seed: int = 1) -> bytes:
    return wire.encode_record(msg, req_id, record_of(msg, seed))


def expected(msg: Msg, req_id: int, record: Any, is_client: bool) -> protocol.Event:
    """The event the link acts on, written out from the protocol's rules (the module docstring)."""
    ours = (req_id % 2 == 1) == is_client  # the client's ids are odd, the server's even (0 included)
    if msg is Msg.PROBE:
        return protocol.Probe(req_id)
    if msg is Msg.PING:
        return protocol.Ping(req_id)
    if msg is Msg.UNLINK:
        return protocol.Unlink(req_id)
    if msg is Msg.ABORT:
        return protocol.Abort(req_id, record, peers_request=req_id != 0 and not ours)
    if msg in REPLIES and ours:
        return protocol.Reply(msg, req_id, record)
    if msg is Msg.NIXL:
        return protocol.Nixl(req_id, record)
    return protocol.PeerRequest(msg, req_id, record)


#: Several frames of different shapes (rows, text, blob, empty bodies) back to back.
STREAM_MSGS = [(Msg.PROBE, 4), (Msg.PULL_REQ, 5), (Msg.RESP, 1), (Msg.NIXL, 0), (Msg.PING, 0),
               (Msg.PUSH_LOCAL, 7), (Msg.DONE, 9), (Msg.ABORT, 11), (Msg.UNLINK, 2)]


def stream() -> tuple[bytes, list[int], list[protocol.Event]]:
    """The frames of STREAM_MSGS as one byte string, where each frame ends, and a client's events."""
    data, ends, events = b"", [], []
    for seed, (msg, req_id) in enumerate(STREAM_MSGS, 1):
        data += frame(msg, req_id, seed)
        ends.append(len(data))
        events.append(expected(msg, req_id, record_of(msg, seed), is_client=True))
    return data, ends, events


# -- classification -------------------------------------------------------------------------


@pytest.mark.parametrize("is_client", [True, False], ids=["client", "server"])
@pytest.mark.parametrize("msg", list(Msg), ids=lambda m: m.name)
def test_every_message_type_is_classified_for_each_parity(msg: Msg, is_client: bool) -> None:
    for req_id in IDS:
        proto = LinkProtocol(is_client)
        (event,) = proto.receive(frame(msg, req_id))
        assert event == expected(msg, req_id, record_of(msg), is_client), (msg, req_id)
        assert type(getattr(event, "record", record_of(msg))) is wire.RECORDS[msg]


def test_replies_are_ours_by_parity_and_the_rest_goes_to_the_request_handler() -> None:
    client, server = LinkProtocol(is_client=True), LinkProtocol(is_client=False)
    assert client.is_mine(1) and not client.is_mine(2) and not client.is_mine(0)
    assert server.is_mine(2) and server.is_mine(0) and not server.is_mine(1)
    for msg in REPLIES:
        assert type(client.receive(frame(msg, 7))[0]) is protocol.Reply
        assert type(client.receive(frame(msg, 8))[0]) is protocol.PeerRequest
        assert type(server.receive(frame(msg, 8))[0]) is protocol.Reply
        assert type(server.receive(frame(msg, 0))[0]) is protocol.Reply
        assert type(server.receive(frame(msg, 7))[0]) is protocol.PeerRequest
    for msg in (Msg.PULL_REQ, Msg.PUSH_REQ, Msg.PUSH_LOCAL, *HANDSHAKE):  # whatever the id
        for proto, req_id in ((client, 1), (client, 2), (server, 1), (server, 2)):
            event = proto.receive(frame(msg, req_id))[0]
            assert event == protocol.PeerRequest(msg, req_id, record_of(msg)), (msg, proto.is_client, req_id)


def test_an_abort_names_a_peers_request_only_by_a_nonzero_id_of_the_peers_parity() -> None:
    cases = {(True, 0): False, (True, 1): False, (True, 2): True, (False, 0): False, (False, 1): True,
             (False, 2): False}
    for (is_client, req_id), peers in cases.items():
        (event,) = LinkProtocol(is_client).receive(frame(Msg.ABORT, req_id))
        assert isinstance(event, protocol.Abort)
        assert event.peers_request is peers, (is_client, req_id)
        assert (event.record.channel, event.record.generation) == (1, 1)


# -- framing ----------------------------------------------------------------------------------


def test_frames_cut_at_every_byte_boundary_give_the_same_events() -> None:
    data, _, events = stream()
    for cut in range(len(data) + 1):
        proto = LinkProtocol(is_client=True)
        got = proto.receive(data[:cut]) + proto.receive(data[cut:])
        assert got == events, cut
        assert proto.pending_bytes == 0 and proto.error is None
    for first in range(0, len(data), 7):  # three pieces: every second cut after every 7th first one
        for second in range(first, len(data) + 1):
            proto = LinkProtocol(is_client=True)
            got = proto.receive(data[:first]) + proto.receive(data[first:second]) + proto.receive(data[second:])
            assert got == events, (first, second)


def test_a_stream_fed_byte_by_byte_completes_each_frame_on_its_last_byte() -> None:
    data, ends, events = stream()
    proto = LinkProtocol(is_client=True)
    got: list[protocol.Event] = []
    start = 0
    for i in range(len(data)):
        now = proto.receive(data[i:i + 1])
        if i + 1 in ends:
            assert now == [events[ends.index(i + 1)]], i
            start = i + 1
        else:
            assert now == [], i
        assert proto.pending_bytes == i + 1 - start
        got += now
    assert got == events


def test_many_frames_in_one_chunk_come_out_in_order() -> None:
    data, _, events = stream()
    probes = b"".join(frame(Msg.PROBE, i) for i in range(1000))
    proto = LinkProtocol(is_client=False)
    got = proto.receive(probes + data * 20 + data[:5])
    assert got[:1000] == [protocol.Probe(i) for i in range(1000)]
    assert len(got) == 1000 + 20 * len(events)
    assert proto.pending_bytes == 5
    assert proto.receive(data[5:]) == [expected(m, r, record_of(m, s), is_client=False)
                                       for s, (m, r) in enumerate(STREAM_MSGS, 1)]
    assert proto.receive(b"") == [] and proto.pending_bytes == 0


def test_events_are_parsed_as_they_are_taken_and_a_caller_that_stops_leaves_the_rest() -> None:
    """``events`` parses one frame per event taken: a flood's chunk never holds thousands of events at once
    (the link acts on each before the next is parsed), and a malformed frame later in the chunk is not
    reached while the events before it are taken."""
    probes = b"".join(frame(Msg.PROBE, i) for i in range(1000))
    proto = LinkProtocol(is_client=False)
    taken = proto.events(probes + BAD_FRAMES["type"])
    assert next(taken) == protocol.Probe(0) and next(taken) == protocol.Probe(1)
    assert proto.error is None  # the bad frame at the end is not parsed yet
    taken.close()  # the caller stops (its link ended): the rest stays buffered, unparsed
    assert proto.pending_bytes == len(probes) + len(BAD_FRAMES["type"]) - 2 * len(frame(Msg.PROBE, 0))
    assert proto.receive(b"") == [protocol.Probe(i) for i in range(2, 1000)]
    assert isinstance(proto.error, ProtocolError)


# -- the failed state -------------------------------------------------------------------------


def header(msg: int = Msg.PING, req_id: int = 0, length: int = 0, *, magic: bytes = wire.MAGIC,
           version: int = wire.VERSION) -> bytes:
    return wire.HEADER.pack(magic, version, msg, 0, req_id, length)


BAD_FRAMES = {
    "magic": header(magic=b"XXXX"),
    "version": header(version=wire.VERSION - 1),
    "type": header(msg=99),
    "oversize": header(length=wire.MAX_BODY + 1),
    "huge": header(length=2**32 - 1),
    "short body": header(Msg.PULL_REQ, 1, 3) + b"abc",
    "trailing bytes": header(Msg.PING, 0, 1) + b"x",
    "row count": frame(Msg.PULL_REQ, 1)[:-40] + b"\xff" * 40,
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_a_malformed_frame_fails_the_protocol_for_good(name: str) -> None:
    bad = BAD_FRAMES[name]
    proto = LinkProtocol(is_client=True)
    with pytest.raises(ProtocolError) as first:
        proto.receive(bad)
    assert proto.error is first.value
    assert proto.pending_bytes == 0
    for later in (frame(Msg.PROBE, 2), b"", bad):  # nothing more is parsed: the same error, every time
        with pytest.raises(ProtocolError) as again:
            proto.receive(later)
        assert again.value is first.value
    assert proto.pending_bytes == 0


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_the_frames_before_a_malformed_one_are_returned_then_the_error_stays(name: str) -> None:
    data, _, events = stream()
    proto = LinkProtocol(is_client=True)
    assert proto.receive(data + BAD_FRAMES[name] + frame(Msg.PROBE, 2)) == events
    assert isinstance(proto.error, ProtocolError)
    with pytest.raises(ProtocolError) as later:
        proto.receive(b"")
    assert later.value is proto.error


def test_a_bad_header_fails_on_its_last_byte_and_a_bad_body_on_its_last() -> None:
    proto = LinkProtocol(is_client=True)
    bad = header(magic=b"XXXX")
    for i in range(len(bad) - 1):
        assert proto.receive(bad[i:i + 1]) == []
    with pytest.raises(ProtocolError, match="magic"):
        proto.receive(bad[-1:])
    proto = LinkProtocol(is_client=True)
    bad = BAD_FRAMES["short body"]
    for i in range(len(bad) - 1):
        assert proto.receive(bad[i:i + 1]) == []
    with pytest.raises(ProtocolError, match="truncated"):
        proto.receive(bad[-1:])


def test_an_oversize_length_fails_on_the_header_and_the_largest_body_stays_bounded() -> None:
    proto = LinkProtocol(is_client=False)
    with pytest.raises(ProtocolError, match="exceeds"):
        proto.receive(header(length=wire.MAX_BODY + 1))  # no body byte needed to refuse it
    proto = LinkProtocol(is_client=False)
    assert proto.receive(header(length=wire.MAX_BODY)) == []
    chunk = bytes(64 * 1024)
    fed = 0
    while fed + len(chunk) < wire.MAX_BODY:
        assert proto.receive(chunk) == []
        fed += len(chunk)
        assert proto.pending_bytes == wire.HEADER.size + fed <= wire.HEADER.size + wire.MAX_BODY
    with pytest.raises(ProtocolError, match="trailing bytes"):  # a PING's body is empty
        proto.receive(bytes(wire.MAX_BODY - fed) + frame(Msg.PROBE, 2))
    assert proto.pending_bytes == 0
