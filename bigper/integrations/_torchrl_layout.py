"""How a TorchRL TensorDict's leaves become a bigper buffer's fields, and back.

TorchRL keys are tuples of strings (``("next", "reward")``); bigper fields are
file-safe names (``[A-Za-z_][A-Za-z0-9_-]*``, at most 128 characters). The
mapping is a bijection that needs no record beside the buffer: a field's name
spells its key, so a buffer resumed from its path or loaded from a snapshot
knows its TensorDict layout from its config alone::

    "action"                  -> "t--action"
    ("collector", "traj_ids") -> "t--collector--traj_ids"
    "a.b" (a dot in a key)    -> "t--a-00002eb"         (any other character: "-" + 6 hex digits)

A root key ``K`` that has a successor ``("next", K)`` of the same shape and
dtype is one field with ``next_of`` (``"next_t--K"``): under ``n_step > 1``
the successor is the one at the window's end, as bigper gives ``next_obs``.
A key only under ``"next"`` is a field of its own (its first step's value
under n-step). Three keys are special:

- the observation key (``obs_key``, default ``"pixels"``) with ``frame_stack=k``
  is bigper's ``"obs"``, each of its frames stored once: TorchRL's ``CatFrames``
  stacks on the first axis (``dim=-3`` of a ``(C, H, W)`` frame), so a stack
  ``(k * C, H, W)`` is the core's ``(k, C, H, W)``, a reshape both ways;
- ``("next", "reward")`` of shape ``(1,)`` with ``n_step > 1`` is bigper's
  scalar ``"reward"`` (the n-step return is computed at sample time);
- the episode flags: bigper's own ``terminated``/``truncated`` (which end
  frame stacks and n-step windows) are read from ``("next", "terminated")``
  and ``("next", "truncated")`` (or ``("next", "done")``), which are also
  stored as they are, so a batch gives back every key it was given.

Nothing here imports torch: ``Layout`` takes and gives numpy shapes and dtypes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..core.layout import own_names
from ..errors import InvalidArgumentError

Key = tuple[str, ...]  # a TorchRL nested key
Spec = tuple[tuple[int, ...], np.dtype]  # a leaf's per-item shape and dtype

PREFIX = "t"
SEP = "--"
MAX_NAME = 128  # bigper.config.check_name
_PLAIN = re.compile(r"[A-Za-z0-9_]")
NEXT = "next"
REWARD: Key = (NEXT, "reward")
DONE, TERMINATED, TRUNCATED = (NEXT, "done"), (NEXT, "terminated"), (NEXT, "truncated")
# Keys the buffer writes into a sampled TensorDict itself: never stored.
SAMPLE_KEYS = ("index", "priority_weight")
STEPS_KEY = "steps_to_next_obs"  # TorchRL's n-step key (DQNLoss and the value estimators read it)


def _part(p: str) -> str:
    return "".join(c if _PLAIN.match(c) else f"-{ord(c):06x}" for c in p)


def field_name(key: Key) -> str:
    """The field that holds ``key`` (not the special ones: see the module).

    Raises
    ------
    InvalidArgumentError
        When the name would pass bigper's 128-character limit.
    """
    name = PREFIX + "".join(SEP + _part(p) for p in key)
    if len(name) > MAX_NAME:
        raise InvalidArgumentError(f"TensorDict key {key!r} is too long for a bigper field: its field name "
                                   f"{name[:40]!r}... has {len(name)} characters, at most {MAX_NAME}")
    return name


def key_of(name: str) -> Key:
    """The key a field name spells (the inverse of ``field_name``).

    Raises
    ------
    InvalidArgumentError
        For a name ``field_name`` cannot have made.
    """
    if not name.startswith(PREFIX + SEP):
        raise InvalidArgumentError(f"field {name!r} is not a TorchRL key's field (they start with "
                                   f"{PREFIX + SEP!r})")
    parts: list[str] = []
    cur: list[str] = []
    i, n = len(PREFIX) + len(SEP), len(name)
    while i < n:
        c = name[i]
        if c != "-":
            if not _PLAIN.match(c):
                raise InvalidArgumentError(f"field {name!r}: character {c!r} at {i} is not one field_name makes")
            cur.append(c)
            i += 1
        elif name.startswith(SEP, i):
            parts.append("".join(cur))
            cur = []
            i += len(SEP)
        else:
            code = name[i + 1:i + 7]
            if len(code) != 6 or not re.fullmatch(r"[0-9a-f]{6}", code) or int(code, 16) > 0x10FFFF:
                raise InvalidArgumentError(f"field {name!r}: bad escape {name[i:i + 7]!r} at {i}")
            ch = chr(int(code, 16))
            if _PLAIN.match(ch):  # field_name never escapes these: one key, one name
                raise InvalidArgumentError(f"field {name!r}: escape of a plain character {ch!r} at {i}")
            cur.append(ch)
            i += 7
    parts.append("".join(cur))
    return tuple(parts)


def _key(key) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


@dataclass(frozen=True)
class Layout:
    """The mapping of one buffer: TorchRL leaves <-> core fields.

    Attributes
    ----------
    leaves : dict[Key, Spec]
        Every stored TorchRL key with its per-item shape and dtype.
    fields : dict[str, Spec]
        The core's fields (``PrioritizedReplayBuffer(fields=...)``).
    next_of : tuple of str
        The core's ``next_of``.
    source : dict[Key, str]
        For each key, the core name it is written as and read back from
        (a field, ``next_<field>``, ``"obs"``, ``"next_obs"``, ``"reward"``).
    obs_key : Key or None
        The frame-stacked observation (with ``frame_stack``).
    frame_stack : int or None
    n_step : int
    """

    leaves: dict
    fields: dict
    next_of: tuple
    source: dict
    obs_key: Key | None
    frame_stack: int | None
    n_step: int

    @classmethod
    def from_leaves(cls, leaves: Mapping[Key, Spec], *, obs_key, frame_stack: int | None,
                    n_step: int) -> "Layout":
        """The layout of TensorDicts with these leaves (what the first ``extend`` sees).

        Raises
        ------
        InvalidArgumentError
            A key that no layout can hold, naming it.
        """
        leaves = {_key(k): (tuple(s), np.dtype(d)) for k, (s, d) in leaves.items()}
        for flag in (TERMINATED, DONE):
            if flag in leaves:
                break
        else:
            raise InvalidArgumentError(
                f"a TensorDict for the replay buffer needs ('next', 'terminated') or ('next', 'done') (where "
                f"episodes end), got keys {sorted(leaves)[:12]}")
        for flag in (DONE, TERMINATED, TRUNCATED):
            if flag in leaves and (leaves[flag][1] != np.bool_ or int(np.prod(leaves[flag][0])) != 1):
                raise InvalidArgumentError(f"TensorDict key {flag!r} must hold one bool per item, got shape "
                                           f"{leaves[flag][0]} dtype {leaves[flag][1]}")
        fields: dict[str, Spec] = {}
        source: dict[Key, str] = {}
        next_of: list[str] = []
        okey = None
        if frame_stack is not None:
            okey = _key(obs_key)
            nkey = (NEXT,) + okey
            if okey not in leaves or nkey not in leaves:
                raise InvalidArgumentError(
                    f"frame_stack={frame_stack} stores the frames of obs_key={obs_key!r} once: the TensorDict "
                    f"needs {okey!r} and {nkey!r}, got keys {sorted(leaves)[:12]}")
            (shape, dtype), nspec = leaves[okey], leaves[nkey]
            if nspec != (shape, dtype):
                raise InvalidArgumentError(f"{nkey!r} has shape {nspec[0]} dtype {nspec[1]}, but {okey!r} has "
                                           f"shape {shape} dtype {dtype}: a frame stack needs the same")
            if not shape or shape[0] % frame_stack:
                raise InvalidArgumentError(
                    f"frame_stack={frame_stack}: {okey!r} of shape {shape} is not a stack of {frame_stack} frames "
                    "on its first axis (CatFrames(N=k, dim=-3) on (C, H, W) frames gives (k*C, H, W))")
            fields["obs"] = ((frame_stack, shape[0] // frame_stack) + shape[1:], dtype)
            source[okey], source[nkey] = "obs", "next_obs"
            next_of.append("obs")
        reward_scalar = n_step > 1
        if reward_scalar:
            spec = leaves.get(REWARD)
            if spec is None or spec[0] != (1,) or spec[1].kind != "f":
                raise InvalidArgumentError(
                    f"n_step={n_step} sums ('next', 'reward'), which must be a float of shape (1,) per item "
                    f"(TorchRL's reward spec), got {spec}")
            fields["reward"] = ((), spec[1])
            source[REWARD] = "reward"
        for key, spec in sorted(leaves.items()):  # one order whatever the TensorDict's: a resume compares
            if key in source:
                continue
            if not key or any(not isinstance(p, str) for p in key):
                raise InvalidArgumentError(f"TensorDict key {key!r} is not a key of strings")
            if key[0] == NEXT and len(key) > 1 and key[1] != NEXT and leaves.get(key[1:]) == spec:
                continue  # the successor of a root key, which claims it below
            name = field_name(key)
            fields[name] = spec
            source[key] = name
            nkey = (NEXT,) + key
            if key[0] != NEXT and leaves.get(nkey) == spec:
                if len("next_" + name) > MAX_NAME:  # (its successor's field is named after it)
                    raise InvalidArgumentError(
                        f"TensorDict key {nkey!r} is too long for a bigper field: its field name "
                        f"{('next_' + name)[:40]!r}... has {len(name) + 5} characters, at most {MAX_NAME}")
                next_of.append(name)
                source[nkey] = "next_" + name
        taken = set(own_names())
        clash = [n for n in list(fields) + [f"next_{n}" for n in next_of] if n in taken]
        if clash:  # field_name's prefix makes this impossible; a guard against a future own name
            raise InvalidArgumentError(f"TensorDict keys map to bigper's own names {clash}")
        return cls(leaves=leaves, fields=fields, next_of=tuple(next_of), source=source,
                   obs_key=okey, frame_stack=frame_stack, n_step=n_step)

    @classmethod
    def from_config(cls, fields: Mapping[str, Spec], next_of, *, obs_key, frame_stack: int | None,
                    n_step: int) -> "Layout":
        """The layout of a buffer recorded with these core ``fields`` and
        ``next_of`` (a resumed path, a loaded snapshot).

        Raises
        ------
        InvalidArgumentError
            A field that this mapping cannot have made.
        """
        leaves: dict[Key, Spec] = {}
        for name, (shape, dtype) in fields.items():
            shape, dtype = tuple(shape), np.dtype(dtype)
            if name == "obs":
                if frame_stack is None or len(shape) < 2:
                    raise InvalidArgumentError(f"the recorded buffer has an 'obs' field of shape {shape}; "
                                               "this buffer needs frame_stack= to read it")
                okey = _key(obs_key)
                leaves[okey] = leaves[(NEXT,) + okey] = ((shape[0] * shape[1],) + shape[2:], dtype)
            elif name == "reward":
                leaves[REWARD] = ((1,), dtype)
            else:
                key = key_of(name)
                leaves[key] = (shape, dtype)
                if name in next_of:
                    leaves[(NEXT,) + key] = (shape, dtype)
        lay = cls.from_leaves(leaves, obs_key=obs_key, frame_stack=frame_stack, n_step=n_step)
        if dict(lay.fields) != {n: (tuple(s), np.dtype(d)) for n, (s, d) in fields.items()} \
                or set(lay.next_of) != set(next_of):
            raise InvalidArgumentError(f"the recorded fields {sorted(fields)} (next_of {list(next_of)}) are not "
                                       "a TorchRL layout of this mapping")
        return lay

    def core_shape(self, key: Key) -> tuple[int, ...]:
        """The per-item shape the core stores ``key`` as."""
        name = self.source[key]
        if name in ("obs", "next_obs"):
            return self.fields["obs"][0]
        if name == "reward":
            return ()
        return self.fields[name.removeprefix("next_")][0]
