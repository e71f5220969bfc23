"""What a buffer of a given config keeps in its storage: the arrays, their
rows, shapes and dtypes. The buffer allocates them; snapshot loads and offline
datasets check files against them before anything is allocated."""

from __future__ import annotations

import numpy as np

from ..config import BUILTIN, Config
from ..frames.store import FrameStore

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
