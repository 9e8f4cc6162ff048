"""A hostile local process at an endpoint's same-host share socket (run as a separate program).

It imports nothing of aio_datadist: it speaks the share protocol from its
description (docs/security.md), as an attacker would, and prints one JSON
object with what it got. Modes:

- ``sniffer NAME TOKEN_HEX [REPLAY_HEX]``: knows what crossed the wire in the
  clear (the socket name, the link token) and, optionally, a claim that a
  legitimate peer sent on another connection. Tries the old bearer-token
  hello, a claim keyed by the token alone, a random claim and the replay.
  Reports the bytes and fds received per attempt.
- ``peer NAME TOKEN_HEX SECRET_HEX``: a peer that knows the secret (a linked,
  hostile process). Authenticates, collects the memfds it is given and tries
  to write through them every way it can; reports what worked.
- ``records NAME TOKEN_HEX SECRET_HEX SEED``: authenticates, then sends one
  malformed share record per connection (truncated, oversized, wrong fd
  count, unsealed or resized memfds, extents outside the region, replays),
  reconnecting after each; reports how each connection ended.
- ``fuzz FD SEED COUNT``: sends COUNT generated (often malformed) records
  with real memfds, sealed or not, on an inherited share socket.
- ``ledger FD``: plays an owner with a read ledger on an inherited share
  socket and sets its ledger's word as told on stdin.
- ``flood NAME COUNT SECONDS``: opens COUNT connections and never speaks;
  holds them SECONDS; reports how many the endpoint closed meanwhile.
- ``seal_race FD...``: on each inherited share socket in turn, sends an ADD of
  a 64-page memfd that is not sealed yet; once the receiver has taken the
  record off the socket it waits a little, shrinks the
  memfd to one page and only then seals it against shrink and grow (50 ms
  later: the receiver's thread may be preempted between two syscalls that
  long), so a receiver that checked the size before the seals maps 63 pages
  past the end of the file. Moves to the next socket when the receiver
  closes this one.
- ``hugetlb FD``: on an inherited share socket, sends an ADD of a memfd of two
  huge pages made with ``MFD_HUGETLB`` (populated when the host has free huge
  pages), sealed against shrink and grow as the receiver demands. Prints one
  JSON line, then waits for ``punch`` on stdin: punches a hole over its second
  page (``fallocate``, which the seals do not stop), takes every free huge page
  of the host for itself, prints a second line and holds them until stdin
  closes. A receiver that mapped the region and reads the hole then faults
  with SIGBUS.
- ``address_space FD...``: spends the receiver's address space with sparse
  memfds, sealed and of sizes the records allow (at most 1 TiB each, which
  cost this process nothing), from 1 TiB down to 64 MiB: at each size it
  first finds, on a share it gives up, how many more regions the receiver
  still maps before a mapping fails (the receiver then drops that share and
  unmaps it), then sends exactly that many on a share it keeps. Prints one
  JSON line with what it holds, then waits for its stdin to close.
- ``map_count FD...``: spends the receiver's mappings (``vm.max_map_count``)
  with one-page regions: 4096 a share (as many as one share may map) until a
  share is dropped or a region refused (answered ``UNMAPPED``), then 2048,
  1024, ... 1 on fresh shares, keeping every share. Reports as
  ``address_space`` does, with the regions the receiver refused.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import hmac
import json
import mmap
import os
import random
import socket
import struct
import sys
import time

MAGIC = b"AIDS"
CHALLENGE = struct.Struct("!4sB32s")
CLAIM = struct.Struct("!4s32s32s")
ACCEPT = struct.Struct("!4s32s")
ENTRY = struct.Struct("!BqQIQQQ")
READABLE = struct.Struct("!IQBQ")  # after an ADD record's offsets: ledger slot, model id, data type, shape digest
NO_SLOT = 0xFFFFFFFF
LEDGER_BYTES = 4096 * 8
F_SEAL_FUTURE_WRITE = 0x10


def proof(key: bytes, token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + token + first + second, hashlib.sha256).digest()


def dial(name: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(name)
    return sock


def drain(sock: socket.socket, seconds: float = 0.5) -> tuple[int, int, bool]:
    """(bytes, fds) received until the peer closes or ``seconds`` pass, and whether it closed."""
    got = fds = 0
    sock.settimeout(seconds)
    try:
        while True:
            data, anc, _flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i", payload[:len(payload) - len(payload) % 4])
                    fds += len(received)
                    for fd in received:
                        os.close(fd)
            if not data:
                return got, fds, True
            got += len(data)
    except (TimeoutError, socket.timeout):
        return got, fds, False
    except OSError:
        return got, fds, True


def sniffer(name: bytes, token: bytes, replay: bytes | None) -> dict:
    out = {}
    attempts = {
        "bearer token hello": lambda nonce: b"AIDL" + token,
        "claim keyed by the token": lambda nonce: CLAIM.pack(MAGIC, bytes(32), proof(token, token, b"share-client",
                                                                                      nonce, bytes(32))),
        "random claim": lambda nonce: CLAIM.pack(MAGIC, os.urandom(32), os.urandom(32)),
    }
    if replay is not None:
        attempts["replayed claim"] = lambda nonce: replay
    for what, make in attempts.items():
        sock = dial(name)
        try:
            first = sock.recv(1024)
            nonce = CHALLENGE.unpack(first)[2] if len(first) == CHALLENGE.size else bytes(32)
            sock.send(make(nonce))
            got, fds, closed = drain(sock)
            out[what] = {"challenge": len(first), "bytes": got, "fds": fds, "closed": closed}
        finally:
            sock.close()
    return out


def authenticate(name: bytes, token: bytes, secret: bytes) -> socket.socket:
    sock = dial(name)
    _, _, server_nonce = CHALLENGE.unpack(sock.recv(1024))
    mine = os.urandom(32)
    sock.send(CLAIM.pack(MAGIC, mine, proof(secret, token, b"share-client", server_nonce, mine)))
    answer = sock.recv(1024)
    assert ACCEPT.unpack(answer)[1] == proof(secret, token, b"share-server", mine, server_nonce)
    return sock


def receive_fds(sock: socket.socket, seconds: float = 1.0) -> list[tuple[bytes, int]]:
    got = []
    sock.settimeout(seconds)
    try:
        while True:
            data, anc, _flags, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4))
            if not data:
                break
            fd = -1
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fd = array.array("i", payload[:4])[0]
            got.append((data, fd))
            if data[0] == 3:  # READY: everything was offered
                break
    except (TimeoutError, socket.timeout):
        pass
    return got


def attempt(fn) -> str:
    try:
        fn()
        return "WORKED"
    except OSError as exc:
        return f"refused ({exc.strerror})"
    except Exception as exc:  # noqa: BLE001 - what failed is the report
        return f"refused ({type(exc).__name__})"


def peer(name: bytes, token: bytes, secret: bytes) -> dict:
    sock = authenticate(name, token, secret)
    records = receive_fds(sock)
    report = {"records": len(records), "fds": []}
    for data, fd in records:
        if fd < 0:
            continue
        size = os.fstat(fd).st_size
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        first = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)[:16]

        def reopen_and_map() -> None:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                m = mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                m[0:16] = b"\xee" * 16
            finally:
                os.close(rw)

        def reopen_and_write() -> None:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                os.pwrite(rw, b"\xee" * 16, 0)
            finally:
                os.close(rw)

        def reopen_and_truncate() -> None:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                os.ftruncate(rw, 0)
            finally:
                os.close(rw)

        def reopen_and_grow() -> None:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                os.ftruncate(rw, size + (1 << 20))
            finally:
                os.close(rw)

        def unseal() -> None:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                fcntl.fcntl(rw, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            finally:
                os.close(rw)

        report["fds"].append({
            "size": size,
            "read_only": mode == os.O_RDONLY,
            "seals": seals,
            "readable": len(first) == 16,
            "writable map": attempt(lambda: mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)),
            "write": attempt(lambda: os.pwrite(fd, b"\xee", 0)),
            "truncate": attempt(lambda: os.ftruncate(fd, 0)),
            "reopened writable map": attempt(reopen_and_map),
            "reopened write": attempt(reopen_and_write),
            "reopened truncate": attempt(reopen_and_truncate),
            "reopened grow": attempt(reopen_and_grow),
            "reopened add seal": attempt(unseal),
        })
        os.close(fd)
    sock.close()
    return report


def written(fd: int, size: int) -> None:
    """Write every page of ``fd``'s ``size`` bytes, as an honest sender's region is (fallocated pages that were
    never written are holes to ``SEEK_HOLE``, and refused)."""
    chunk = bytes(min(size, 1 << 20))
    for at in range(0, size, len(chunk)):
        os.pwrite(fd, chunk[:size - at], at)


def memfd(size: int, seals: int, populate: bool = True) -> int:
    """A memfd of ``size`` bytes with ``seals``; its pages in memory unless ``populate`` is False (a sparse
    file, which costs its maker nothing)."""
    fd = os.memfd_create("evil", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if populate and size:
        written(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not named by Python 3.11
#: What an honest sender's memfd carries: no resizing, no new writers, no more seals.
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


def entry(kind: int, cache_id: int, size: int, rows: int, row_bytes: int, offsets: list[int],
          tensor_bytes: int | None = None) -> bytes:
    return record(kind, cache_id, size, rows, row_bytes, rows * row_bytes if tensor_bytes is None else tensor_bytes,
                  offsets)


def ledger_record() -> bytes:
    return ENTRY.pack(6, 0, LEDGER_BYTES, 0, 0, 0, 0)


def bad_records(rng: random.Random) -> list[tuple[str, bytes | list[tuple[bytes, list[int]]], list[int]]]:
    """(what, bytes, fds) of one malformed message each, or (what, [(bytes, fds), ...], []) of a sequence whose
    last message is the bad one; fds are made fresh for each."""
    page = mmap.PAGESIZE
    good = entry(1, 7, 4 * page, 4, page, [0])
    listed = record(1, 7, 4 * page, 4, page, 4 * page, [0], slot=3, model_id=0)
    cases = [
        ("truncated header", good[:10], []),
        ("add without fd", good, []),
        ("add with two fds", good, [memfd(4 * page, SEALED), memfd(4 * page, SEALED)]),
        ("unsealed memfd", good, [memfd(4 * page, 0)]),
        ("memfd sealed against shrink only", good, [memfd(4 * page, fcntl.F_SEAL_SHRINK)]),
        ("memfd smaller than declared", entry(1, 7, 64 * page, 4, page, [0]), [memfd(4 * page, SEALED)]),
        ("memfd larger than declared", good, [memfd(8 * page, SEALED)]),
        ("tensor outside the region", entry(1, 7, 4 * page, 4, page, [page]), [memfd(4 * page, SEALED)]),
        ("offset overflowing u64 math", entry(1, 7, 4 * page, 4, page, [2**64 - page]), [memfd(4 * page, SEALED)]),
        ("geometry that does not multiply", entry(1, 7, 4 * page, 4, page, [0], tensor_bytes=3 * page),
         [memfd(4 * page, SEALED)]),
        ("zero rows", entry(1, 7, 4 * page, 0, page, [0]), [memfd(4 * page, SEALED)]),
        ("absurd region size", entry(1, 7, 1 << 50, 4, page, [0]), [memfd(4 * page, SEALED)]),
        ("tensor count without offsets", ENTRY.pack(1, 7, 4 * page, 4000, 4, page, 4 * page),
         [memfd(4 * page, SEALED)]),
        ("unknown kind", b"\x09" + good[1:], []),
        ("delete with an fd", entry(2, 7, 0, 0, 0, []), [memfd(page, SEALED)]),
        ("a pipe instead of a memfd", good, list(os.pipe())),
        ("random bytes", rng.randbytes(rng.randrange(1, 200)), []),
        ("oversized message", b"\x01" + rng.randbytes(40_000), []),
        # The read ledger (docs/security.md, "The read ledger").
        ("ledger without fd", ledger_record(), []),
        ("ledger of another size", ledger_record(), [memfd(LEDGER_BYTES // 2, SEALED)]),
        ("ledger declaring another size", ENTRY.pack(6, 0, 2 * LEDGER_BYTES, 0, 0, 0, 0),
         [memfd(2 * LEDGER_BYTES, SEALED)]),
        ("unsealed ledger", ledger_record(), [memfd(LEDGER_BYTES, 0)]),
        ("a pipe for a ledger", ledger_record(), list(os.pipe())),
        ("a slot before any ledger", listed, [memfd(4 * page, SEALED)]),
        ("a slot outside the ledger", [(ledger_record(), [memfd(LEDGER_BYTES, SEALED)]),
                                       (record(1, 7, 4 * page, 4, page, 4 * page, [0], slot=4096), [
                                           memfd(4 * page, SEALED)])], []),
        ("a second ledger", [(ledger_record(), [memfd(LEDGER_BYTES, SEALED)]),
                             (ledger_record(), [memfd(LEDGER_BYTES, SEALED)])], []),
        ("a read record with an fd", ENTRY.pack(7, 1, 4096, 1, 10, 0, 0), [memfd(page, SEALED)]),
        ("a read record of no reads", ENTRY.pack(7, 1, 4096, 0, 10, 0, 0), []),
        ("a read record of 2**32 - 1 reads", ENTRY.pack(7, 1, 4096, 2**32 - 1, 10, 0, 0), []),
    ]
    return cases


def records(name: bytes, token: bytes, secret: bytes, seed: int) -> dict:
    rng = random.Random(seed)
    report = {}
    for what, data, fds in bad_records(rng):
        sock = authenticate(name, token, secret)
        receive_fds(sock, 0.3)  # what the endpoint offers us first
        messages = data if isinstance(data, list) else [(data, fds)]
        try:
            for body, carried in messages:
                if carried:
                    socket.send_fds(sock, [body], carried)
                else:
                    sock.send(body)
        except OSError as exc:
            report[what] = f"send failed ({exc.strerror})"
            sock.close()
            continue
        finally:
            for _body, carried in messages:
                for fd in carried:
                    os.close(fd)
        _, _, closed = drain(sock, 2.0)
        report[what] = "dropped" if closed else "kept"
        sock.close()
    return report


def flood(name: bytes, count: int, seconds: float) -> dict:
    held = []
    refused = 0
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            sock.connect(name)
            held.append(sock)
        except OSError:
            refused += 1
            sock.close()
    print(json.dumps({"holding": len(held)}), flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    closed = 0
    for sock in held:
        try:
            while sock.recv(1024):  # a challenge may come first
                pass
            closed += 1
        except BlockingIOError:
            pass  # still open
        except OSError:
            closed += 1
        sock.close()
    return {"opened": len(held), "refused": refused, "closed by the endpoint": closed}


def record(kind: int, cache_id: int, size: int, rows: int, row_bytes: int, tensor_bytes: int,
           offsets: list[int], tensors: int | None = None, slot: int = NO_SLOT, model_id: int = 0) -> bytes:
    """A share record (an ADD with its readable trailer); ``tensors`` may differ from the offsets it carries."""
    count_field = len(offsets) if tensors is None else tensors
    body = ENTRY.pack(kind, cache_id, size, count_field, rows, row_bytes, tensor_bytes) + struct.pack(
        f"!{len(offsets)}Q", *offsets)
    return body + READABLE.pack(slot, model_id, 1, 0) if kind == 1 else body


def generated(rng: random.Random) -> tuple[bytes, int, int]:
    """A plausible record, then maybe broken: (bytes, fds it claims to carry, recv flags)."""
    rows = rng.choice([0, 1, 2, 7, 64, 2**40])
    row_bytes = rng.choice([0, 1, 512, mmap.PAGESIZE, 2**63])
    tensors = rng.choice([0, 1, 2, 5, 4096, 4097])
    tensor_bytes = rows * row_bytes if rng.random() < 0.8 else rng.randrange(0, 2**64)
    size = rng.choice([0, mmap.PAGESIZE, 4 * mmap.PAGESIZE, tensor_bytes, tensor_bytes * 2, 2**41, 2**64 - 1]) % 2**64
    offsets = [rng.choice([0, mmap.PAGESIZE, size, 2**64 - 1, rng.randrange(0, max(size, 1))]) % 2**64
               for _ in range(min(tensors, 8))]
    kind = rng.choice([1, 1, 1, 2, 3, 0, 9, 10, 6, 7])  # 9: ROOM; 0 and 10: no kind
    if kind == 6:  # LEDGER: its own size, or another
        size = rng.choice([LEDGER_BYTES, LEDGER_BYTES, mmap.PAGESIZE, 2**64 - 1])
    data = record(kind, rng.choice([1, 0, -1, 2**62]), size, rows % 2**64, row_bytes % 2**64, tensor_bytes % 2**64,
                  offsets, tensors, slot=rng.choice([NO_SLOT, NO_SLOT, 0, 4095, 4096, 2**31]),
                  model_id=rng.randrange(2**64))
    mutation = rng.random()
    if mutation < 0.1:
        data = data[:rng.randrange(len(data) + 1)]
    elif mutation < 0.2:
        pos = rng.randrange(len(data))
        data = data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1:]
    elif mutation < 0.25:
        data += rng.randbytes(rng.randrange(1, 64))
    nfds = rng.choice([1, 1, 1, 0, 2])
    flags = rng.choice([0, 0, 0, 0, socket.MSG_TRUNC, socket.MSG_CTRUNC])
    return data, nfds, flags


def fuzz(fd: int, seed: int, messages: int) -> dict:
    """Send ``messages`` generated records with real memfds (sealed or not, of various sizes) on ``fd``."""
    rng = random.Random(seed)
    sock = socket.socket(fileno=fd)
    sent = 0
    for _ in range(messages):
        size = rng.choice([mmap.PAGESIZE, 4 * mmap.PAGESIZE, LEDGER_BYTES, 64 * mmap.PAGESIZE])
        chance = rng.random()
        if chance < 0.3:  # a record that fits its fd, so the fuzz also reaches the mapping
            data, nfds = record(1, rng.randrange(1, 64), size, size // mmap.PAGESIZE, mmap.PAGESIZE, size, [0],
                                slot=rng.choice([NO_SLOT, rng.randrange(4096)]), model_id=rng.randrange(4)), 1
        elif chance < 0.4:  # a ledger, often of the right size, so slots are reached too
            data, nfds = ENTRY.pack(6, 0, LEDGER_BYTES, 0, 0, 0, 0), 1
        else:
            data, nfds, _flags = generated(rng)
        fds = []
        for _ in range(nfds):
            mfd = os.memfd_create("f", os.MFD_ALLOW_SEALING)
            os.ftruncate(mfd, size)
            if rng.random() < 0.7:  # mostly as an honest sender's (in memory, sealed), else sparse or unsealed
                if size and rng.random() < 0.8:
                    written(mfd, size)
                fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                            | (F_SEAL_FUTURE_WRITE if rng.random() < 0.8 else 0))
            fds.append(mfd)
        try:
            if fds:
                socket.send_fds(sock, [data[:40000] or b"\0"], fds)
            else:
                sock.send(data[:40000] or b"\0")
            sent += 1
        except OSError:
            break  # the share dropped us
        finally:
            for mfd in fds:
                os.close(mfd)
    return {"sent": sent}


def ledger(fd: int) -> None:
    """Play an owner with a read ledger on an inherited share socket: send a sealed ledger and one cache listed
    at slot 5 for blocks key 3, then set the slot's word as told on stdin (``list``: the cache's id 9,
    ``clear``: 0, ``other``: another id), printing one JSON line after each."""
    sock = socket.socket(fileno=fd)
    page = mmap.PAGESIZE
    words_fd, region_fd = memfd(LEDGER_BYTES, 0), memfd(4 * page, 0)
    words = mmap.mmap(words_fd, LEDGER_BYTES, flags=mmap.MAP_SHARED)
    for sealed in (words_fd, region_fd):
        fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, SEALED)
    socket.send_fds(sock, [ENTRY.pack(6, 0, LEDGER_BYTES, 0, 0, 0, 0)], [words_fd])
    socket.send_fds(sock, [record(1, 9, 4 * page, 4, page, 4 * page, [0], slot=5, model_id=3)], [region_fd])
    states = {"list": (9, "listed"), "clear": (0, "cleared"), "other": (10, "another id")}
    for line in sys.stdin:
        value, state = states[line.strip()]
        struct.pack_into("Q", words, 5 * 8, value)
        print(json.dumps({"state": state}), flush=True)
    sock.close()


def unread(sock: socket.socket) -> int:
    """Bytes we sent on ``sock`` that the receiver has not taken yet (SIOCOUTQ)."""
    import termios
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def dropped(sock: socket.socket, wait_s: float) -> bool:
    """Whether the receiver dropped the share (closed ``sock``) on the records sent so far. A fence follows them:
    a ``MAPPED`` record naming no cache of ours, which the receiver ignores. It reads records in order, so once
    it took the fence it acted on all before it (mapped them, or dropped the share and never read the fence).
    A fixed sleep instead counted a share as kept when a collector pause delayed the receiver's drop."""
    try:
        sock.send(ENTRY.pack(5, 0, 0, 0, 0, 0, 0))
    except BlockingIOError:
        pass
    except OSError:
        return True
    deadline = time.monotonic() + wait_s
    while True:
        taken = not unread(sock)  # the fence was read, or the queue went with a close: recv tells which
        try:
            if sock.recv(64) == b"":
                return True
        except BlockingIOError:
            pass
        except OSError:
            return True
        if taken or time.monotonic() > deadline:
            return False
        time.sleep(0.0005)


