"""A logging filter that gives every record the link fields the link records carry.

Records about a link carry ``cluster_id``, ``remote_cluster_id`` and
``link_id`` (see ``docs/observability.md``); other records of the library
(and of the application) do not. Put :class:`LinkLogFields` on a handler and a
format that names those fields works for every record::

    handler = logging.StreamHandler()
    handler.addFilter(aio_datadist.LinkLogFields())
    handler.setFormatter(logging.Formatter(
        "%(levelname)s %(name)s [%(cluster_id)s->%(remote_cluster_id)s #%(link_id)s] %(message)s"))
"""

from __future__ import annotations

import logging

__all__ = ["LINK_FIELDS", "LinkLogFields"]

#: The fields a link's records carry.
LINK_FIELDS = ("cluster_id", "remote_cluster_id", "link_id")


class LinkLogFields(logging.Filter):
    """Sets each of :data:`LINK_FIELDS` a record lacks to ``missing`` (``"-"``); filters nothing out."""

    def __init__(self, missing: str = "-") -> None:
        super().__init__()
        self.missing = missing

    def filter(self, record: logging.LogRecord) -> bool:
        for name in LINK_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, self.missing)
        return True
