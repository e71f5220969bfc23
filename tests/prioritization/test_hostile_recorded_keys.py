"""Hostile tests of ``Prioritization.recorded_keys`` (the classmethod a
load uses to compare a live path's recorded priorities with a snapshot's),
called directly: whatever ``meta``, ``arrays`` and ``capacity`` hold, it
returns None or a float64 array of ``capacity`` keys, never raises, never
crashes; and where a rank heap decodes, each slot it names reads exactly
the key's bits (NaN, infinities, -0.0, subnormals, negatives included).

Attacked: capacity 0 and 1 and non-integers, ``n`` huge / negative / numpy
ints / bool / float / str, heaps of every dtype, shape and memory layout
(Fortran, reversed, strided, broadcast, read-only, memmap, 0-d, object,
big-endian, matrix, masked), words at the int64 limits, slots named twice or
past capacity, key bit patterns of every special float; a seeded fuzz of
random heaps.

A case that holds is a plain test; a case that shows a bug is
``xfail(strict=True)`` with the bug in its reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from bigper.prioritization.base import Prioritization
from bigper.prioritization.proportional import Proportional
from bigper.prioritization.rank import RankPrioritizer
from bigper.prioritization._rank_sort import SLOT_MASK

I64 = np.iinfo(np.int64)
CLASSES = [Prioritization, Proportional, RankPrioritizer]


def keys_of(cls, meta, arrays, capacity):
    """``cls.recorded_keys``: None or a float64 array of ``capacity`` keys; nothing raised."""
    got = cls.recorded_keys(meta, arrays, capacity)
    if got is not None:
        assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (int(capacity),), \
            (type(got), getattr(got, "dtype", None), getattr(got, "shape", None))
    return got


def heap(capacity, n, keys=None, tick=7):
    """A well-formed heap: positions 0..n-1 name slots n-1..0 (reversed), with ``keys``' bits."""
    h = np.zeros((capacity, 2), np.int64)
    k = np.arange(n, dtype=np.float64) + 0.5 if keys is None else np.asarray(keys, np.float64)
    h[:n, 0] = k.view(np.int64)
    h[:n, 1] = (tick << 31) | np.arange(n)[::-1]
    return h


@pytest.mark.parametrize("capacity", [0, 1, 2, 5])
def test_a_well_formed_heap_decodes_every_named_slot_and_nan_elsewhere(capacity):
    for n in range(capacity + 1):
        got = keys_of(RankPrioritizer, {"n": n}, {"rank_heap": heap(capacity, n)}, capacity)
        want = np.full(capacity, np.nan)
        want[np.arange(n)[::-1]] = np.arange(n) + 0.5
        np.testing.assert_array_equal(got, want)


SPECIAL = {
    "nan": np.float64(np.nan).view(np.int64),
    "negative nan": np.int64(-1),  # (all ones: a NaN)
    "signalling nan": np.int64(0x7FF0000000000001),
    "inf": np.float64(np.inf).view(np.int64),
    "-inf": np.float64(-np.inf).view(np.int64),
    "-0.0": np.float64(-0.0).view(np.int64),
    "smallest subnormal": np.int64(1),
    "largest subnormal": np.int64(0x000FFFFFFFFFFFFF),
    "negative": np.float64(-3.25).view(np.int64),
    "int64 min": np.int64(I64.min),
    "int64 max": np.int64(I64.max),
}


@pytest.mark.parametrize("what", sorted(SPECIAL))
def test_key_bits_of_every_special_float_decode_bit_for_bit(what):
    h = heap(4, 3)
    h[:3, 0] = SPECIAL[what]
    got = keys_of(RankPrioritizer, {"n": 3}, {"rank_heap": h}, 4)
    assert got is not None
    np.testing.assert_array_equal(got[:3].view(np.int64), np.full(3, SPECIAL[what]))
    assert np.isnan(got[3])


