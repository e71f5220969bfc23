"""What a buffer of a given config keeps in its storage: the arrays, their
rows, shapes and dtypes. The buffer allocates them; snapshot loads and offline
datasets check files against them before anything is allocated. And the
names bigper keeps for itself, which no field may take (promise 17)."""

from __future__ import annotations

from functools import cache

import numpy as np

from ..config import BUILTIN, RESERVED, Config, Sequence
from ..errors import InvalidArgumentError
from ..frames.store import FrameStore
from ..frames.zstd import bound
from ..prioritization import STRATEGIES
from ..storage import check_kind
from ..storage.base import RECORD, fits_spec
from .ring import Ring
from .units import unit_class

FRAMED = ("obs", "next_obs")  # with frame stacks these go to the frame ring, not a per-row array
# Arrays an older format stored and a load still reads (snapshot/_refs.py converts them): no field
# may take their names either, or a snapshot's field would read as them.
LEGACY_NAMES = ("obs_ref", "next_obs_ref")
# State arrays that follow from what else is recorded: kept in memory (``state_dict``) and restored
# from there as they are, never written to disk (issue 43: 16 bytes a transition); a restore from
# disk derives them (the ring's gid from count, each slot's oldest frame from frame_ref / frame_off).
DERIVED = ("gid", "frames_minref")


def for_disk(state: tuple[dict, dict]) -> tuple[dict, dict]:
    """A ``state_dict()`` as it is recorded on disk: without ``DERIVED``."""
    meta, arrays = state
    return meta, {n: a for n, a in arrays.items() if n not in DERIVED}


def plain_fields(cfg: Config) -> dict:
    """``name -> (shape, dtype)`` of the fields stored one row per transition
    (the end flags live in the buffer's ``ends`` array; with frame stacks,
    ``obs`` and ``next_obs`` in the frame ring)."""
    framed = FRAMED if cfg.frame_stack else ()
    return {n: v for n, v in cfg.step_inputs().items() if n not in BUILTIN and n not in framed}


def storage_specs(cfg: Config, frames: FrameStore | None = None) -> dict:
    """``name -> (rows, shape, dtype)`` of every array a buffer of ``cfg``
    keeps in its storage; ``frames``: its frame ring, when one is built.

    Raises ``RuntimeError`` (an internal error) when two arrays would take
    one name: the storage would hand both the same array. The constructor
    refuses such fields first (``check_field_names``); this is the last line."""
    specs = {name: (cfg.capacity, tuple(shape), np.dtype(dtype))
             for name, (shape, dtype) in plain_fields(cfg).items()}
    if cfg.frame_stack:
        own = (frames if frames is not None else FrameStore(cfg, None)).specs()
        shared = sorted(set(own) & set(specs))
        if shared:
            raise RuntimeError(f"bigper internal error: the frame store's arrays {shared} take the names of "
                               "fields; the constructor should have refused them (check_field_names)")
        specs.update(own)
    return specs


def _kinds() -> list[Config]:
    """One config of every kind of buffer whose arrays are named differently:
    plain and n-step transitions, frame stacks raw, compressed with a log that
    grows and with one capped by a budget, sequences with and without frame
    stacks; its fields (``obs``, ``reward``) are a user's."""
    fields = {"obs": ((2, 8, 8), "|u1"), "reward": ((), "<f4")}
    seq = Sequence(length=2, burn_in=1)
    kinds = [{}, {"n_step": 2}, {"frame_stack": 2}, {"frame_stack": 2, "compression": "zstd"},
             {"frame_stack": 2, "compression": "zstd", "compression_budget": bound(64)},
             {"sequence": seq}, {"frame_stack": 2, "sequence": seq}]
    return [Config.build(capacity=64, fields=fields, **kw) for kw in kinds]


@cache
def own_names() -> tuple[str, ...]:
    """Every name bigper gives its own arrays and keys, sorted: what no field may be called.

    Derived from the code that makes them, over every kind of buffer
    (``_kinds``), so that a new array cannot be forgotten here: the arrays
    of ``storage_specs`` that are not a field's (the frame ring, the
    compressed log and its index, the stacks' references; and those an older
    format kept, ``LEGACY_NAMES``), the arrays of a
    recorded state (the ring's, each prioritization's, the frame store's and
    the sequence items'), the storages' own record beside the arrays
    (``storage.base.RECORD``), and the keys of batches and ``to_torch``
    dicts (``config.RESERVED``).

    Returns
    -------
    tuple of str
    """
    names = set(RESERVED) | {RECORD} | set(LEGACY_NAMES)
    for cfg in _kinds():
        frames = FrameStore(cfg, None) if cfg.frame_stack else None
        names |= set(storage_specs(cfg, frames)) - set(plain_fields(cfg)) - set(FRAMED)
        ring = Ring(cfg.capacity, cfg.num_envs, cfg.n_step)
        names |= set(ring.state()[1])
        if frames is not None:
            names |= set(frames.state()[1])
        names |= set(unit_class(cfg).ARRAYS)
    for strategy in STRATEGIES.values():
        names |= set(strategy.ARRAYS)
    return tuple(sorted(names))


def check_field_names(cfg: Config) -> None:
    """Refuse a config whose fields (or their successors ``next_<name>``) take
    a name bigper keeps for its own arrays or keys (``own_names``): the two
    would share one array, or one key of a batch. Promise 17.

    Raises
    ------
    InvalidArgumentError
        Naming the fields and the list of names that are taken.
    """
    names = list(cfg.fields) + [f"next_{n}" for n in cfg.next_of]
    taken = own_names()
    bad = [n for n in names if n in taken]
    if bad:
        raise InvalidArgumentError(
            f"fields may not be called {bad}: bigper stores or computes these names itself; the names taken "
            f"are {list(taken)}")


def storage_growth(cfg: Config, frames: FrameStore | None = None) -> dict:
    """``name -> rows of one step`` of the arrays of ``storage_specs`` that
    start with one step and grow (the compressed log, unless capped by a
    budget); their spec's rows are the most they reach."""
    if not cfg.frame_stack:
        return {}
    return (frames if frames is not None else FrameStore(cfg, None)).growth()



def held_frames(store) -> dict:
    """``FrameStore``'s ``offsets`` and ``index`` as ``store`` (allocated)
    holds them: the dtype of its ``frame_off`` and the row shape of its
    ``frame_index``, each None when it holds none (``check_storage`` names
    what is missing)."""
    held = store.arrays if store.arrays is not None else store.dsets
    if held is not None:
        off, index = held.get("frame_off"), held.get("frame_index")
        return {"offsets": None if off is None else np.dtype(off.dtype),
                "index": None if index is None else tuple(int(x) for x in index.shape[1:])}
    out: dict = {"offsets": None, "index": None}
    for key, name in (("offsets", "frame_off"), ("index", "frame_index")):
        try:
            a = np.asarray(store.read(name, np.zeros(1, dtype=np.int64)))
        except (LookupError, ValueError, TypeError):  # (no such array: check_storage says so)
            continue
        out[key] = np.dtype(a.dtype) if key == "offsets" else tuple(int(x) for x in a.shape[1:])
    return out


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
