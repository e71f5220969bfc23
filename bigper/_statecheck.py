"""Validation of a recorded buffer state (from a snapshot or a reopened
storage) before any of it is used: everything read from disk is hostile
until checked. Raises ``CorruptSnapshotError`` naming the field and value."""

from __future__ import annotations

from .errors import CorruptSnapshotError  # noqa: F401


def check_state(cfg, meta: dict, arrays: dict) -> None:
    """Check the JSON counters ``meta`` and the bookkeeping ``arrays`` of a
    buffer with config ``cfg``; raise ``CorruptSnapshotError`` on anything a
    buffer could not have written."""