WORDS = {"int64 max": (I64.max, None), "int64 min": (I64.min, None), "-1": (-1, None),
         "slot mask": (SLOT_MASK, None), "slot = capacity": (4, None), "tick only": (1 << 31, "ok"),
         "huge tick, slot 3": ((((1 << 32) - 1) << 31) | 3, "ok")}


@pytest.mark.parametrize("what", sorted(WORDS))
def test_words_at_the_int64_limits_are_refused_or_decode_in_range(what):
    word, outcome = WORDS[what]
    h = heap(4, 4)
    h[:, 1] = (7 << 31) | np.array([0, 1, 2, 3])
    pos = int(word & SLOT_MASK) if word >= 0 else 0
    pos = pos if pos < 4 else 0
    h[pos, 1] = word  # (keeps the slots distinct where the word names one in range)
    got = keys_of(RankPrioritizer, {"n": 4}, {"rank_heap": h}, 4)
    if outcome is None:
        assert got is None
    else:
        assert got is not None and not np.isnan(got).any()


@pytest.mark.parametrize("n", [-1, 5, 10 ** 30, -(10 ** 30), 2 ** 63, True, False, 1.0, float("nan"), "2", None,
                               [2], {"n": 2}])
def test_a_hostile_n_is_none_never_an_error(n):
    assert keys_of(RankPrioritizer, {"n": n}, {"rank_heap": heap(4, 2)}, 4) is None


@pytest.mark.parametrize("n", [np.int64(2), np.int32(2), np.uint8(2), np.int64(-1), np.uint64(2 ** 64 - 1)])
def test_a_numpy_integer_n_is_none_or_decodes_as_its_value(n):
    got = keys_of(RankPrioritizer, {"n": n}, {"rank_heap": heap(4, 2)}, 4)
    assert got is None or np.array_equal(got, keys_of(RankPrioritizer, {"n": int(n)}, {"rank_heap": heap(4, 2)}, 4),
                                         equal_nan=True)


@pytest.mark.parametrize("capacity", [-1, 2.0, float("nan"), None, "2", True, False, np.int64(2), np.uint8(2),
                                      10 ** 30])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_hostile_capacity_is_none_or_an_array_of_that_many(cls, capacity):
    arrays = {"rank_heap": heap(2, 1), "leaves": np.ones(2)}
    try:
        expected = int(capacity)
    except (TypeError, ValueError, OverflowError):
        expected = None
    got = cls.recorded_keys({"n": 1}, arrays, capacity)
    if got is not None:
        assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (expected,)


def _layouts(h):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        matrix = np.matrix(h)
    ro = h.copy()
    ro.setflags(write=False)
    strided = np.zeros((h.shape[0] * 2, 4), np.int64)[::2, ::2]
    strided[:] = h
    rev = h[::-1].copy()[::-1]  # (negative strides, the same values)
    return {"fortran": np.asfortranarray(h), "read-only": ro, "strided": strided, "reversed view": rev,
            "broadcast row": np.broadcast_to(h[:1], h.shape), "recarray view": h.view(np.recarray),
            "matrix": matrix, "masked": np.ma.masked_array(h, mask=np.zeros_like(h, bool))}


@pytest.mark.parametrize("what", sorted(_layouts(heap(3, 3))))
def test_a_heap_of_any_memory_layout_decodes_as_its_values(what):
    h = heap(5, 3, keys=[-0.0, np.inf, 2.5])
    want = keys_of(RankPrioritizer, {"n": 3}, {"rank_heap": h}, 5)
    got = keys_of(RankPrioritizer, {"n": 3}, {"rank_heap": _layouts(h)[what]}, 5)
    if what == "broadcast row":
        assert got is None  # (one slot named three times)
    else:
        np.testing.assert_array_equal(got.view(np.int64), want.view(np.int64))


