"""Which transport a link negotiated: what the demo and ``python -m aio_datadist bench`` print.

One function, so that it can switch to the stats API (issue 21) once there is
one. Until then it looks at the link the way ``aio_datadist.testing.link_to``
does (that module imports pytest, which neither the demo nor the bench needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aio_datadist.datadist import LLMDataDist

#: What each transport is, in words.
TRANSPORT_WORDS = {
    "tcp": "TCP data channels",
    "local": "same-host shared memory",
    "nixl": "NIXL READ/WRITE over UCX",
}


def negotiated_transport(dd: LLMDataDist, cluster_id: int) -> str:
    """``"nixl"``, ``"local"`` or ``"tcp"``: the transport ``dd``'s link to ``cluster_id`` negotiated.

    That is what blocks-cache pulls and pushes on the link take. A single
    transfer may still take the TCP data channels where the faster transport
    cannot carry it (raw addresses, a cache the peer has not mapped).

    :raises LLMException: ``LLM_NOT_YET_LINK`` if ``dd`` has no usable link to
        ``cluster_id``; ``LLM_FAILED`` before ``init``.
    """
    link = dd._require_links().get(cluster_id)
    if link.nixl is not None and link.nixl.usable():
        return "nixl"
    if link.local is not None:
        return "local"
    return "tcp"