def answers(sock: socket.socket, count: int, wait_s: float) -> tuple[int, int] | None:
    """The receiver's answers to the ``count`` records sent on ``sock`` so far: ``(MAPPED, UNMAPPED)``, or None
    if it dropped the share (or did not answer them all within ``wait_s``)."""
    said = [0, 0]
    deadline = time.monotonic() + wait_s
    while sum(said) < count:
        try:
            data = sock.recv(64)
        except BlockingIOError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0005)
            continue
        except OSError:
            return None
        if not data:
            return None
        kind = data[0]
        if kind in (5, 8):  # MAPPED, UNMAPPED
            said[kind == 8] += 1
    return said[0], said[1]


def seal_race(fds: list[int]) -> dict:
    page = mmap.PAGESIZE
    sent = 0
    for fd in fds:
        sock = socket.socket(fileno=fd)
        region = memfd(64 * page, 0)
        try:
            try:
                socket.send_fds(sock, [record(1, 7, 64 * page, 64, page, 64 * page, [0])], [region])
            except OSError:
                break  # the receiver is gone
            sent += 1
            deadline = time.monotonic() + 2.0
            while unread(sock) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.05)  # the receiver is checking the fd meanwhile
            os.ftruncate(region, page)
            fcntl.fcntl(region, fcntl.F_ADD_SEALS, SEALED)
        finally:
            os.close(region)
        drain(sock, 5.0)  # until the receiver is done with this attempt
        sock.close()
    return {"sent": sent}


