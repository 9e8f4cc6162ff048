"""Which transport a link negotiated: what the demo and ``python -m aio_datadist bench`` print."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist.datadist import LLMDataDist

#: What each transport is, in words.
TRANSPORT_WORDS = {
    "tcp": "TCP data channels",
    "tls": "TLS data channels",
    "local": "same-host shared memory",
    "nixl": "NIXL READ/WRITE over UCX",
}


def negotiated_transport(dd: LLMDataDist, cluster_id: int) -> str:
    """``"nixl"``, ``"local"``, ``"tls"`` or ``"tcp"``: the transport ``dd``'s link to ``cluster_id`` negotiated
    (``LinkStats.transport`` of :meth:`LLMDataDist.stats`).

    That is what blocks-cache pulls and pushes on the link take. A single
    transfer may still take the data channels where the faster transport
    cannot carry it (raw addresses, a cache the peer has not mapped).

    :raises LLMException: ``LLM_NOT_YET_LINK`` if ``dd`` has no usable link to
        ``cluster_id``; ``LLM_FAILED`` before ``init``.
    """
    link = dd.stats().links.get(cluster_id)
    if link is None:
        raise LLMException(f"cluster {cluster_id} is not linked", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
    return link.transport
