"""Errors raised low in the stack that the command line reports in a line, light to import: a
command that never reaches the layer raising one does not load that layer (and DTensor) to catch it."""

from __future__ import annotations


class LighthouseLost(RuntimeError):
    """The replica groups could not agree a quorum: the lighthouse or every peer is gone."""
