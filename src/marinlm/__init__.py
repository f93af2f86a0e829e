"""marinlm: an open, end-to-end stack for Marin-style mixture-of-experts language models."""

__version__ = "0.1.0"
