"""Validation of what ``add`` and ``extend`` take: every check happens before
anything is written, so bad input leaves the buffer exactly as it was.

Values are stored losslessly or refused (promise 12 in docs/reliability.md, ``cast_exact``):
into an integer field only integers (and integral floats) in its range, into
a bool field only 0 and 1, into a float field any value whose cast is finite
(or that was already inf or NaN). Complex values go into complex fields only.
A value already of the field's dtype is taken as it is: casting it first
(``x.astype(np.uint8)``) is how a user asks for a truncation.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..common.kernels import kernel
from ..prioritization._tree_kernels import first_bad_priority
from ..tensors.jax import host_values, is_jax_array
from ..tensors.transport import carried, TensorBatch
from ..tensors.lazy import as_array, as_numpy
from ..batch import Batch
from ..config import BUILTIN, Config
from ..errors import InvalidArgumentError, InvalidTypeError, UnknownFieldError

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
        # For _exact_one: name, shape, dtype, the scalar types taken as they are
        # (none for arrays), and the magnitude from which a float becomes inf there.
        py = {"b": (bool,), "f": (float, np.float64)}  # np.float64: what np.sign(reward) gives
        self._fast = [(n, shape, dt, () if shape else
                       (dt.type, *((int,) if dt == np.int64 else py.get(dt.kind, ()))), _overflows_at(dt))
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
        of its dtype and shape, or a scalar of its type; a Python float or
        np.float64 for a float field, a Python int for an int64 one): its
        rows, each with a row axis of 1. Anything else, or a value the field
        would not hold exactly (an int past int64, a float that becomes inf):
        None (the full checks then store it or name what is wrong)."""
        rows = {}
        get = step.get
        missing = 0
        for name, shape, dtype, types, big in self._fast:
            v = get(name, _MISSING)
            t = type(v)
            if t is np.ndarray:
                if v.shape != shape or (v.dtype is not dtype and v.dtype != dtype):
                    return None
                rows[name] = v[None]
            elif t in types:
                if t is not dtype.type:
                    if t is int and not -2**63 <= v < 2**63:
                        return None
                    if big <= abs(v) < _INF:
                        return None  # a finite float that becomes inf: the full checks refuse it
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
                if _shape_of(step[name], name) != (1,) + shape:
                    return False
                seen = True
        return seen

    def steps(self, data, priorities, valid):
        if not isinstance(data, dict):
            raise InvalidTypeError(f"extend takes a dict name -> array, got {type(data).__name__}")
        k = self.cfg.num_envs
        name, first = next(iter(data.items()), (None, None))
        lead_shape = () if first is None else _shape_of(first, f"extend: data[{name!r}]")
        m = lead_shape[0] if lead_shape else 0
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
            v = as_numpy(v)
            python = not isinstance(v, (np.ndarray, np.generic))
            v = as_array(v, f"{fn}: {label}")
            if v.shape != lead + shape:
                raise InvalidArgumentError(f"{fn}: {label} must have shape {lead + shape}, got {v.shape}")
            if python and v.dtype.kind == "f" and dtype.kind in "biu":
                # numpy made a float array of Python numbers (ints past int64
                # among them lose digits so): check the numbers themselves.
                v = np.array(given[name], dtype=object)
            try:
                rows[name] = cast_exact(v, dtype, f"{fn}: {label}")
            except InvalidArgumentError:
                if python and v.dtype.kind == "f":
                    # Name the value as given: numpy's float array of the Python
                    # numbers may have rounded it (an int past 2**53).
                    cast_exact(np.array(given[name], dtype=object), dtype, f"{fn}: {label}")
                raise
        return rows

    def _valid(self, valid, lead: tuple, m: int):
        if valid is None:
            return None
        v = as_array(valid, "valid")
        if v.dtype != np.bool_ or v.shape != lead:
            raise InvalidTypeError(f"valid must be a bool array of shape {lead}, got {v.dtype} {v.shape}")
        return v.reshape(m)

    def _priorities(self, priorities, lead: tuple, m: int):
        if priorities is None:
            return None
        p = as_array(priorities, "priorities")
        if p.dtype.kind not in "fiub":
            raise InvalidTypeError(f"priorities must be numbers, got dtype {p.dtype}")
        if p.shape != lead:
            raise InvalidArgumentError(f"priorities must have shape {lead}, got {p.shape}")
        p = np.ascontiguousarray(p, dtype=np.float64).reshape(m)
        bad = first_bad_priority(p)
        if bad >= 0:
            raise InvalidArgumentError(f"priorities must be finite and >= 0, got {p[bad]} at position {bad}")
        return p


