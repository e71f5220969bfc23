"""Schedules for beta (or anything else annealed per sample call)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
import numbers

from .errors import InvalidArgumentError, InvalidTypeError


def _is_beta(v: object) -> bool:
    """A beta is a number in [0, 1]: 1 corrects the sampling bias fully, and
    more than 1 over-corrects (the IS weights of PER, Schaul et al. 2016)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1


@dataclass(frozen=True)
class LinearSchedule:
    """``start`` at step 0, moving linearly to ``end`` at ``steps``, then flat.

    Parameters
    ----------
    start, end : float
        Values at step 0 and from step ``steps`` on (betas: in [0, 1]).
    steps : int
        Number of steps (``sample`` calls) over which to anneal, >= 1.
    """

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            v = getattr(self, name)
            if not _is_beta(v):
                raise InvalidArgumentError(f"LinearSchedule {name} must be a number in [0, 1] (a beta), got {v!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise InvalidArgumentError(f"LinearSchedule steps must be an int >= 1, got {self.steps!r}")

    def __call__(self, step: int) -> float:
        """The value at ``step`` (the number of ``sample`` calls made before)."""
        frac = min(max(step, 0) / self.steps, 1.0)
        return self.start + (self.end - self.start) * frac

    def to_dict(self) -> dict[str, Any]:
        """The schedule as JSON (what a snapshot and a storage record)."""
        return {"kind": "linear", "start": self.start, "end": self.end, "steps": self.steps}


@dataclass(frozen=True)
class ConstantSchedule:
    """The same value at every step.

    Parameters
    ----------
    value : float
        The value (a beta: in [0, 1]).
    """

    value: float

    def __post_init__(self) -> None:
        v = self.value
        if not _is_beta(v):
            raise InvalidArgumentError(f"ConstantSchedule value must be a number in [0, 1] (a beta), got {v!r}")

    def __call__(self, step: int) -> float:
        """The value at ``step`` (the number of ``sample`` calls made before)."""
        return self.value

    def to_dict(self) -> dict[str, Any]:
        """The schedule as JSON (what a snapshot and a storage record)."""
        return {"kind": "constant", "value": self.value}


def as_beta(v: object, what: str = "beta") -> float:
    """``v`` as a beta: a real number (Python or numpy, not a bool or a
    string) in [0, 1]; ``InvalidTypeError`` / ``InvalidArgumentError`` naming ``what`` otherwise."""
    if getattr(v, "shape", None) == () and hasattr(v, "item"):  # a 0-d array or tensor: its number
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidTypeError(f"{what} must be a number in [0, 1], got {v!r}")
    if not _is_beta(float(v)):
        raise InvalidArgumentError(f"{what} must be a number in [0, 1], got {v!r}")
    return float(v)


def as_schedule(beta: float | LinearSchedule | ConstantSchedule) -> LinearSchedule | ConstantSchedule:
    """A schedule from a number (``as_beta``) or a schedule; raises for anything else."""
    if isinstance(beta, (LinearSchedule, ConstantSchedule)):
        return beta
    if isinstance(beta, numbers.Real) and not isinstance(beta, bool):
        return ConstantSchedule(as_beta(beta))
    raise InvalidTypeError(f"beta must be a float or a schedule such as bigper.LinearSchedule, got {beta!r}")


def schedule_from_dict(d: Mapping[str, Any]) -> LinearSchedule | ConstantSchedule:
    """Inverse of ``to_dict`` (for reopening and snapshots); raises
    ``InvalidArgumentError`` for anything ``to_dict`` could not have written."""
    kind = d.get("kind") if isinstance(d, dict) else None
    try:
        if kind == "linear" and set(d) == {"kind", "start", "end", "steps"}:
            return LinearSchedule(d["start"], d["end"], d["steps"])
        if kind == "constant" and set(d) == {"kind", "value"}:
            return ConstantSchedule(d["value"])
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"beta schedule {d!r}: {e}") from None
    raise InvalidArgumentError(f"not a recorded beta schedule: {d!r}")
