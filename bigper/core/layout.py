"""What a buffer of a given config keeps in its storage: the arrays, their
rows, shapes and dtypes. The buffer allocates them; snapshot loads and offline
datasets check files against them before anything is allocated."""

from __future__ import annotations

import numpy as np

from ..config import BUILTIN, Config
from ..errors import InvalidArgumentError
from ..frames.store import FrameStore
from ..storage import check_kind
from ..storage.base import fits_spec

FRAMED = ("obs", "next_obs")  # with frame stacks these go to the frame ring, not a per-row array


def plain_fields(cfg: Config) -> dict:
    """``name -> (shape, dtype)`` of the fields stored one row per transition
    (the end flags live in the buffer's ``ends`` array; with frame stacks,
    ``obs`` and ``next_obs`` in the frame ring)."""
    framed = FRAMED if cfg.frame_stack else ()
    return {n: v for n, v in cfg.step_inputs().items() if n not in BUILTIN and n not in framed}


def storage_specs(cfg: Config, frames: FrameStore | None = None) -> dict:
    """``name -> (rows, shape, dtype)`` of every array a buffer of ``cfg``
    keeps in its storage; ``frames``: its frame ring, when one is built."""
    specs = {name: (cfg.capacity, tuple(shape), np.dtype(dtype))
             for name, (shape, dtype) in plain_fields(cfg).items()}
    if cfg.frame_stack:
        specs.update((frames if frames is not None else FrameStore(cfg, None)).specs())
    return specs


def storage_growth(cfg: Config, frames: FrameStore | None = None) -> dict:
    """``name -> rows of one step`` of the arrays of ``storage_specs`` that
    start with one step and grow (the compressed log, unless capped by a
    budget); their spec's rows are the most they reach."""
    if not cfg.frame_stack:
        return {}
    return (frames if frames is not None else FrameStore(cfg, None)).growth()



def allocate(store, cfg: Config, frames: FrameStore | None = None) -> None:
    """``store.allocate`` of what a buffer of ``cfg`` keeps (the arrays that
    grow, from one step); then the log takes the segments the storage holds."""
    specs, growth = storage_specs(cfg, frames), storage_growth(cfg, frames)
    store.allocate(specs, growth) if growth else store.allocate(specs)
    if frames is not None:
        frames.attach()


def check_storage(store, cfg: Config, frames: FrameStore | None = None) -> None:
    """``from_parts``: ``InvalidArgumentError`` naming the first array of
    ``storage_specs`` that ``store`` does not hold as a buffer of ``cfg``
    keeps it (missing, another dtype or row shape, other rows: whole steps of
    an array that grows, every row where the storage does not grow), or a
    kind of bigper's own it is not (``storage.check_kind``). Reads at most
    two rows an array (a storage without arrays: its first and last)."""
    check_kind(store)
    specs, growth = storage_specs(cfg, frames), storage_growth(cfg, frames)
    held = store.arrays if store.arrays is not None else store.dsets
    who = type(store).__name__
    for name, (rows, shape, dtype) in specs.items():
        want = (int(rows), tuple(shape), np.dtype(dtype))
        grown = store.rows(name) if name in growth else None  # (None: allocated whole)
        if held is not None:
            if name not in held:
                _refuse(who, name, want, "no such array")
            a = held[name]
            have = (int(a.shape[0]), tuple(a.shape[1:]), np.dtype(a.dtype))
        else:
            n = want[0] if grown is None else int(grown)
            try:
                got = np.asarray(store.read(name, np.array([0, max(n - 1, 0)], dtype=np.int64)))
            except (LookupError, ValueError, TypeError) as e:  # (a missing array, too few rows)
                _refuse(who, name, want, f"reading its rows 0 and {n - 1} failed: {e!r:.200}")
            have = (n, tuple(got.shape[1:]), got.dtype)
        if not fits_spec(name, have, want, growth if grown is not None else {}):
            _refuse(who, name, want, f"{have[0]:,} rows of shape {have[1]} {have[2]}")


def _refuse(who: str, name: str, want: tuple, have: str) -> None:
    raise InvalidArgumentError(
        f"store: a buffer of this config keeps array {name!r} as {want[0]:,} rows of shape {want[1]} "
        f"{want[2]} (PrioritizedReplayBuffer.storage_specs), but this {who} holds {have} "
        "(nothing was written)")
