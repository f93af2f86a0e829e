"""Errors raised low in the stack that the command line reports in a line: light to import, so
that a command which never reaches that layer does not import it (DTensor's takes half a second)."""

from __future__ import annotations


class LighthouseLost(RuntimeError):
    """The replica groups could not agree a quorum: the lighthouse or every peer is gone."""
