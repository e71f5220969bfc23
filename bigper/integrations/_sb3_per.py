"""What every prioritized SB3 algorithm shares: beta annealed over ``learn``."""

from __future__ import annotations


def annealed_beta(beta0: float, progress_remaining: float) -> float:
    """Beta from ``beta0`` at the start of ``learn`` to 1.0 at its end."""
    done = min(max(1.0 - float(progress_remaining), 0.0), 1.0)
    return beta0 + (1.0 - beta0) * done