_INF = float("inf")
_SAFE = "safe"  # a cast that always fits
_PLANS: dict = {}  # (given dtype, field dtype) -> _SAFE, or (kernel or None, field bounds, kernel's bounds)


def _overflows_at(dt: np.dtype) -> float:
    """The smallest magnitude that float field ``dt`` rounds to inf (inf for
    float64 and wider: no float64 or integer value overflows them)."""
    if dt.kind != "f" or dt.itemsize >= 8:
        return _INF
    top = np.finfo(dt).max
    # halfway from the largest value to the next power of two: rounds to inf (ties to even)
    return float(top) + (float(top) - float(np.nextafter(top, dt.type(0)))) / 2


def _bounds(dt: np.dtype):
    """What a field of ``dt`` holds, as Python numbers: ints ``lo <= x <= hi``,
    floats ``-big < x < big`` (the ``big`` of ``_overflows_at``)."""
    if dt.kind == "b":
        return 0, 1
    if dt.kind in "iu":
        return int(np.iinfo(dt).min), int(np.iinfo(dt).max)
    big = _overflows_at(dt) if dt.kind == "f" else _INF
    return -big, big


def _plan(src: np.dtype, dtype: np.dtype, label: str):
    """How ``cast_exact`` casts ``src`` into ``dtype`` (kept in ``_PLANS``)."""
    if not (np.can_cast(src, dtype, "same_kind") or (src.kind in "biuf" and dtype.kind in "biu")):
        note = " (complex values go into complex fields only; take .real yourself)" if src.kind == "c" else ""
        raise InvalidTypeError(f"{label} has dtype {src}, which is not cast to the field's {dtype}{note}")
    if np.can_cast(src, dtype, "safe"):
        plan = _SAFE
    else:
        lo, hi = _bounds(dtype)
        # the compiled kernels take what numba does: ints, float32, float64, in native byte order
        compiled = src.isnative and dtype.isnative and \
            (src.kind in "iu" or (src.kind == "f" and src.itemsize in (4, 8))) and \
            (dtype.kind in "biu" or (dtype.kind == "f" and dtype.itemsize in (4, 8)))
        if not compiled:
            plan = (None, lo, hi, ())
        elif dtype.kind == "f":
            plan = (cast_finite, lo, hi, ())
        elif src.kind == "f":  # the field's bounds as the floats inside them (0 or powers of two, exact)
            top = float(hi) if float(hi) <= hi else float(np.nextafter(float(hi), 0.0))
            plan = (cast_in_range, lo, hi, (np.array([float(lo), top]), True))
        else:  # the field's bounds within the given type, as that type: compared exactly
            info = np.iinfo(src)
            plan = (cast_in_range, lo, hi, (np.array([max(lo, info.min), min(hi, info.max)], src), False))
    _PLANS[(src, dtype)] = plan
    return plan


