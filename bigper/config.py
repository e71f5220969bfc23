"""Buffer configuration: validated once, JSON-able, compared on reopen and load."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numpy as np

from .frames import budget as _budget
from .schedules import ConstantSchedule, LinearSchedule, as_schedule, schedule_from_dict
from .errors import BigperError, InvalidArgumentError, InvalidTypeError
from .storage import kinds as storage_kinds

# Per-transition flags every buffer stores, and keys that sampling produces.
BUILTIN = ("terminated", "truncated")
# (weights, indices, generations and mask are keys of every to_torch dict beside the fields.) No field
# takes these, nor the names of bigper's own arrays: ``core/layout.py`` ``check_field_names``.
RESERVED = BUILTIN + ("discount", "priorities", "weights", "indices", "generations", "mask")
WEIGHT_NORMS = ("global", "batch")
PRIORITIZATIONS = ("proportional", "rank")
COMPRESSIONS = (None, "zstd")
# What the stored data, leaves and bookkeeping depend on: reopening a path with
# other values is refused. The other keys (beta schedule, seed, gamma,
# max_priority, weight_norm) steer only what comes next and take new values.
LAYOUT_KEYS = ("capacity", "fields", "frame_stack", "n_step", "alpha", "eps", "next_of",
               "num_envs", "storage", "prioritization", "compression", "compression_budget", "sequence")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def check_name(name: object, what: str = "field name") -> str:
    """A name that is safe as a file or dataset name: no separators, no
    ``..``, no leading dot, not empty."""
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > 128:
        raise InvalidArgumentError(
            f"{what} must start with a letter or '_', hold only letters, digits, '_' "
            f"or '-' and be at most 128 characters (it becomes a file name), got {name!r}")
    return name


def _shape(v, name) -> tuple:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        v = (int(v),)
    try:
        shape = tuple(int(d) for d in v)
    except TypeError:
        raise InvalidTypeError(f"fields[{name!r}] shape must be a tuple of ints, got {v!r}") from None
    if any(d < 1 for d in shape):
        raise InvalidArgumentError(f"fields[{name!r}] shape must have positive dimensions, got {shape}")
    return shape


def _number(value, name, *, lo=None, lo_open=False, hi=None, none_ok=False):
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidTypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    bad = not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) \
        or (hi is not None and v > hi)
    if bad:
        rng = f"{'>' if lo_open else '>='} {lo}" if lo is not None else "finite"
        if hi is not None:
            rng += f" and <= {hi}"
        raise InvalidArgumentError(f"{name} must be finite and {rng}, got {value!r}")
    return v


def _compression(compression, budget, frame_stack, specs, *, capacity, n_step, num_envs, sequence) -> tuple:
    """``compression`` and its log budget (bytes a frame), checked. No
    budget (the default) is a log that grows as its frames need
    (``_budget.grow_geometry``); a budget caps the log at that many bytes a
    frame, and is valid when its log keeps the frames of one item of every
    env even when no frame compresses (``_budget``: the same check on
    resume, ``load`` and ``from_hdf5``)."""
    if compression not in COMPRESSIONS:
        raise InvalidArgumentError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression is None:
        if budget is not None:
            raise InvalidArgumentError(f"compression_budget={budget!r} needs compression='zstd'")
        return None, None
    if not frame_stack:
        raise InvalidArgumentError(
            f"compression={compression!r} compresses the frames of frame stacks: it needs frame_stack")
    shape, dt = specs["obs"]
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dt).itemsize
    F = _budget.frame_capacity(capacity, frame_stack, num_envs)
    steps = 1 if sequence is None else sequence["burn_in"] + sequence["length"]
    need = _budget.frames_needed(F, frame_stack, n_step, num_envs, steps)
    if budget is None:
        return compression, None
    lo, hi = _budget.budget_range(F, row_bytes, need)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 1 <= budget <= hi:
        raise InvalidArgumentError(
            f"compression_budget must be an int of bytes a frame in 1..{hi} (a frame's largest zstd frame), "
            f"got {budget!r}")
    if not _budget.fits(F, row_bytes, need, int(budget)):
        what = "(frame_stack + n_step)" if sequence is None else "(frame_stack + burn_in + length)"
        raise InvalidArgumentError(
            f"compression_budget={budget} is too small for frames that do not compress: its log keeps "
            f"{_budget.kept(F, row_bytes, int(budget))} such frames of {row_bytes} bytes at its emptiest, and one "
            f"transition of every env needs {what} * num_envs = {need}, so none would ever be sampleable; "
            f"compression_budget={lo} keeps them (or leave it unset: the log then grows as its frames need)")
    return compression, int(budget)


def _sequence(seq, *, capacity, n_step, num_envs) -> dict:
    """A checked ``Sequence`` (or its dict) as the dict a Config keeps."""
    seq = Sequence.from_dict(seq)
    if n_step > 1:
        raise InvalidArgumentError(
            f"n_step={n_step} with sequence=...: a recurrent learner computes its n-step targets from "
            "the sampled sequence itself; use n_step=1")
    need = seq.steps * num_envs
    if capacity < need:
        raise InvalidArgumentError(
            f"capacity={capacity} cannot hold one whole sequence of every env: it needs >= "
            f"(burn_in + length) * num_envs = ({seq.burn_in} + {seq.length}) * {num_envs} = {need}")
    return seq.to_dict()


def _int(value, name, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo \
            or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise InvalidArgumentError(f"{name} must be an int {rng}, got {value!r}")
    return int(value)


# n-step returns over more steps than this are refused: a batch's window is a
# (B, n) array, and a recorded n_step of 2**29 asked load for 16 GiB.
MAX_N_STEP = 4096

# The item kernels (core/sequences.py) keep positions, periods and step numbers in
# int64: a Sequence's ints stay well inside it.
_SEQ_MAX = 1 << 62


@dataclass(frozen=True)
class Sequence:
    """Items that are sequences of steps (recurrent agents, R2D2).

    An item is a start step: one every ``period`` steps of an env's stream,
    counted from its episode's start. It covers ``burn_in`` steps before the
    start (fewer near the episode's start: padding) and ``length`` steps from
    it (fewer when the episode ends first: padding), never crossing an
    episode end; ``sample`` returns ``T = burn_in + length`` steps a row.

    Parameters
    ----------
    length : int
        Steps from the start step on (the learning part), >= 1.
    burn_in : int
        Steps before the start step, to warm up a recurrent state, >= 0.
    period : int, optional
        Steps between two item starts of one episode (default ``length``:
        sequences that do not overlap in their learning part).
    eta : float
        Per-step errors reduce to an item's priority as
        ``eta * max + (1 - eta) * mean`` (R2D2), in [0, 1].
    """

    length: int
    burn_in: int = 0
    period: int | None = None
    eta: float = 0.9

    def __post_init__(self) -> None:
        length = _int(self.length, "Sequence length", 1, _SEQ_MAX)
        burn_in = _int(self.burn_in, "Sequence burn_in", 0, _SEQ_MAX)
        period = length if self.period is None else _int(self.period, "Sequence period", 1, _SEQ_MAX)
        eta = _number(self.eta, "Sequence eta", lo=0.0, hi=1.0)
        for name, v in (("length", length), ("burn_in", burn_in), ("period", period), ("eta", eta)):
            object.__setattr__(self, name, v)

    @property
    def steps(self) -> int:
        """``T = burn_in + length``: steps of one sampled row."""
        return self.burn_in + self.length

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict a Config keeps (``length``, ``burn_in``, ``period``, ``eta``)."""
        return {"length": self.length, "burn_in": self.burn_in, "period": self.period, "eta": self.eta}

    @classmethod
    def from_dict(cls, d: "Sequence | dict[str, Any]") -> "Sequence":
        """A ``Sequence`` from itself or from the dict ``to_dict`` gave, checked.

        Parameters
        ----------
        d : Sequence or dict
            A ``Sequence``, or its ``length``, ``burn_in``, ``period`` and ``eta``.

        Returns
        -------
        Sequence
        """
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict) or set(d) - {"length", "burn_in", "period", "eta"} or "length" not in d:
            raise InvalidTypeError("sequence must be a bigper.Sequence (or a dict of its length, burn_in, "
                                   f"period and eta), got {str(d)[:80]}")
        return cls(**d)