MFD_HUGETLB = 4
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def hugetlb(fd: int) -> None:
    import ctypes
    sock = socket.socket(fileno=fd)
    huge = _meminfo("Hugepagesize") * 1024 or 2 << 20
    try:
        region = os.memfd_create("evil-huge", os.MFD_ALLOW_SEALING | MFD_HUGETLB)
        os.ftruncate(region, 2 * huge)
    except OSError as exc:
        print(json.dumps({"unavailable": str(exc)}), flush=True)
        return
    populated = held = None
    try:
        held = mmap.mmap(region, 2 * huge)  # fails (ENOMEM) when the host has no free huge pages
        held[:] = b"\x01" * (2 * huge)
        populated = True
    except OSError:
        populated = False
    fcntl.fcntl(region, fcntl.F_ADD_SEALS, SEALED)
    socket.send_fds(sock, [record(1, 7, 2 * huge, 2, huge, 2 * huge, [0])], [region])
    deadline = time.monotonic() + 5.0
    while unread(sock) and time.monotonic() < deadline:
        time.sleep(0.001)
    print(json.dumps({"sent": 1, "populated": populated}), flush=True)
    if sys.stdin.readline().strip() != "punch":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    punched = libc.fallocate(region, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(huge),
                             ctypes.c_long(huge)) == 0
    free = _meminfo("HugePages_Free")
    eaten = None
    if free:
        eater = os.memfd_create("eat", MFD_HUGETLB)
        os.ftruncate(eater, free * huge)
        eaten = mmap.mmap(eater, free * huge)
        eaten[:] = b"\x02" * (free * huge)
    print(json.dumps({"punched": punched, "huge pages taken": free, "free now": _meminfo("HugePages_Free")}),
          flush=True)
    sys.stdin.read()  # hold the pages until the receiver is done
    del eaten, held