def cast_exact(v: np.ndarray, dtype: np.dtype, label: str) -> np.ndarray:
    """``v`` as ``dtype`` when every value survives the cast, else
    ``InvalidArgumentError`` naming ``label``, the first value that does not,
    its position and the dtype (see the module's docstring for the rule).

    A value of the field's dtype costs nothing; a widening that always fits
    (``np.can_cast(..., "safe")``) one cast. Any other cast checks as it
    goes: an array in one compiled pass (``cast_in_range``, ``cast_finite``),
    a 0-d value as a Python number, float16 and other types numba lacks by
    their ``min`` and ``max`` before the cast. Only a value that may not fit
    (or a NaN) takes the slow way, which finds the one to name.
    """
    src = v.dtype
    if src == dtype:
        return v
    given = v
    if src.kind == "O":
        v = _numbers(v, dtype, label)
        src = v.dtype
        if src == dtype:
            return v
    plan = _PLANS.get((src, dtype)) or _plan(src, dtype, label)
    if plan is _SAFE or v.size == 0:
        return v.astype(dtype)
    run, lo, hi, bounds = plan
    if run is None or v.ndim == 0:
        out = _cast_in_range(v, dtype, lo, hi)
    else:
        out = np.empty(v.shape, dtype)
        i = run(v.reshape(-1), out.reshape(-1), *bounds)
        if i >= 0:
            raise _refusal(given, i, dtype, label)
    if out is not None:
        return out
    with np.errstate(all="ignore"):  # some value may not fit: find it
        out = v.astype(dtype)
    bad = np.flatnonzero(_misfits(v, out, dtype))
    if bad.size == 0:
        return out  # a NaN or inf given into a float field
    raise _refusal(given, int(bad[0]), dtype, label)


def _cast_in_range(v: np.ndarray, dtype: np.dtype, lo, hi):
    """``v`` cast to ``dtype`` when a quick look proves every value fits in
    its bounds (``_bounds``), else None."""
    k, s = dtype.kind, v.dtype.kind
    if k == "c" or (s == "f" and v.dtype.itemsize > 8):
        return None  # rare: the slow way decides
    if v.ndim == 0:
        x = v.item()
        if k == "f":
            fits = not hi <= abs(x) < _INF
        else:  # NaN fails every comparison, and is_integer
            fits = lo <= x <= hi and (s != "f" or x.is_integer())
        return v.astype(dtype) if fits else None
    if k == "b":
        out = v.astype(dtype)  # never overflows
        return out if (out == v).all() else None  # 2, 0.5 and NaN become True, != themselves
    mn, mx = v.min(), v.max()
    if k == "f":
        return v.astype(dtype) if lo < float(mn) and float(mx) < hi else None
    if s == "f":  # Python compares an int with a float exactly; NaN fails
        if not (lo <= float(mn) and float(mx) <= hi):
            return None
        out = v.astype(dtype)  # in range: truncates, never overflows
        return out if (out == v).all() else None  # integral: trunc(v) == v
    return v.astype(dtype) if lo <= int(mn) and int(mx) <= hi else None