@dataclass(frozen=True)
class Config:
    """Everything that defines a buffer's layout and sampling; see ``PrioritizedReplayBuffer``."""

    capacity: int
    fields: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape tuple, dtype str)
    frame_stack: int | None = None
    n_step: int = 1
    gamma: float = 0.99
    alpha: float = 0.6
    eps: float = 1e-6
    max_priority: float | None = None
    beta: dict[str, Any] = field(default_factory=lambda: {"kind": "constant", "value": 0.4})
    weight_norm: str = "global"
    next_of: tuple[str, ...] = ()
    num_envs: int = 1
    seed: int | None = 0
    storage: str = "memory"
    prioritization: str = "proportional"
    compression: str | None = None  # frame stacks: None (raw frame ring) or "zstd" (frames/segments.py)
    compression_budget: int | None = None  # log bytes a frame (compressed), set with compression
    sequence: dict[str, Any] | None = None  # Sequence.to_dict(); None: items are transitions

    @classmethod
    def build(cls, *, capacity: int, fields: Mapping[str, Any], frame_stack: int | None = None,
              n_step: int = 1, gamma: float = 0.99, alpha: float = 0.6, eps: float = 1e-6,
              max_priority: float | None = None, beta: float | LinearSchedule | ConstantSchedule = 0.4,
              weight_norm: str = "global", next_of: str | Iterable[str] | None = None, num_envs: int = 1,
              seed: int | None = 0, storage: str = "memory", prioritization: str = "proportional",
              compression: str | None = None, compression_budget: int | None = None,
              sequence: Sequence | dict[str, Any] | None = None) -> "Config":
        """A Config from ``PrioritizedReplayBuffer``'s arguments, each checked (a
        bad one raises a ``BigperError`` naming it)."""
        capacity = _int(capacity, "capacity", 1)
        if not isinstance(fields, dict) or not fields:
            raise InvalidTypeError(f"fields must be a non-empty dict name -> (shape, dtype), got {fields!r}")
        specs = {}
        for name, spec in fields.items():
            check_name(name)  # (a name bigper keeps for itself is refused with the list of all: core/layout.py)
            try:
                shape, dtype = spec
            except (TypeError, ValueError):
                raise InvalidTypeError(f"fields[{name!r}] must be (shape, dtype), got {spec!r}") from None
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise InvalidTypeError(f"fields[{name!r}] dtype is not a numpy dtype: {dtype!r}") from None
            if dt.hasobject or dt.fields is not None or dt.kind in "OVUSMm":
                raise InvalidTypeError(f"fields[{name!r}] dtype must be a numeric or bool dtype, got {dt}")
            specs[name] = (_shape(shape, name), dt.str)
        if next_of is None:
            next_of = ("obs",) if "obs" in specs else ()
        if isinstance(next_of, str):
            next_of = (next_of,)
        next_of = tuple(next_of)
        for name in next_of:
            if name not in specs:
                raise InvalidArgumentError(f"next_of names {name!r}, which is not in fields {sorted(specs)}")
            if f"next_{name}" in specs:
                raise InvalidArgumentError(f"fields defines 'next_{name}', which next_of={next_of!r} also produces")
        if frame_stack is not None:
            frame_stack = _int(frame_stack, "frame_stack", 1)
            if "obs" not in specs:
                raise InvalidArgumentError("frame_stack needs an 'obs' field (a stack of frames on axis 0)")
            obs_shape = specs["obs"][0]
            if len(obs_shape) < 2 or obs_shape[0] != frame_stack:
                raise InvalidArgumentError(
                    f"frame_stack={frame_stack} needs fields['obs'] of shape ({frame_stack}, ...) "
                    f"with the stack on axis 0, got {obs_shape}")
        n_step = _int(n_step, "n_step", 1, MAX_N_STEP)
        gamma = _number(gamma, "gamma", lo=0.0, hi=1.0)
        alpha = _number(alpha, "alpha", lo=0.0)
        eps = _number(eps, "eps", lo=0.0)
        max_priority = _number(max_priority, "max_priority", lo=0.0, lo_open=True, none_ok=True)
        if weight_norm not in WEIGHT_NORMS:
            raise InvalidArgumentError(f"weight_norm must be one of {WEIGHT_NORMS}, got {weight_norm!r}")
        num_envs = _int(num_envs, "num_envs", 1)
        if seed is not None:
            seed = _int(seed, "seed", 0)
        if not isinstance(storage, str) or storage not in storage_kinds():  # bigper's own and those registered
            raise InvalidArgumentError(f"storage must be one of {storage_kinds()}, got {storage!r}")
        if prioritization not in PRIORITIZATIONS:
            raise InvalidArgumentError(
                f"prioritization must be one of {PRIORITIZATIONS}, got {prioritization!r}")
        if sequence is not None:
            sequence = _sequence(sequence, capacity=capacity, n_step=n_step, num_envs=num_envs)
        compression, compression_budget = _compression(compression, compression_budget, frame_stack, specs,
                                                       capacity=capacity, n_step=n_step, num_envs=num_envs,
                                                       sequence=sequence)
        return cls(capacity=capacity, fields=specs, frame_stack=frame_stack, n_step=n_step,
                   gamma=gamma, alpha=alpha, eps=eps, max_priority=max_priority,
                   beta=as_schedule(beta).to_dict(), weight_norm=weight_norm, next_of=next_of,
                   num_envs=num_envs, seed=seed, storage=storage, prioritization=prioritization,
                   compression=compression, compression_budget=compression_budget, sequence=sequence)

    # -- derived -------------------------------------------------------------
    @property
    def schedule(self) -> LinearSchedule | ConstantSchedule:
        """The beta schedule ``beta`` records."""
        return schedule_from_dict(self.beta)

    @property
    def seq(self) -> Sequence | None:
        """The ``Sequence`` of a buffer whose items are sequences, else None."""
        return None if self.sequence is None else Sequence(**self.sequence)

    def dtype(self, name: str) -> np.dtype[Any]:
        """The numpy dtype of field ``name``."""
        return np.dtype(self.fields[name][1])

    def shape(self, name: str) -> tuple[int, ...]:
        """The per-transition shape of field ``name``."""
        return self.fields[name][0]

    def step_inputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """What ``add`` takes per env: name -> (shape, dtype), required first."""
        out = {n: (s, np.dtype(d)) for n, (s, d) in self.fields.items()}
        for n in self.next_of:
            out[f"next_{n}"] = out[n]
        for n in BUILTIN:
            out[n] = ((), np.dtype(bool))
        return out

    # -- persistence -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict recorded on disk (``from_dict`` reads it back)."""
        d = asdict(self)
        d["fields"] = {n: [list(s), dt] for n, (s, dt) in self.fields.items()}
        names = list(self.fields)
        if names != sorted(names):  # (files are written with sorted keys: the fields' own order kept beside)
            d["field_order"] = names
        d["next_of"] = list(self.next_of)
        if self.prioritization == "proportional":
            del d["prioritization"]  # the default: configs stay as format 1 wrote them
        if self.compression is None:
            del d["compression"], d["compression_budget"]
        if self.sequence is None:
            del d["sequence"]  # likewise
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """Inverse of ``to_dict``, validated as ``build`` validates arguments (a
        recorded config is read from disk: hostile until checked)."""
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"a recorded config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in dataclass_fields(cls)} | {"field_order"}
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise InvalidArgumentError(f"a recorded config has unknown key(s) {unknown[:5]}")
        missing = sorted({"capacity", "fields"} - set(d))
        if missing:
            raise InvalidArgumentError(f"a recorded config lacks key(s) {missing}")
        kw = dict(d)
        try:
            if "beta" in kw:
                kw["beta"] = schedule_from_dict(kw["beta"])
            if not isinstance(kw["fields"], dict):
                raise InvalidArgumentError("fields must be an object")
            kw["fields"] = {n: (tuple(s), dt) for n, (s, dt) in kw["fields"].items()}
            if "field_order" in kw:  # the batch's key order, as the buffer was made (to_dict)
                order = kw.pop("field_order")
                if not isinstance(order, list) or not all(isinstance(n, str) for n in order) \
                        or sorted(order) != sorted(kw["fields"]) or order == sorted(order):
                    raise InvalidArgumentError(f"field_order must list the fields' names once each, in an order "
                                               f"other than sorted, got {order!r:.200}")
                kw["fields"] = {n: kw["fields"][n] for n in order}
            if kw.get("next_of") is not None:
                kw["next_of"] = tuple(kw["next_of"])
            return cls.build(**kw)
        except BigperError as e:
            raise InvalidArgumentError(f"a recorded config is not valid: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as e:
            raise InvalidArgumentError(f"a recorded config is not valid: {type(e).__name__}: {e}") from None

    def differences(self, other: "Config", ignore: Collection[str] = ("seed",),
                    only: Collection[str] | None = None) -> list[str]:
        """Keys whose values differ, each as ``key: this != other`` (among ``only`` when given)."""
        a, b = asdict(self), asdict(other)
        a["fields"], b["fields"] = self.to_dict()["fields"], other.to_dict()["fields"]
        keys = [k for k in a if k not in ignore and (only is None or k in only)]
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in keys if a[k] != b.get(k)]
