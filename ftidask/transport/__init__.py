"""Transports: how bytes and small values move between the ranks of a run."""

from .base import SerialTransport, Transport

__all__ = ["SerialTransport", "Transport"]