def _misfits(v: np.ndarray, out: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Which values of ``v`` its cast ``out`` does not hold (bool, shaped like ``v``)."""
    if dtype.kind == "b":
        return (v != 0) & (v != 1)
    if dtype.kind in "iu":
        if v.dtype.kind in "biu":  # back to the given type, and the same sign
            return (out.astype(v.dtype) != v) | ((out < 0) != (v < 0))
        info = np.iinfo(dtype)
        w = v.astype(np.float64) if v.dtype.itemsize < 8 else v  # exact
        # both bounds are 0 or powers of two, exact as floats
        return ~((w >= float(info.min)) & (w < float(info.max + 1)) & (np.trunc(w) == w))
    return ~np.isfinite(out) & np.isfinite(v)


def _numbers(v: np.ndarray, dtype: np.dtype, label: str) -> np.ndarray:
    """An object array of Python or numpy numbers (numpy makes one of ints past
    int64) as an array of ``dtype`` (integer or bool fields: each number
    checked exactly) or float64 (other fields: ``cast_exact`` checks on)."""
    flat = v.ravel()
    real = (bool, int, float, np.bool_, np.integer, np.floating)
    if not all(isinstance(x, real) for x in flat):
        kinds = sorted({type(x).__name__ for x in flat if not isinstance(x, real)})
        raise InvalidTypeError(f"{label} holds {', '.join(kinds)} values (dtype object); the field's "
                               f"{dtype} takes numbers")
    if dtype.kind not in "biu":
        floats = []
        for i, x in enumerate(flat):
            try:
                floats.append(float(x))
            except OverflowError:  # an int past float64's range
                raise _refusal(v, i, dtype, label) from None
        return np.array(floats, dtype=np.float64).reshape(v.shape)
    lo, hi = _bounds(dtype)
    ints = []
    for i, x in enumerate(flat):
        x = x.item() if isinstance(x, np.generic) else x
        if isinstance(x, float) and not x.is_integer() or not lo <= x <= hi:
            raise _refusal(v, i, dtype, label)
        ints.append(int(x))
    return np.array(ints, dtype=dtype).reshape(v.shape)


def _refusal(given: np.ndarray, i: int, dtype: np.dtype, label: str) -> InvalidArgumentError:
    """The error for value ``i`` (flat) of ``given``, which ``dtype`` cannot hold."""
    x = given.reshape(-1)[i]
    x = x.item() if isinstance(x, np.generic) else x
    kind = type(x).__name__ if given.dtype == object else given.dtype
    where = f" at position {tuple(int(j) for j in np.unravel_index(i, given.shape))}" if given.ndim else ""
    if dtype.kind in "biu":
        what, intended = f"does not fit the field's dtype {dtype} exactly", "the truncation"
    else:  # only an overflow is refused (complex: in either part)
        inf = "inf" if isinstance(x, complex) or x >= 0 else "-inf"
        what, intended = f"becomes {inf} in the field's dtype {dtype}", "that"
    return InvalidArgumentError(f"{label} = {x!r} ({kind}){where} {what}; cast it yourself with "
                                f".astype(np.{dtype}) if {intended} is intended")


# Largest batch: far beyond any learner, small enough that the draws' arrays are sane.
MAX_BATCH = 1 << 24


def check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or not 1 <= batch_size <= MAX_BATCH:
        raise InvalidArgumentError(f"batch_size must be an int in [1, {MAX_BATCH}], got {batch_size!r}")


def _shape_of(v, what: str) -> tuple:
    """``np.shape`` of user input; ``InvalidTypeError`` naming ``what`` for a
    ragged list (numpy raises its own ValueError)."""
    try:
        return np.shape(as_numpy(v))
    except (ValueError, TypeError) as e:
        raise InvalidTypeError(f"{what} is not an array of numbers ({type(e).__name__}: {str(e)[:120]})") from None


def as_index(x) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1:
        return x
    if is_jax_array(x):  # (read in place on the host; a deleted or traced array refused by name)
        x = host_values(x, "indices")
    a = as_array(x, "indices")
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise InvalidTypeError(f"indices must be a 1-D array of ints, got dtype {a.dtype} shape {a.shape}")
    return a.astype(np.int64, copy=False)


def as_priorities(x, n: int) -> np.ndarray:
    if type(x) is np.ndarray and x.dtype == np.float64 and x.flags.c_contiguous:
        p = x
    else:
        p = as_array(host_values(x) if is_jax_array(x) else x, "priorities")
        if p.dtype.kind not in "fiub":
            raise InvalidTypeError(f"priorities must be numbers, got dtype {p.dtype}")
        p = np.ascontiguousarray(p, dtype=np.float64)
    if p.ndim == 2 and p.shape[1] == 1:
        p = p[:, 0]
    if p.ndim != 1 or p.shape[0] != n:
        raise InvalidArgumentError(f"priorities must have shape ({n},) to match the indices, got {p.shape}")
    return p


def _host_mask(batch: Batch):
    """The mask of a batch whose ``mask`` is a tensor (a device tier's): the
    host copy its tier kept, so nothing is read back from the device (which
    would wait for the learner's stream); else the tensor, read as given."""
    host = getattr(carried(batch).tensors, "host", None)
    if isinstance(host, dict) and isinstance(host.get("mask"), np.ndarray):
        return host["mask"]
    return host_values(batch.mask, "mask") if is_jax_array(batch.mask) else as_numpy(batch.mask)


def update_target(target) -> tuple:
    """``(indices, generations, use_stamps, mask)`` of an ``update_priorities`` target."""
    mask = None
    if isinstance(target, Batch):
        idx, stamps, use_stamps, mask = target.indices, target.generations, True, target.mask
        if type(idx) is not np.ndarray or type(stamps) is not np.ndarray:  # a batch of jax arrays (a pytree map)
            idx, stamps = as_index(idx), as_index(stamps)
            if stamps.shape != idx.shape:
                raise InvalidArgumentError(f"target.generations has shape {stamps.shape}, "
                                           f"expected {idx.shape} like target.indices")
        if mask is not None and type(mask) is not np.ndarray:
            mask = _host_mask(target)
    elif isinstance(target, TensorBatch) and (host := target.host_target()) is not None:
        # to_torch's dict as it gave it: its host copies (no read from the device), checked as any
        idx, stamps, mask = host
        idx, stamps, use_stamps = as_index(idx), as_index(stamps), True
        if stamps.shape != idx.shape:
            raise InvalidArgumentError(f"target.host['generations'] has shape {stamps.shape}, "
                                       f"expected {idx.shape} like its indices")
    elif isinstance(target, Mapping):
        if "indices" not in target:
            raise InvalidTypeError("target is a mapping without 'indices'; pass a Batch, the dict "
                                   f"Batch.to_torch() gives, or an index array (keys: {sorted(target)[:8]})")
        idx = as_index(target["indices"])
        gens = target.get("generations")
        stamps, use_stamps = (idx, False) if gens is None else (as_index(gens), True)
        if use_stamps and stamps.shape != idx.shape:
            raise InvalidArgumentError(f"target['generations'] has shape {stamps.shape}, "
                                       f"expected {idx.shape} like target['indices']")
        mask = target.get("mask")
    else:
        idx = as_index(target)
        stamps, use_stamps = idx, False
    return idx, stamps, use_stamps, mask


@kernel
def cast_in_range(src, out, bounds, whole):
    """Copy ``src`` into ``out`` (flat; the assignment casts) when every value
    lies in ``[lo, hi] = bounds`` (of ``src``'s type, or float64 for a float
    ``src``) and, with ``whole``, is integral. Position of the first value that
    does not (NaN never does; ``out`` then holds garbage), or -1."""
    n = src.shape[0]
    lo, hi = bounds[0], bounds[1]
    ok = True
    if whole:  # no early exit, no branch: the loops vectorize
        for i in range(n):
            x = src[i]
            good = (x >= lo) & (x <= hi) & (np.floor(x) == x)
            ok &= good
            out[i] = x if good else lo
    else:
        for i in range(n):
            x = src[i]
            good = (x >= lo) & (x <= hi)
            ok &= good
            out[i] = x if good else lo
    if ok:
        return -1
    for i in range(n):
        x = src[i]
        if not (x >= lo and x <= hi) or (whole and np.floor(x) != x):
            return i
    return -1


@kernel
def cast_finite(src, out):
    """Copy ``src`` into ``out`` (flat, float; the assignment casts). Position
    of the first finite value that became inf, or -1 when none did."""
    n = src.shape[0]
    ok = True
    for i in range(n):  # no early exit: the loop vectorizes
        x = src[i]
        out[i] = x
        ok &= ~(np.isinf(out[i]) & np.isfinite(x))
    if ok:
        return -1
    for i in range(n):
        if np.isinf(out[i]) and np.isfinite(src[i]):
            return i
    return -1
