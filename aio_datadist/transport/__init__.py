"""The planes behind links (``base.py`` is their interface) and the channels under the stream plane.

``planes_for(link)`` lists the planes a link can use, fastest first; the
NIXL plane is imported only once a link has a NIXL peer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aio_datadist.transport.base import LinkPort, Plane

__all__ = ["plane", "planes_for"]

_MODULES = {"stream": "stream", "staging": "staging", "same-host": "same_host", "device-ipc": "device_ipc",
            "nixl": "nixl_plane"}
_LOADED: dict[str, Plane] = {}
_PLANES_FOR: dict[tuple[bool, bool], tuple[Plane, ...]] = {}  # by (NIXL peer, same-host share): asked per request


def plane(name: str) -> Plane:
    """The plane called ``name`` (``stream``, ``staging``, ``same-host``, ``device-ipc``, ``nixl``), imported on
    first use."""
    found = _LOADED.get(name)
    if found is None:
        module = importlib.import_module(f"aio_datadist.transport.{_MODULES[name]}")
        found = _LOADED[name] = module.PLANE
    return found


def planes_for(link: LinkPort) -> tuple[Plane, ...]:
    """The planes ``link`` can use, in the order they are preferred: NIXL, same-host, device IPC (device caches
    on a same-host link), staging (device caches only), stream."""
    kind = (link.nixl is not None, link.local is not None)
    found = _PLANES_FOR.get(kind)
    if found is None:
        planes: tuple[Plane, ...] = ()
        if kind[0]:
            planes += (plane("nixl"),)
        if kind[1]:
            planes += (plane("same-host"), plane("device-ipc"))
        found = _PLANES_FOR[kind] = (*planes, plane("staging"), plane("stream"))
    return found
