"""Validation of what ``add`` and ``extend`` take: every check happens before
anything is written, so bad input leaves the buffer exactly as it was."""

from __future__ import annotations

import numpy as np

from . import _kernels as K
from ._torch import as_numpy
from .config import BUILTIN, Config
from .errors import InvalidArgumentError, InvalidTypeError, UnknownFieldError

_OPTIONAL = set(BUILTIN)
_MISSING = object()


class Ingest:
    """Turns ``add``/``extend`` arguments into rows ``name -> (m, *shape)``."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.inputs = cfg.step_inputs()  # name -> (shape, dtype)
        # What the storage holds per transition. The end flags live in the
        # buffer's own `ends` array instead (they steer n-step windows).
        self.stored = {n: v for n, v in self.inputs.items() if n not in BUILTIN}
        self.required = set(self.inputs) - _OPTIONAL
        # For _exact_one: name, shape, dtype and the scalar types taken as they are (none for arrays).
        py = {"b": bool, "f": float}
        self._fast = [(n, shape, dt, () if shape else
                       (dt.type, int if dt == np.int64 else py.get(dt.kind, dt.type)))
                      for n, (shape, dt) in self.inputs.items()]

    def step(self, step: dict, priorities, valid):
        k = self.cfg.num_envs
        if k == 1 and (rows := self._exact_one(step)) is not None:
            return rows, self._priorities(priorities, (), 1), self._valid(valid, (), 1)
        lead = () if k == 1 else (k,)
        if k == 1 and self._env_axis(step):
            lead = (1,)  # a one-env vector env's step: keep its env axis as the row axis
        rows = self._check(step, lead, "add", "")
        if not lead:  # one env: give every value its leading row axis
            rows = {n: v[None] for n, v in rows.items()}
        return rows, self._priorities(priorities, lead, k), self._valid(valid, lead, k)

    def _exact_one(self, step: dict):
        """One env's step when every value is exactly its field's type (an array
        of its dtype and shape, or a scalar of its type; a Python float for a
        float field, a Python int for an int64 one): its rows, each with a
        row axis of 1, checked without conversions. Anything else: None (the
        full checks then name what is wrong)."""
        rows = {}
        get = step.get
        missing = 0
        for name, shape, dtype, types in self._fast:
            v = get(name, _MISSING)
            t = type(v)
            if t is np.ndarray:
                if v.shape != shape or (v.dtype is not dtype and v.dtype != dtype):
                    return None
                rows[name] = v[None]
            elif t in types:
                if t is int and not -2**63 <= v < 2**63:
                    return None
                a = np.empty(1, dtype)
                a[0] = v
                rows[name] = a
            elif v is _MISSING and name in _OPTIONAL:
                rows[name] = np.zeros(1, dtype=bool)
                missing += 1
            else:
                return None
        # An unknown name (counted) goes to the full checks, which name it.
        return rows if len(step) == len(rows) - missing else None

    def _env_axis(self, step: dict) -> bool:
        """Whether a one-env step comes with a leading env axis of length 1 (as a
        vector env of one env returns it): every required field given has it
        (else the shapes are checked as given, so an error names the field)."""
        seen = False
        for name, (shape, _) in self.inputs.items():
            if name in step and name in self.required:
                if np.shape(as_numpy(step[name])) != (1,) + shape:
                    return False
                seen = True
        return seen

    def steps(self, data, priorities, valid):
        if not isinstance(data, dict):
            raise InvalidTypeError(f"extend takes a dict name -> array, got {type(data).__name__}")
        k = self.cfg.num_envs
        first = next(iter(data.values()), None)
        m = np.shape(as_numpy(first))[0] if first is not None and np.ndim(as_numpy(first)) else 0
        lead = (m,) if k == 1 else (m, k)
        rows = self._check(data, lead, "extend", "data")
        rows = {n: v.reshape((m * k,) + v.shape[len(lead):]) for n, v in rows.items()}
        return rows, self._priorities(priorities, lead, m * k), self._valid(valid, lead, m * k)

    def _check(self, given: dict, lead: tuple, fn: str, arg: str) -> dict:
        if not given.keys() <= self.inputs.keys():
            unknown = sorted(set(given) - set(self.inputs))
            raise UnknownFieldError(f"{fn}: unknown field(s) {unknown}; expected {sorted(self.inputs)}")
        if not self.required <= given.keys():
            missing = sorted(self.required - set(given))
            raise UnknownFieldError(f"{fn}: missing field(s) {missing}")
        rows = {}
        for name, (shape, dtype) in self.inputs.items():
            if name not in given:
                rows[name] = np.zeros(lead, dtype=bool)
                continue
            v = given[name]
            if type(v) is np.ndarray and v.dtype == dtype and v.shape == lead + shape:
                rows[name] = v  # the common case, checked without conversions
                continue
            if not lead and not shape and (type(v) is dtype.type or (type(v) is bool and dtype.kind == "b")):
                rows[name] = np.asarray(v)  # a scalar of the field's exact type: no cast to check
                continue
            label = f"{arg}[{name!r}]" if arg else name
            v = np.asarray(as_numpy(v))
            if v.shape != lead + shape:
                raise InvalidArgumentError(f"{fn}: {label} must have shape {lead + shape}, got {v.shape}")
            if v.dtype != dtype and not np.can_cast(v.dtype, dtype, "same_kind"):
                raise InvalidTypeError(f"{fn}: {label} has dtype {v.dtype}, which cannot be cast safely "
                                f"(same_kind) to the field's {dtype}")
            rows[name] = v.astype(dtype, copy=False)
        return rows

    def _valid(self, valid, lead: tuple, m: int):
        if valid is None:
            return None
        v = np.asarray(as_numpy(valid))
        if v.dtype != np.bool_ or v.shape != lead:
            raise InvalidTypeError(f"valid must be a bool array of shape {lead}, got {v.dtype} {v.shape}")
        return v.reshape(m)

    def _priorities(self, priorities, lead: tuple, m: int):
        if priorities is None:
            return None
        p = np.asarray(as_numpy(priorities))
        if p.dtype.kind not in "fiub":
            raise InvalidTypeError(f"priorities must be numbers, got dtype {p.dtype}")
        if p.shape != lead:
            raise InvalidArgumentError(f"priorities must have shape {lead}, got {p.shape}")
        p = np.ascontiguousarray(p, dtype=np.float64).reshape(m)
        bad = K.first_bad_priority(p)
        if bad >= 0:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[bad]} at position {bad}")
        return p


# Largest batch: far beyond any learner, small enough that the draws' arrays are sane.
MAX_BATCH = 1 << 24


def check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or not 1 <= batch_size <= MAX_BATCH:
        raise InvalidArgumentError(f"batch_size must be an int in [1, {MAX_BATCH}], got {batch_size!r}")


def as_index(x) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1:
        return x
    a = np.asarray(as_numpy(x))
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise InvalidTypeError(f"indices must be a 1-D array of ints, got dtype {a.dtype} shape {a.shape}")
    return a.astype(np.int64, copy=False)


def as_priorities(x, n: int) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype == np.float64 and x.flags.c_contiguous:
        p = x
    else:
        p = np.asarray(as_numpy(x))
        if p.dtype.kind not in "fiub":
            raise InvalidTypeError(f"priorities must be numbers, got dtype {p.dtype}")
        p = np.ascontiguousarray(p, dtype=np.float64)
    if p.ndim == 2 and p.shape[1] == 1:
        p = p[:, 0]
    if p.ndim != 1 or p.shape[0] != n:
        raise InvalidArgumentError(f"priorities must have shape ({n},) to match the indices, got {p.shape}")
    return p
