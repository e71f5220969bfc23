"""Prioritization strategies: how stored priorities become sampling
probabilities. Each implements ``base.Prioritization``; the buffer holds one,
chosen by ``prioritization=`` at construction, and never asks which."""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .base import Prioritization
from .proportional import Proportional
from .rank import RankPrioritizer

STRATEGIES: dict[str, type[Prioritization]] = {"proportional": Proportional, "rank": RankPrioritizer}
KINDS = tuple(STRATEGIES)


def make(kind: str, capacity: int, *, alpha: float, eps: float, max_priority: float,
         weight_norm: str) -> Prioritization:
    """The strategy named ``kind`` for ``capacity`` slots."""
    cls = STRATEGIES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidArgumentError(f"prioritization must be one of {KINDS}, got {kind!r}")
    return cls(capacity, alpha=alpha, eps=eps, max_priority=max_priority, weight_norm=weight_norm)


__all__ = ["KINDS", "STRATEGIES", "Prioritization", "Proportional", "RankPrioritizer", "make"]