def address_space(fds: list[int]) -> dict:
    socks = [socket.socket(fileno=fd) for fd in fds]
    for sock in socks:
        sock.setblocking(False)
    kept: list[socket.socket] = []

    def closed(sock: socket.socket) -> bool:
        return dropped(sock, 10.0)

    def add(sock: socket.socket, cache_id: int, size: int, fd: int) -> None:
        socket.send_fds(sock, [record(1, cache_id, size, 1, size, size, [0])], [fd])

    held = 0
    for bits in range(40, 25, -1):
        size = 1 << bits
        fd = memfd(size, SEALED, populate=False)  # sparse: the region costs us nothing
        try:
            probe = socks.pop()
            fits = 0
            while fits < 4000:
                try:
                    add(probe, fits + 1, size, fd)
                except OSError:
                    break
                if closed(probe):
                    break
                fits += 1
            probe.close()
            if fits:
                keep = socks.pop()
                for n in range(fits):
                    add(keep, n + 1, size, fd)
                if closed(keep):
                    return {"held": held, "error": f"a share of {fits} regions of {size} bytes was dropped"}
                kept.append(keep)
                held += fits * size
        finally:
            os.close(fd)
    print(json.dumps({"held": held, "shares": len(kept)}), flush=True)
    sys.stdin.read()
    for sock in kept + socks:
        sock.close()
    return {"held": held}


