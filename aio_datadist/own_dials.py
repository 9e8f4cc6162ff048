"""The nonces of an endpoint's own dials, so that its listener never proves the secret over one of them.

A challenge-response handshake on a shared secret has one weakness fresh
nonces do not cover: the dialler's own listener holds the secret too. A
process at an address we dial (a port it took over, a host an API client
named) can hand our HELLO to our own listener, give the listener's proof
back to our dial, which then proves the secret in turn, and present our
proof to the listener: a link (or side channel) into us, opened by a
process that never knew the secret. So an endpoint notes the nonce of each
of its dials for as long as the dial runs, and its listener answers nothing
to a HELLO that carries one of them: that is our own handshake, handed back
(or a dial of ourselves, which links nothing anyway). The dial that then
sees its connection end can tell why; and its connection is ended then, so
that a process that handed our HELLO back and holds our dial's connection
open cannot keep the dial waiting for its whole timeout, to fail as a
timeout that says nothing.

A relay between two *different* endpoints that share the secret is not
caught here (nor could it be by nonces: it is what any proxy on the path
does); with TLS it sees nothing (docs/security.md, "Not covered").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

__all__ = ["OwnDials"]


class _Dial:
    """One dial in its handshake: whether our listener received its nonce, and what ends its wait."""

    __slots__ = ("came_back", "stop", "loop")

    def __init__(self, stop: Callable[[], None] | None, loop: asyncio.AbstractEventLoop | None) -> None:
        self.came_back = False
        self.stop, self.loop = stop, loop


class OwnDials:
    """The HELLO nonces of one endpoint's dials that are still in their handshake."""

    __slots__ = ("_nonces",)

    def __init__(self) -> None:
        self._nonces: dict[bytes, _Dial] = {}

    @contextlib.contextmanager
    def dialling(self, nonce: bytes, stop: Callable[[], None] | None = None) -> Iterator[Callable[[], bool]]:
        """Note ``nonce`` while the dial runs; yields a check: whether our listener received it. ``stop`` (the
        dial's connection's abort; called on the loop the dial runs on) ends the dial's wait for an answer once
        our listener received its nonce: none will come that it could take."""
        dial = _Dial(stop, asyncio.get_running_loop() if stop is not None else None)
        self._nonces[nonce] = dial
        try:
            yield lambda: dial.came_back
        finally:
            del self._nonces[nonce]

    @staticmethod
    @contextlib.contextmanager
    def noted(own: OwnDials | None, nonce: bytes,
              stop: Callable[[], None] | None = None) -> Iterator[Callable[[], bool]]:
        """:meth:`dialling` on ``own``, or a check that is always False when there is none."""
        if own is None:
            yield lambda: False
            return
        with own.dialling(nonce, stop) as came_back:
            yield came_back

    def came_back(self, nonce: bytes) -> bool:
        """Whether ``nonce`` is one of our running dials' (noted, for that dial to say why it failed, and its wait
        ended)."""
        dial = self._nonces.get(nonce)
        if dial is None:
            return False
        dial.came_back = True
        if dial.stop is not None and dial.loop is not None and not dial.loop.is_closed():
            dial.loop.call_soon_threadsafe(dial.stop)
        return True
