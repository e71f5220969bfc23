"""Schedules for beta (or anything else annealed per sample call)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from .errors import InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class LinearSchedule:
    """``start`` at step 0, moving linearly to ``end`` at ``steps``, then flat.

    Parameters
    ----------
    start, end : float
        Values at step 0 and from step ``steps`` on.
    steps : int
        Number of steps (``sample`` calls) over which to anneal, >= 1.
    """

    start: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < float("inf")):
                raise InvalidArgumentError(
                    f"LinearSchedule {name} must be a finite number >= 0 (a beta), got {v!r}")
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
        The value (a beta: finite, >= 0).
    """

    value: float

    def __post_init__(self) -> None:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < float("inf")):
            raise InvalidArgumentError(f"ConstantSchedule value must be a finite number >= 0 (a beta), got {v!r}")

    def __call__(self, step: int) -> float:
        """The value at ``step`` (the number of ``sample`` calls made before)."""
        return self.value

    def to_dict(self) -> dict[str, Any]:
        """The schedule as JSON (what a snapshot and a storage record)."""
        return {"kind": "constant", "value": self.value}


def as_schedule(beta: float | LinearSchedule | ConstantSchedule) -> LinearSchedule | ConstantSchedule:
    """A schedule from a float or a schedule; raises for anything else."""
    if isinstance(beta, (LinearSchedule, ConstantSchedule)):
        return beta
    if isinstance(beta, (int, float)) and not isinstance(beta, bool):
        b = float(beta)
        if not (b == b and abs(b) != float("inf")) or b < 0:
            raise InvalidArgumentError(f"beta must be a finite number >= 0 or a schedule, got {beta!r}")
        return ConstantSchedule(b)
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