def map_count(fds: list[int]) -> dict:
    socks = [socket.socket(fileno=fd) for fd in fds]
    kept: list[socket.socket] = []
    page = mmap.PAGESIZE
    one = memfd(page, SEALED)

    refused = 0

    def fill(count: int) -> int:
        """``count`` regions on a fresh share; how many the receiver mapped (-1: it dropped the share)."""
        nonlocal refused
        sock = socks.pop()
        sock.settimeout(10)
        try:
            for n in range(count):
                socket.send_fds(sock, [record(1, n + 1, page, 1, page, page, [0])], [one])
            sock.setblocking(False)
            said = answers(sock, count, 20.0)
        except OSError:
            said = None
        if said is None:
            sock.close()
            return -1
        kept.append(sock)
        refused += said[1]
        return said[0]

    held = 0
    try:
        while len(socks) > 12:
            mapped = fill(4096)
            held += max(mapped, 0)
            if mapped < 4096:
                break
        for bits in range(11, -1, -1):
            if socks:
                held += max(fill(1 << bits), 0)
    finally:
        os.close(one)
    print(json.dumps({"held": held * page, "regions": held, "shares": len(kept), "refused": refused}),
          flush=True)
    sys.stdin.read()
    for sock in kept + socks:
        sock.close()
    return {"held": held}


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "map_count":
        map_count([int(fd) for fd in argv[1:]])
        return
    if mode == "address_space":
        address_space([int(fd) for fd in argv[1:]])
        return
    if mode == "seal_race":
        print(json.dumps(seal_race([int(fd) for fd in argv[1:]])), flush=True)
        return
    if mode == "hugetlb":
        hugetlb(int(argv[1]))
        return
    if mode == "ledger":
        ledger(int(argv[1]))
        return
    if mode == "fuzz":
        print(json.dumps(fuzz(int(argv[1]), int(argv[2]), int(argv[3]))), flush=True)
        return
    name = bytes.fromhex(argv[1])
    if mode == "sniffer":
        result = sniffer(name, bytes.fromhex(argv[2]), bytes.fromhex(argv[3]) if len(argv) > 3 else None)
    elif mode == "peer":
        result = peer(name, bytes.fromhex(argv[2]), bytes.fromhex(argv[3]))
    elif mode == "records":
        result = records(name, bytes.fromhex(argv[2]), bytes.fromhex(argv[3]), int(argv[4]))
    elif mode == "flood":
        result = flood(name, int(argv[2]), float(argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
