"""Schedules for beta (or anything else annealed per sample call)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError, InvalidTypeError


def _shown(v: object) -> str:
    """``repr(v)`` cut short; an int too long for ``repr`` (Python refuses
    more than 4300 digits) by its size."""
    try:
        return f"{v!r:.80}"
    except ValueError:
        return f"an int of {v.bit_length()} bits" if isinstance(v, int) else type(v).__name__


def as_beta(v: object, what: str = "beta") -> float:
    """The one rule of what a beta is; every entry that takes one (the
    constructors, ``sample``, ``sampler``, ``shard.sample_at``, the schedules,
    the SB3 drop-in) asks it.

    A beta is a real number in [0, 1] (1 corrects the sampling bias fully;
    more would over-correct, Schaul et al. 2016): a Python or numpy int or
    float, a ``Fraction``, or a 0-d array or tensor holding one. A bool, a
    string, a complex number, an array of another shape, NaN, inf, or a number
    too large for a float is refused.

    Parameters
    ----------
    v : object
        The value given.
    what : str
        Its name, for the error.

    Returns
    -------
    float

    Raises
    ------
    InvalidTypeError
        ``v`` is not a real number.
    InvalidArgumentError
        ``v`` is a real number outside [0, 1] (NaN and numbers too large for
        a float included).
    """
    if getattr(v, "shape", None) == () and callable(getattr(v, "item", None)):
        v = v.item()  # a 0-d array or tensor (or a numpy scalar): its Python number
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise InvalidTypeError(f"{what} must be a real number in [0, 1] (an int, a float, a numpy number, a "
                               f"0-d array or tensor), got {type(v).__name__} {_shown(v)}")
    try:
        x = float(v)
    except (OverflowError, ValueError, TypeError):  # 10**400, a huge Fraction: no float holds it
        x = math.nan
    if not 0.0 <= x <= 1.0:  # (NaN fails it too)
        raise InvalidArgumentError(f"{what} must be a number in [0, 1], got {_shown(v)}")
    return x


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
        # Kept as Python numbers: what to_dict records must be JSON.
        for name in ("start", "end"):
            object.__setattr__(self, name, as_beta(getattr(self, name), f"LinearSchedule {name} (a beta)"))
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise InvalidArgumentError(f"LinearSchedule steps must be an int >= 1, got {_shown(steps)}")
        object.__setattr__(self, "steps", int(steps))

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
        object.__setattr__(self, "value", as_beta(self.value, "ConstantSchedule value (a beta)"))

    def __call__(self, step: int) -> float:
        """The value at ``step`` (the number of ``sample`` calls made before)."""
        return self.value

    def to_dict(self) -> dict[str, Any]:
        """The schedule as JSON (what a snapshot and a storage record)."""
        return {"kind": "constant", "value": self.value}


def is_schedule(beta: object) -> bool:
    """Whether ``beta`` is a schedule object (else it is taken as one beta, ``as_beta``)."""
    return isinstance(beta, (LinearSchedule, ConstantSchedule))


def as_schedule(beta: object) -> LinearSchedule | ConstantSchedule:
    """A schedule from a schedule, or from one beta (``as_beta``: a number,
    a 0-d array or tensor) held constant; raises for anything else."""
    if is_schedule(beta):
        return beta
    try:
        return ConstantSchedule(as_beta(beta))
    except InvalidTypeError:
        raise InvalidTypeError(f"beta must be a number in [0, 1] or a schedule such as bigper.LinearSchedule, "
                               f"got {type(beta).__name__} {_shown(beta)}") from None


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