def test_a_memmap_heap_and_memmap_leaves_decode_as_their_values(tmp_path):
    h = heap(4, 4)
    p = tmp_path / "rank_heap.npy"
    np.save(p, h)
    got = keys_of(RankPrioritizer, {"n": 4}, {"rank_heap": np.load(p, mmap_mode="r")}, 4)
    np.testing.assert_array_equal(got, keys_of(RankPrioritizer, {"n": 4}, {"rank_heap": h}, 4))
    q = tmp_path / "leaves.npy"
    np.save(q, np.array([0.0, 1.5, np.nan, -0.0]))
    got = keys_of(Proportional, {}, {"leaves": np.load(q, mmap_mode="r")}, 4)
    np.testing.assert_array_equal(got, [0.0, 1.5, np.nan, -0.0])


BAD_HEAPS = {
    "0-d": np.array(5, np.int64), "1-d": np.zeros(8, np.int64), "3 columns": np.zeros((4, 3), np.int64),
    "transposed": np.zeros((2, 4), np.int64), "one row short": np.zeros((3, 2), np.int64),
    "object": heap(4, 2).astype(object), "uint64": heap(4, 2).astype(np.uint64),
    "big-endian": heap(4, 2).astype(">i8"), "int32": heap(4, 2).astype(np.int32),
    "float64": heap(4, 2).view(np.float64), "structured": np.zeros(4, [("a", "<i8"), ("b", "<i8")]),
    "list": heap(4, 2).tolist(), "bytes": heap(4, 2).tobytes(), "None": None,
    "3-d": np.zeros((4, 2, 1), np.int64),
}


@pytest.mark.parametrize("what", sorted(BAD_HEAPS))
def test_a_heap_of_the_wrong_kind_is_none(what):
    assert keys_of(RankPrioritizer, {"n": 2}, {"rank_heap": BAD_HEAPS[what]}, 4) is None


BAD_LEAVES = {
    "0-d": np.array(1.0), "2-d": np.zeros((4, 1)), "short": np.zeros(3), "long": np.zeros(5),
    "object": np.zeros(4, object), "float32": np.zeros(4, np.float32), "big-endian": np.zeros(4, ">f8"),
    "int64": np.zeros(4, np.int64), "list": [0.0] * 4, "None": None,
}


@pytest.mark.parametrize("what", sorted(BAD_LEAVES))
def test_leaves_of_the_wrong_kind_are_none(what):
    assert keys_of(Proportional, {}, {"leaves": BAD_LEAVES[what]}, 4) is None


@pytest.mark.parametrize("meta", [None, [], "n", 5, {"n": 2}, {}])
@pytest.mark.parametrize("arrays", [None, [], "x", {}, {"rank_heap": None, "leaves": None}, ()])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_meta_and_arrays_of_any_type_are_none_or_keys(cls, meta, arrays):
    keys_of(cls, meta, arrays, 4)


def test_a_seeded_fuzz_of_random_heaps_never_raises_and_decodes_exactly():
    rng = np.random.default_rng(20261128)
    decoded = 0
    for _ in range(3000):
        cap = int(rng.integers(0, 6))
        h = rng.integers(I64.min, I64.max, size=(cap, 2), dtype=np.int64, endpoint=True)
        if rng.random() < 0.6 and cap:  # (mostly in-range words: some decode)
            h[:, 1] = (rng.integers(0, 1 << 32, size=cap) << 31) | rng.permutation(cap)
            if rng.random() < 0.3:
                h[rng.integers(0, cap), 1] = rng.choice([I64.min, I64.max, -1, cap, SLOT_MASK])
        n = int(rng.integers(-1, cap + 2))
        got = keys_of(RankPrioritizer, {"n": n}, {"rank_heap": h}, cap)
        if got is None:
            continue
        decoded += 1
        named = h[:n, 1] & SLOT_MASK
        assert 0 <= n <= cap and (h[:n, 1] >= 0).all() and len(set(named.tolist())) == n
        np.testing.assert_array_equal(got[named].view(np.int64), h[:n, 0])
        rest = np.setdiff1d(np.arange(cap), named)
        assert np.isnan(got[rest]).all()
    assert decoded > 500
