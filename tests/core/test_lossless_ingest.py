"""Input is stored losslessly or refused (promise 12, docs/reliability.md).

Every value ``add``/``extend`` take is either stored exactly (integer and bool
fields: the very number given; float fields: the nearest value of the field's
dtype, finite unless the value given was already inf or NaN) or refused with
``InvalidArgumentError`` naming the field, the value, its position and the
dtype, with the buffer exactly as before. The oracle below is plain Python
arithmetic (ints and ``Fraction``), independent of numpy's casts.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import from_dtype

import bigper
from bigper.errors import InvalidArgumentError

from tests._hostile_snapshot_cases import fingerprint as files_fingerprint
from tests.buffer.test_validation import assert_same, fingerprint

DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                 np.uint32, np.uint64, np.float16, np.float32, np.float64)]
INTS = [d for d in DTYPES if d.kind in "iu"]
FLOATS = [d for d in DTYPES if d.kind == "f"]

EDGE_INTS = sorted({v for d in INTS for m in (np.iinfo(d).min, np.iinfo(d).max) for v in (m - 1, m, m + 1)}
                   | {0, 1, -1, 2, 2**63, -2**63 - 1, 2**64, 2**70, -2**70, 2**1030})
EDGE_FLOATS = [0.0, -0.0, 1.0, 0.5, 2.5, 3.0, -3.0, math.nan, math.inf, -math.inf, 1e300, -1e300, 2.0**63,
               -2.0**63, 2.0**64, 2.0**63 - 1024, 65504.0, 65519.0, 65520.0, 128.0, -129.0, 255.0, 256.0]
for _d in FLOATS:
    _i = np.finfo(_d)
    EDGE_FLOATS += [float(_i.max), -float(_i.max), float(_i.smallest_subnormal), float(_i.tiny)]
    # just below and at the point where rounding to the dtype overflows
    _ulp = float(_i.max) - float(np.nextafter(_i.max, _d.type(0)))
    EDGE_FLOATS += [float(_i.max) + _ulp / 2, float(np.nextafter(float(_i.max) + _ulp / 2, 0.0))]
EDGE_FLOATS = [x for x in EDGE_FLOATS if not math.isinf(x) or x in (math.inf, -math.inf)]


# -- the oracle ---------------------------------------------------------------

def overflow_at(d: np.dtype) -> Fraction:
    """The smallest magnitude that rounds to inf in float dtype ``d`` (round half to even)."""
    mx = np.finfo(d).max
    return Fraction(float(mx)) + (Fraction(float(mx)) - Fraction(float(np.nextafter(mx, d.type(0))))) / 2


def accepts(x, d: np.dtype) -> bool:
    """Whether the exact Python number ``x`` may go into a field of dtype ``d``."""
    if isinstance(x, complex):
        return False
    if d.kind == "b":
        return x == 0 or x == 1
    if d.kind in "iu":
        if isinstance(x, float) and (not math.isfinite(x) or x != math.floor(x)):
            return False
        return np.iinfo(d).min <= int(x) <= np.iinfo(d).max
    if isinstance(x, float) and not math.isfinite(x):
        return True  # a NaN or inf given is stored as it is
    return abs(Fraction(x)) < overflow_at(d)


def check_stored(s, x, d: np.dtype):
    """The stored scalar ``s`` (of dtype ``d``) holds the given number ``x`` as promised."""
    assert s.dtype == d
    if d.kind == "b":
        assert s.item() is bool(x)
    elif d.kind in "iu":
        assert s.item() == int(x) and type(s.item()) is int
    elif isinstance(x, float) and math.isnan(x):
        assert math.isnan(s.item())
    elif isinstance(x, float) and math.isinf(x):
        assert s.item() == x
    else:
        v = s.item()
        assert math.isfinite(v), (x, v)
        # the nearest value of the dtype: neither neighbour is closer to x
        err = abs(Fraction(v) - Fraction(x))
        for toward in (-np.inf, np.inf):
            with np.errstate(over="ignore"):
                nb = np.nextafter(s, d.type(toward)).item()
            if math.isfinite(nb):
                assert err <= abs(Fraction(nb) - Fraction(x)), (x, v, nb)
        if x == 0:
            assert math.copysign(1.0, v) == math.copysign(1.0, x)


def exact_in(x, d: np.dtype):
    """``x`` as a scalar of numpy dtype ``d`` when that holds exactly its value, else None."""
    if isinstance(x, float) and math.isnan(x):
        return d.type(x) if d.kind == "f" else None
    if d.kind == "b":
        return d.type(x) if x in (0, 1) else None
    if d.kind in "iu":
        ok = not isinstance(x, float) or (math.isfinite(x) and x == math.floor(x))
        return d.type(int(x)) if ok and np.iinfo(d).min <= int(x) <= np.iinfo(d).max else None
    if isinstance(x, int) and abs(x) > 2**1000:
        return None
    with np.errstate(over="ignore"):
        y = d.type(x)
    if math.isinf(y.item()):
        return y if isinstance(x, float) and math.isinf(x) else None
    return y if Fraction(y.item()) == Fraction(x) else None


# -- what is given ------------------------------------------------------------

@st.composite
def given_values(draw):
    """(the object passed to add, the exact Python number it holds)."""
    form = draw(st.sampled_from(["bool", "int", "float", "numpy", "numpy", "numpy", "complex"]))
    if form == "bool":
        x = draw(st.booleans())
        return x, x
    if form == "int":
        x = draw(st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2**70, 2**70), st.integers(-300, 300)))
        return x, x
    if form == "float":
        x = draw(st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(), st.integers(-300, 300).map(float)))
        return x, x
    if form == "complex":
        x = complex(draw(st.floats(-10, 10)), draw(st.sampled_from([0.0, 1.0])))
        return draw(st.sampled_from([x, np.complex128(x), np.complex64(x)])), x
    d = draw(st.sampled_from(DTYPES))
    fits = [y for y in (exact_in(x, d) for x in EDGE_INTS + EDGE_FLOATS) if y is not None]
    y = draw(st.one_of(st.sampled_from(fits), from_dtype(d)))
    y = d.type(y)
    return y, y.item()


def as_array(given, shape, pos, form):
    """An array (or nested list) of ``shape`` holding ``given`` at ``pos`` and zeros elsewhere."""
    if form == "list":
        out = np.zeros(shape, dtype=object)
        out[pos] = given.item() if isinstance(given, np.generic) else given
        return out.tolist()  # Python numbers: zeros (int) and the value given
    dt = given.dtype if isinstance(given, np.generic) else np.asarray(given).dtype
    out = np.zeros(shape, dtype=dt)
    out[pos] = given
    return out


def new(d, shape=(), fused=True, **kw):
    buf = bigper.PrioritizedReplayBuffer(6, {"x": (shape, d), "y": ((), np.float32)}, seed=1, **kw)
    buf.add(x=np.zeros(shape, d), y=np.float32(1))  # something there before
    buf.add(x=np.ones(shape, d), y=np.float32(2), terminated=True)
    buf._fused = fused
    return buf


def stored_x(buf, slot):
    return buf.gather(np.array([slot]))["x"][0]


def attempt(buf, call):
    """(None, fingerprint untouched) or (the error) for ``call(buf)``."""
    before = fingerprint(buf)
    try:
        call(buf)
    except InvalidArgumentError as e:
        assert_same(before, fingerprint(buf))
        buf.add(x=stored_x(buf, 0), y=np.float32(3))  # still works afterwards
        return e
    return None


# -- the properties -------------------------------------------------------------

@settings(max_examples=600, deadline=None)
@given(gv=given_values(), d=st.sampled_from(DTYPES))
def test_a_scalar_is_stored_exactly_or_refused(gv, d):
    given, x = gv
    fast, slow = new(d), new(d, fused=False)
    errs = [attempt(b, lambda b: b.add(x=given, y=0.5)) for b in (fast, slow)]
    assert (errs[0] is None) == (errs[1] is None) and str(errs[0]) == str(errs[1])
    if accepts(x, d):
        assert errs[0] is None, f"{given!r} into {d} refused: {errs[0]}"
        check_stored(stored_x(fast, 2), x, d)
        assert stored_x(fast, 2).tobytes() == stored_x(slow, 2).tobytes()
    else:
        assert errs[0] is not None, f"{given!r} into {d} stored as {stored_x(fast, 2)!r}"
        msg = str(errs[0])
        assert "x" in msg and str(d) in msg
        if not isinstance(x, complex):
            assert repr(x) in msg and ".astype(" in msg, msg


@settings(max_examples=300, deadline=None)
@given(gv=given_values(), d=st.sampled_from(DTYPES), data=st.data())
def test_an_array_is_stored_exactly_or_refused_naming_the_position(gv, d, data):
    given, x = gv
    shape = data.draw(st.sampled_from([(), (3,), (2, 3)]), label="shape")
    pos = data.draw(st.tuples(*[st.integers(0, n - 1) for n in shape]), label="pos")
    form = data.draw(st.sampled_from(["array", "list"] if shape else ["array"]), label="form")
    arr = as_array(given, shape, pos, form)
    fast, slow = new(d, shape), new(d, shape, fused=False)
    errs = [attempt(b, lambda b: b.add(x=arr, y=0.5)) for b in (fast, slow)]
    assert (errs[0] is None) == (errs[1] is None) and str(errs[0]) == str(errs[1])
    if accepts(x, d):
        assert errs[0] is None, f"{arr!r} into {d} refused: {errs[0]}"
        s = np.asarray(stored_x(fast, 2))
        check_stored(s[pos], x, d)
        assert not np.delete(s.ravel(), np.ravel_multi_index(pos, shape) if shape else 0).any()
        assert s.tobytes() == np.asarray(stored_x(slow, 2)).tobytes()
    else:
        assert errs[0] is not None, f"{arr!r} into {d} stored as {stored_x(fast, 2)!r}"
        msg = str(errs[0])
        assert "x" in msg and str(d) in msg
        if not isinstance(x, complex):
            assert repr(x) in msg, msg
            if shape:
                assert f"position {pos}" in msg, msg


@settings(max_examples=150, deadline=None)
@given(gv=given_values(), d=st.sampled_from(DTYPES), data=st.data())
def test_extend_stores_exactly_or_refuses_the_whole_call(gv, d, data):
    given, x = gv
    m = data.draw(st.integers(1, 9), label="m")
    r = data.draw(st.integers(0, m - 1), label="row")
    if isinstance(given, np.generic):
        col = np.zeros(m, given.dtype)
    else:
        col = np.zeros(m, np.asarray(given).dtype)
    col[r] = given
    fast, slow = new(d), new(d, fused=False)
    ext = {"x": col, "y": np.arange(m, dtype=np.float32)}
    errs = [attempt(b, lambda b: b.extend(ext)) for b in (fast, slow)]
    assert (errs[0] is None) == (errs[1] is None) and str(errs[0]) == str(errs[1])
    if accepts(x, d):
        assert errs[0] is None, errs[0]
        if m - r <= 6:  # row r (transition 2 + r) is still in the ring of 6
            check_stored(stored_x(fast, (2 + r) % 6), x, d)
        for b in (fast, slow):
            assert len(b) == min(6, m + 2)
        assert fast.storage.arrays["x"].tobytes() == slow.storage.arrays["x"].tobytes()
    else:
        assert errs[0] is not None
        if not isinstance(x, complex):
            assert repr(x) in str(errs[0]) and f"position ({r},)" in str(errs[0])


# -- the cases from the issue, literally ---------------------------------------------

@pytest.mark.parametrize("d, value, shown", [
    (np.int64, 2**63, "9223372036854775808"),
    (np.int32, 2**40, "1099511627776"),
    (np.uint8, np.uint16(300), "300"),
    (np.float32, 1e300, "1e+300"),
    (np.float32, np.float64(1e300), "1e+300"),
    (np.int64, -2**63 - 1, "-9223372036854775809"),
    (np.int64, 2.5, "2.5"),
    (np.int64, math.nan, "nan"),
    (np.bool_, 2, "2"),
    (np.float16, 70000, "70000"),
])
def test_the_issue_cases_are_refused_with_nothing_changed(d, value, shown):
    buf = new(np.dtype(d))
    err = attempt(buf, lambda b: b.add(x=value, y=0.5))
    assert err is not None
    msg = str(err)
    assert "x" in msg and shown in msg and str(np.dtype(d)) in msg and ".astype(" in msg


@pytest.mark.parametrize("d, value, want", [
    (np.int64, 3.0, 3),
    (np.int64, np.float32(-7), -7),
    (np.int64, 2**63 - 1, 2**63 - 1),
    (np.uint64, 2**64 - 1, 2**64 - 1),
    (np.uint8, np.uint16(200), 200),
    (np.bool_, 1, True),
    (np.bool_, 0.0, False),
    (np.int8, True, 1),
    (np.float32, 1e-300, 0.0),  # underflow to zero is finite: stored
])
def test_values_that_fit_are_stored(d, value, want):
    buf = new(np.dtype(d))
    buf.add(x=value, y=0.5)
    s = stored_x(buf, 2)
    assert s.dtype == np.dtype(d) and s.item() == want and type(s.item()) is type(want)


def test_asking_for_the_cast_is_casting_first():
    buf = new(np.dtype(np.uint8))
    buf.add(x=np.uint16(300).astype(np.uint8), y=np.float32(1e30).astype(np.float32))
    assert stored_x(buf, 2).item() == 44


@pytest.mark.parametrize("flag", ["terminated", "truncated"])
@pytest.mark.parametrize("value, ok", [(1, True), (0, True), (np.uint8(1), True), (1.0, True), (2, False),
                                       (-1, False), (0.5, False), (math.nan, False)])
def test_end_flags_take_only_zero_and_one(flag, value, ok):
    buf = new(np.dtype(np.int64))
    err = attempt(buf, lambda b: b.add(x=1, y=0.5, **{flag: value}))
    assert (err is None) == ok
    if err is not None:
        assert flag in str(err) and "bool" in str(err)


# -- every route ------------------------------------------------------------------

BAD_OBS = [(np.int64, 300, "300"), (np.float64, 2.5, "2.5"), (np.int16, -1, "-1")]


def route_buffer(route, tmp_path):
    kw = dict(seed=0)
    if route == "memmap":
        kw.update(storage="memmap", path=tmp_path / "b")
    elif route == "hdf5":
        kw.update(storage="hdf5", path=tmp_path / "b.h5")
    elif route == "nstep":
        kw.update(n_step=3, gamma=0.9)
    elif route == "envs":
        kw.update(num_envs=2)
    if route == "frames":
        kw.update(frame_stack=2)
    fields = {"obs": ((2, 3) if route == "frames" else (3,), np.uint8), "reward": ((), np.float32)}
    buf = bigper.PrioritizedReplayBuffer(8, fields, **kw)
    return buf


def route_step(route, rng):
    lead = (2,) if route == "envs" else ()
    shape = (2, 3) if route == "frames" else (3,)
    o = rng.integers(0, 5, lead + shape).astype(np.uint8)
    n = rng.integers(0, 5, lead + shape).astype(np.uint8)
    if route == "frames":
        n[..., 0, :] = o[..., 1, :]
    return {"obs": o, "next_obs": n, "reward": rng.random(lead).astype(np.float32),
            "terminated": np.zeros(lead, bool)}


@pytest.mark.parametrize("route", ["memory", "memmap", "hdf5", "nstep", "envs", "frames"])
@pytest.mark.parametrize("where", ["obs", "next_obs", "reward"])
@pytest.mark.parametrize("call", ["add", "extend"])
def test_every_route_refuses_a_lossy_value_with_nothing_changed(route, where, call, tmp_path):
    rng = np.random.default_rng(0)
    buf = route_buffer(route, tmp_path)
    for _ in range(5):
        buf.add(**route_step(route, rng))
    before, disk = fingerprint(buf), files_fingerprint(tmp_path)
    steps = [route_step(route, rng) for _ in range(3)]
    for dt, value, shown in BAD_OBS if where != "reward" else [(np.float64, 1e39, "1e+39"), (np.int64, 2**25, None)]:
        bad = [dict(s) for s in steps]
        v = bad[1][where].astype(dt)
        v.reshape(-1)[-1] = value
        bad[1][where] = v
        if call == "add":
            buf.add(**bad[0])
            before, disk = fingerprint(buf), files_fingerprint(tmp_path)
            go = lambda: buf.add(**bad[1])  # noqa: E731
        else:
            go = lambda: buf.extend({k: np.stack([s[k] for s in bad]) for k in bad[0]})  # noqa: E731
        if shown is None:  # an int that float32 holds (rounded): stored
            go()
            continue
        with pytest.raises(InvalidArgumentError) as info:
            go()
        assert where in str(info.value) and shown in str(info.value)
        assert_same(before, fingerprint(buf))
        assert files_fingerprint(tmp_path) == disk
    buf.add(**steps[2])
    buf.close()


# -- every dtype pair at its edges, directly ----------------------------------------

def _edges_of(d: np.dtype):
    return [y for y in (exact_in(x, d) for x in EDGE_INTS + EDGE_FLOATS) if y is not None]


@pytest.mark.parametrize("src", DTYPES, ids=str)
@pytest.mark.parametrize("dst", DTYPES, ids=str)
def test_every_dtype_pair_at_its_edges(src, dst):
    """Each edge value of ``src`` alone (0-d), inside a 1-d array and inside a
    strided 2-d view, cast by ``cast_exact`` into ``dst``: stored as the oracle
    says or refused naming it and its position."""
    from bigper.core.ingest import cast_exact
    for y in _edges_of(src):
        x = y.item()
        for shape, pos in (((), ()), ((5,), (3,)), ((3, 4), (2, 1))):
            base = np.zeros((shape[0], 2 * shape[1]) if len(shape) == 2 else shape, src)
            v = base[:, ::2] if len(shape) == 2 else base  # not C-contiguous in 2-d
            v[pos] = y
            try:
                out = cast_exact(v, dst, "f")
            except InvalidArgumentError as e:
                assert not accepts(x, dst), f"{x!r} ({src}) into {dst} refused: {e}"
                assert repr(x) in str(e) and str(dst) in str(e)
                assert not shape or f"position {pos}" in str(e)
                continue
            assert accepts(x, dst), f"{x!r} ({src}) into {dst} stored as {out[pos]!r}"
            assert out.dtype == dst and out.shape == shape
            check_stored(out[pos], x, dst)
            assert not np.delete(out.ravel(), np.ravel_multi_index(pos, shape) if shape else 0).any()


@pytest.mark.parametrize("d, values", [
    (np.uint64, [0, 2**64 - 1]),  # numpy makes float64 of these (2**64: out of range)
    (np.uint64, [1, 2**63 + 1]),  # float64 would round it to 2**63
    (np.uint64, [[0, 2**63 + 3], [5, 2**64 - 2]]),
    (np.int64, [True, 2**62 + 1]),
])
def test_lists_of_python_ints_keep_every_digit(d, values):
    shape = np.shape(np.array(values, dtype=object))
    buf = new(np.dtype(d), shape)
    buf.add(x=values, y=0.5)
    s = stored_x(buf, 2)
    assert s.tolist() == np.array(values, dtype=object).tolist()  # Python ints, compared exactly


@pytest.mark.parametrize("values, pos", [([0, 2**64], (1,)), ([-1, 2**63], (0,)), ([[1, 2], [3, 2.5]], (1, 1))])
def test_lists_that_do_not_fit_are_refused_naming_the_value(values, pos):
    buf = new(np.dtype(np.uint64), np.shape(np.array(values, dtype=object)))
    err = attempt(buf, lambda b: b.add(x=values, y=0.5))
    assert err is not None and f"position {pos}" in str(err) and "uint64" in str(err)


# -- byte orders and complex fields (attack round on issue 23 §4) ---------------------

def _swapped(d: np.dtype) -> np.dtype:
    return d if d.itemsize == 1 else d.newbyteorder("S")


@pytest.mark.parametrize("order", ["big source", "big field", "both big"])
@pytest.mark.parametrize("src", DTYPES, ids=str)
@pytest.mark.parametrize("dst", DTYPES, ids=str)
def test_every_dtype_pair_in_the_other_byte_order(src, dst, order):
    """A big-endian array (from a file, a network buffer) or a big-endian field
    is stored as the oracle says or refused naming the value, never a raw
    error from a compiled kernel that takes native byte order only."""
    from bigper.core.ingest import cast_exact
    s = _swapped(src) if order != "big field" else src
    t = _swapped(dst) if order != "big source" else dst
    for y in _edges_of(src):
        x = y.item()
        v = np.zeros(5, s)
        v[3] = y
        try:
            out = cast_exact(v, t, "f")
        except InvalidArgumentError as e:
            assert not accepts(x, dst), f"{x!r} ({s}) into {t} refused: {e}"
            assert repr(x) in str(e) and "position (3,)" in str(e)
            continue
        assert accepts(x, dst), f"{x!r} ({s}) into {t} stored as {out[3]!r}"
        assert out.dtype == t
        check_stored(out[3:4].astype(dst)[0], x, dst)


@pytest.mark.parametrize("field", [">f4", ">i2", "<f4", "<i2"])
def test_a_big_endian_array_or_field_is_stored_through_add_and_extend(field):
    d = np.dtype(field)
    buf = bigper.PrioritizedReplayBuffer(6, {"x": ((2,), d), "y": ((), np.float32)}, seed=1)
    buf.add(x=np.array([7, -3], ">i8"), y=np.float32(1))
    buf.extend({"x": np.array([[1, 2], [3, 4]], ">f8"), "y": np.ones(2, ">f4")})
    assert buf.gather(np.arange(3))["x"].tolist() == [[7, -3], [1, 2], [3, 4]]
    bad = np.array([1, 2**40], ">i8") if d.kind == "i" else np.array([1, 1e300], ">f8")
    err = attempt(buf, lambda b: b.add(x=bad, y=np.float32(1)))
    assert err is not None and repr(bad[1].item()) in str(err) and "position (1,)" in str(err)


@pytest.mark.parametrize("given", [np.array([1e300 + 0j]), np.array([1 + 1e300j]), np.array([-1e300 - 1e300j])])
def test_a_complex_value_that_overflows_a_complex64_field_is_refused(given):
    buf = new(np.dtype(np.complex64), (1,))
    err = attempt(buf, lambda b: b.add(x=given, y=np.float32(1)))
    assert err is not None and "complex64" in str(err) and "position (0,)" in str(err)


def test_a_list_refused_into_a_float_field_names_the_value_as_given():
    """numpy turns ``[2**63, 2**63, -1]`` into float64 (rounding the ints); the
    refusal names the int the caller gave, not numpy's rounded float."""
    buf = bigper.PrioritizedReplayBuffer(8, {"x": ((3,), np.float16)})
    with pytest.raises(bigper.InvalidArgumentError, match=r"x = 9223372036854775808 \(int\) at position \(0,\)"):
        buf.add(x=[2**63, 2**63, -1])
    assert len(buf) == 0
