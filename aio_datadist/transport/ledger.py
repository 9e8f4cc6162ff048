"""The read ledger: which of our blocks caches same-host peers may read without asking, a word each.

A same-host pull asks the owner, which checks the request against the cache
it names and answers with that cache's id; the requester then copies out of
its read-only mapping of the cache (``transport/same_host.py``). For a pull
of a blocks cache by its blocks key the answer tells the requester nothing
it cannot check itself, given the cache's geometry (which the share record
declares) and one fact: that the owner still binds the key to that cache
and lets peers reach it over this transport. The ledger holds that fact.

It is one sealed memfd per endpoint (32 KiB, one fd), made with the
endpoint's link table when it may share memory (``aio.Transport`` auto or
local) and sent read-only to every same-host peer when a share starts. A blocks cache the library allocated
in shareable memory gets a slot while it is bound to its blocks key and
peers may reach it over the same-host transport (``llm.EnableRemoteCache
Accessible`` on, ``aio.RequireTransport`` met by ``local``); the slot's word
holds the cache's id for exactly that time. The word is cleared before the
cache is withdrawn from peers or freed, so a pull that starts after
``deallocate_cache`` returned sees it cleared and asks the owner, as before,
and gets the owner's answer. Whatever a peer does not find there (no slot, a
word that differs, a request that does not fit the declared geometry) it
asks for.

The ledger gives a peer nothing it could not read already: it maps those
caches read-only since the link came up. A ledger that lies only decides
which of its owner's own memory the reader copies; the reader checks each
slot it is told against the ledger's size.
"""

from __future__ import annotations

import os

from aio_datadist import _core
from aio_datadist._forks import forks
from aio_datadist.devices.host import ReadOnlyMapping, check_sealed, map_writable, sealed_memfd, unmap

__all__ = ["LEDGER_BYTES", "NO_SLOT", "SLOTS", "Ledger", "PeerLedger"]

#: Blocks caches one endpoint can list at once (as many as one peer may map of it); more are asked for.
SLOTS = 4096
LEDGER_BYTES = SLOTS * 8
#: The slot a share record names for a cache that is not in the ledger.
NO_SLOT = 0xFFFFFFFF


class Ledger:
    """This endpoint's ledger: publishes and clears the words (only this process can write them)."""

    def __init__(self) -> None:
        self._forks = forks()  # a forked child's copy only lets go (close): the words are the parent's
        self._addr, self._fd = sealed_memfd(LEDGER_BYTES, "aio_datadist.ledger",
                                            lambda fd: map_writable(fd, LEDGER_BYTES),
                                            lambda addr: unmap(addr, LEDGER_BYTES))
        self._entries: dict[int, tuple[int, int]] = {}  # cache id -> (slot, blocks key's model id)
        self._free = list(range(SLOTS - 1, -1, -1))
        self.closed = False

    @property
    def address(self) -> int:
        """Where the words are mapped here (the NIXL transport registers them for peers to read)."""
        return self._addr

    @property
    def fd(self) -> int:
        """The sealed memfd, read-only: what each same-host peer receives."""
        return self._fd

    def publish(self, cache_id: int, model_id: int, word: int | None = None) -> None:
        """Let peers read cache ``cache_id``, bound to blocks key ``model_id``, without asking: its slot's word
        holds ``word`` (non-zero; the cache id unless given) until :meth:`retract`."""
        if cache_id in self._entries or not self._free or self.closed:
            return
        slot = self._free.pop()
        self._entries[cache_id] = (slot, model_id)
        self._store(slot, cache_id if word is None else word)

    def retract(self, cache_id: int) -> None:
        """From now on peers ask for ``cache_id`` again (it is being withdrawn, unbound or freed)."""
        entry = self._entries.pop(cache_id, None)
        if entry is None or self.closed:
            return
        self._store(entry[0], 0)
        self._free.append(entry[0])

    def entry(self, cache_id: int) -> tuple[int, int] | None:
        """``(slot, model_id)`` of a published cache, or None."""
        return self._entries.get(cache_id)

    def word(self, cache_id: int) -> int:
        """What the word of a published cache holds (read back from the ledger itself)."""
        return _core.read_word(self._addr + 8 * self._entries[cache_id][0])

    def _store(self, slot: int, value: int) -> None:
        # One aligned store, fenced: a peer that reads the cleared word reads nothing the caller wrote into
        # the cache afterwards first, on weakly ordered CPUs (aarch64) too.
        _core.publish_word(self._addr + 8 * slot, value)

    def close(self) -> None:
        """Clear every word and let the memory go (peers' mappings keep reading zeros)."""
        if self.closed:
            return
        self.closed = True
        if self._forks == forks():  # in a forked child the mapping is the parent's ledger too: left as it is
            for slot, _model_id in self._entries.values():
                self._store(slot, 0)
        self._entries.clear()
        unmap(self._addr, LEDGER_BYTES)
        os.close(self._fd)

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close()


class PeerLedger:
    """A same-host peer's ledger, mapped read-only here."""

    __slots__ = ("_mapping",)

    def __init__(self, fd: int) -> None:
        check_sealed(fd, LEDGER_BYTES)  # ValueError: the share drops it
        self._mapping = ReadOnlyMapping(fd, LEDGER_BYTES)

    def holds(self, slot: int, cache_id: int) -> bool:
        """Whether the peer lets us read ``cache_id`` (published at ``slot``) without asking, now (an acquire
        load: the copy that follows reads nothing before the word)."""
        address = self._mapping.address
        return address != 0 and 0 <= slot < SLOTS and _core.read_word(address + 8 * slot) == cache_id

    def close(self) -> None:
        """Stop reading (the mapping goes with the last reference)."""
        self._mapping.close()
