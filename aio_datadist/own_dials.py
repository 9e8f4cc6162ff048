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
sees its connection end can tell why.

A relay between two *different* endpoints that share the secret is not
caught here (nor could it be by nonces: it is what any proxy on the path
does); with TLS it sees nothing (docs/security.md, "Not covered").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["OwnDials"]


class OwnDials:
    """The HELLO nonces of one endpoint's dials that are still in their handshake."""

    __slots__ = ("_nonces",)

    def __init__(self) -> None:
        self._nonces: dict[bytes, bool] = {}  # nonce -> whether our listener received it

    @contextlib.contextmanager
    def dialling(self, nonce: bytes) -> Iterator[Callable[[], bool]]:
        """Note ``nonce`` while the dial runs; yields a check: whether our listener received it."""
        self._nonces[nonce] = False
        try:
            yield lambda: self._nonces.get(nonce, False)
        finally:
            del self._nonces[nonce]

    @staticmethod
    @contextlib.contextmanager
    def noted(own: OwnDials | None, nonce: bytes) -> Iterator[Callable[[], bool]]:
        """:meth:`dialling` on ``own``, or a check that is always False when there is none."""
        if own is None:
            yield lambda: False
            return
        with own.dialling(nonce) as came_back:
            yield came_back

    def came_back(self, nonce: bytes) -> bool:
        """Whether ``nonce`` is one of our running dials' (noted, for that dial to say why it failed)."""
        if nonce not in self._nonces:
            return False
        self._nonces[nonce] = True
        return True
