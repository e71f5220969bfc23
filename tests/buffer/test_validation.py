"""Bad input: each raises a clear error that names the argument and the given
value, and the buffer is exactly as before (a full fingerprint of its state,
its storage and its random generator is compared)."""

import math

import numpy as np
import pytest

import bigper

FIELDS = {"obs": ((2,), np.float32), "action": ((), np.int64), "reward": ((), np.float32)}
CAP = 8


def step(g=0, **over):
    s = {"obs": np.array([g, g], np.float32), "action": g, "reward": 0.5 * g,
         "next_obs": np.array([g + 1, g + 1], np.float32), "terminated": g % 4 == 3}
    s.update(over)
    return s


def steps(m, g0=0, **over):
    d = {"obs": np.full((m, 2), g0, np.float32), "action": np.arange(g0, g0 + m, dtype=np.int64),
         "reward": np.ones(m, np.float32), "next_obs": np.zeros((m, 2), np.float32),
         "terminated": np.zeros(m, bool), "truncated": np.zeros(m, bool)}
    d.update(over)
    return d


def make(weight_norm="global", fill=11):
    """A used buffer: wrapped around, priorities updated, sampled (rng and beta moved)."""
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, weight_norm=weight_norm, seed=4,
                                         beta=bigper.LinearSchedule(0.4, 1.0, 10))
    for g in range(fill):
        buf.add(**step(g))
    if fill:
        buf.update_priorities(np.array([1, 2, 2]), np.array([3.0, 0.5, 7.0]))
        buf.sample(4)
    return buf


def fingerprint(buf):
    """Everything that makes up the buffer's state, copied."""
    fp = {}
    prio = buf.prioritization  # rank keeps its heap on the prioritizer, proportional on a tree
    for owner, prefix in ((buf, ""), (prio, "prio."), (prio.tree if prio.tree is not None else prio, "tree."),
                          (buf.storage, "store.")):
        for k, v in vars(owner).items():
            if isinstance(v, np.ndarray):
                fp[prefix + k] = v.copy()
            elif isinstance(v, (bool, int, float, str, type(None))):
                fp[prefix + k] = v
    for name, arr in (buf.storage.arrays or {}).items():
        fp["data." + name] = arr.copy()
    meta, arrays = buf.state_dict()
    fp["meta"] = repr(meta)  # count, max leaf, beta step, rng state
    for k, v in arrays.items():
        fp["state." + k] = np.array(v, copy=True)
    fp["rng"] = repr(buf._draws.rng.bit_generator.state)
    fp["total"] = buf.total_priority
    fp["len"] = len(buf)
    return fp


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), k


def check_rejected(buf, call, exc, *names):
    """``call(buf)`` raises ``exc`` whose message holds every string in
    ``names``, and leaves ``buf`` exactly as it was; afterwards the buffer
    still works."""
    before = fingerprint(buf)
    with pytest.raises(exc) as info:
        call(buf)
    msg = str(info.value)
    for part in names:
        assert part in msg, f"{part!r} not in error message {msg!r}"
    assert_same(before, fingerprint(buf))
    return msg


# -- update_priorities ------------------------------------------------------

BAD_PRIORITIES = [
    (np.array([1.0, np.nan, 2.0]), "nan"),
    (np.array([1.0, 2.0, np.inf]), "inf"),
    (np.array([-np.inf, 1.0, 1.0]), "-inf"),
    (np.array([1.0, -0.5, 1.0]), "-0.5"),
    (np.array([1.0, 1.0, -1e-300]), "-1e-300"),
]


@pytest.mark.parametrize("norm", ["global", "batch"])
@pytest.mark.parametrize("p,shown", BAD_PRIORITIES)
def test_update_by_indices_rejects_bad_priorities(norm, p, shown):
    buf = make(norm)
    pos = str(int(np.flatnonzero(~(np.isfinite(p) & (p >= 0)))[0]))
    check_rejected(buf, lambda b: b.update_priorities(np.array([0, 1, 2]), p), ValueError,
                   "priorities", shown, pos)


@pytest.mark.parametrize("p,shown", BAD_PRIORITIES)
def test_update_by_batch_rejects_bad_priorities(p, shown):
    buf = make()
    batch = buf.sample(3)
    check_rejected(buf, lambda b: b.update_priorities(batch, p), ValueError, "priorities", shown)


@pytest.mark.parametrize("idx,p", [
    ([0, 1, 2], [1.0, 2.0]),
    ([0], [1.0, 2.0]),
    ([0, 1], [[1.0, 2.0]]),
    ([0, 1], [[1.0, 2.0], [3.0, 4.0]]),
])
def test_update_rejects_a_length_or_shape_mismatch(idx, p):
    buf = make()
    got = str(np.shape(p))
    check_rejected(buf, lambda b: b.update_priorities(np.array(idx), np.array(p)), ValueError,
                   "priorities", f"({len(idx)},)", got)


def test_update_by_batch_rejects_a_length_mismatch():
    buf = make()
    batch = buf.sample(4)
    check_rejected(buf, lambda b: b.update_priorities(batch, np.ones(3)), ValueError,
                   "priorities", "(4,)", "(3,)")


@pytest.mark.parametrize("bad", [CAP, CAP + 1, -1, -CAP, 2**40, -(2**62)])
def test_update_rejects_out_of_range_indices(bad):
    buf = make()
    check_rejected(buf, lambda b: b.update_priorities(np.array([0, 1, bad]), np.ones(3)), IndexError,
                   "indices", str(bad))


def test_update_rejects_a_slot_never_written():
    buf = make(fill=3)
    check_rejected(buf, lambda b: b.update_priorities(np.array([2, 5]), np.ones(2)), IndexError,
                   "indices", "5")


@pytest.mark.parametrize("idx", [np.array([0.0, 1.0]), np.array([[0, 1]]), np.array([True, False]),
                                 np.array(["0", "1"])])
def test_update_rejects_indices_that_are_not_a_1d_int_array(idx):
    buf = make()
    check_rejected(buf, lambda b: b.update_priorities(idx, np.ones(2)), TypeError,
                   "indices", str(idx.dtype))


def test_update_rejects_priorities_that_are_not_numbers():
    buf = make()
    check_rejected(buf, lambda b: b.update_priorities(np.array([0, 1]), np.array(["a", "b"])), TypeError,
                   "priorities", "<U1")


def test_a_bad_row_at_the_end_applies_none_of_the_good_ones():
    buf = make()
    idx = np.arange(CAP)
    p = np.linspace(1, 5, CAP)
    p[-1] = np.nan
    check_rejected(buf, lambda b: b.update_priorities(idx, p), ValueError, "priorities")
    p[-1] = 1.0
    idx[-1] = CAP
    check_rejected(buf, lambda b: b.update_priorities(idx, p), IndexError, "indices")


def test_a_large_bad_update_changes_nothing():
    """The bulk path (many rows, O(N) rebuild) validates first too."""
    cap = 5000
    buf = bigper.PrioritizedReplayBuffer(cap, {"x": ((), np.float32)}, seed=0)
    buf.extend({"x": np.zeros(cap, np.float32)})
    buf.update_priorities(np.arange(cap), np.linspace(0, 3, cap))
    idx = np.tile(np.arange(cap), 2)
    p = np.ones(2 * cap)
    p[-1] = -1.0
    check_rejected(buf, lambda b: b.update_priorities(idx, p), ValueError, "priorities", "-1.0")
    p[-1] = 1.0
    idx[-1] = cap
    check_rejected(buf, lambda b: b.update_priorities(idx, p), IndexError, "indices", str(cap))


# -- add / extend -----------------------------------------------------------

@pytest.mark.parametrize("call,exc,names", [
    # unknown and missing fields
    (lambda b: b.add(**step(), bogus=1), KeyError, ["bogus"]),
    (lambda b: b.add(**{k: v for k, v in step().items() if k != "reward"}), KeyError, ["reward"]),
    (lambda b: b.add(**{k: v for k, v in step().items() if k != "next_obs"}), KeyError, ["next_obs"]),
    # wrong shapes
    (lambda b: b.add(**step(obs=np.zeros(3, np.float32))), ValueError, ["obs", "(2,)", "(3,)"]),
    (lambda b: b.add(**step(obs=np.zeros((1, 2), np.float32))), ValueError, ["obs", "(2,)", "(1, 2)"]),
    (lambda b: b.add(**step(action=np.array([1, 2]))), ValueError, ["action", "()", "(2,)"]),
    (lambda b: b.add(**step(terminated=np.array([True]))), ValueError, ["terminated", "(1,)"]),
    # values the field's dtype does not hold exactly (tests/core/test_lossless_ingest.py has the rest)
    (lambda b: b.add(**step(action=1.5)), ValueError, ["action", "1.5", "int64"]),
    (lambda b: b.add(**step(action=np.float32(2.5))), ValueError, ["action", "2.5", "float32", "int64"]),
    # dtypes that are never cast implicitly
    (lambda b: b.add(**step(obs=np.array([1 + 1j, 2]))), TypeError, ["obs", "complex128", "float32"]),
    (lambda b: b.add(**step(obs=np.array(["a", "b"]))), TypeError, ["obs", "<U1"]),
    (lambda b: b.add(**step(terminated=2)), ValueError, ["terminated", "2", "bool"]),
    (lambda b: b.add(**step(truncated=0.5)), ValueError, ["truncated", "0.5", "bool"]),
    # priorities given to add
    (lambda b: b.add(**step(), priorities=np.nan), ValueError, ["priorities", "nan"]),
    (lambda b: b.add(**step(), priorities=-2.0), ValueError, ["priorities", "-2.0"]),
    (lambda b: b.add(**step(), priorities=np.inf), ValueError, ["priorities", "inf"]),
    (lambda b: b.add(**step(), priorities=[1.0, 2.0]), ValueError, ["priorities", "(2,)"]),
    (lambda b: b.add(**step(), priorities="high"), TypeError, ["priorities", "<U4"]),
])
def test_add_rejects(call, exc, names):
    check_rejected(make(), call, exc, *names)


@pytest.mark.parametrize("call,exc,names", [
    (lambda b: b.extend([1, 2, 3]), TypeError, ["dict", "list"]),
    (lambda b: b.extend(dict(steps(3), bogus=np.zeros(3))), KeyError, ["bogus"]),
    (lambda b: b.extend({k: v for k, v in steps(3).items() if k != "action"}), KeyError, ["action"]),
    # the leading (time) axes disagree
    (lambda b: b.extend(steps(3, action=np.arange(4))), ValueError, ["action", "(3,)", "(4,)"]),
    (lambda b: b.extend(steps(3, reward=np.ones(2, np.float32))), ValueError, ["reward", "(3,)", "(2,)"]),
    (lambda b: b.extend(steps(3, obs=np.zeros((3, 3), np.float32))), ValueError, ["obs", "(3, 2)", "(3, 3)"]),
    (lambda b: b.extend(steps(3, terminated=np.zeros(2, bool))), ValueError, ["terminated", "(3,)", "(2,)"]),
    (lambda b: b.extend(steps(3, action=np.r_[1.0, 2.0, 1.5])), ValueError, ["action", "1.5", "(2,)", "int64"]),
    (lambda b: b.extend(steps(3), priorities=np.ones(2)), ValueError, ["priorities", "(3,)", "(2,)"]),
    (lambda b: b.extend(steps(3), priorities=np.ones((3, 1))), ValueError, ["priorities", "(3,)", "(3, 1)"]),
    (lambda b: b.extend(steps(3), priorities=np.array([1.0, 2.0, np.nan])), ValueError,
     ["priorities", "nan", "2"]),
    (lambda b: b.extend(steps(20), priorities=np.r_[np.ones(19), -1.0]), ValueError,
     ["priorities", "-1.0", "19"]),
])
def test_extend_rejects(call, exc, names):
    check_rejected(make(), call, exc, *names)


@pytest.mark.parametrize("kind", [{"alpha": 1.0}, {"alpha": 0.6}, {"prioritization": "rank"}],
                         ids=["proportional-alpha1", "proportional", "rank"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, -1e-300])
@pytest.mark.parametrize("how", ["add", "add-2-envs", "extend-1", "extend-3"])
def test_a_bad_priority_in_row_0_is_refused_by_the_priority_check(kind, bad, how):
    """Row 0 is every single-env add: the check must look at it too. Rank has
    no leaf cap that would refuse it later, proportional with alpha=1 keeps -1
    as a negative leaf; the message is the priority check's own, not a later one's."""
    envs = 2 if how == "add-2-envs" else 1
    buf = bigper.PrioritizedReplayBuffer(CAP, FIELDS, num_envs=envs, seed=4, **kind)
    if how == "add":
        call = lambda b: b.add(**step(3), priorities=bad)
    elif how == "add-2-envs":
        both = {k: np.stack([v, v]) for k, v in step(3).items()}
        call = lambda b: b.add(**both, priorities=np.array([bad, 1.0]))
    else:
        m = int(how[-1])
        call = lambda b: b.extend(steps(m), priorities=np.r_[bad, np.ones(m - 1)])
    for filled in (False, True):  # into an empty buffer, then into a used one
        msg = check_rejected(buf, call, bigper.InvalidArgumentError, "priorities", "finite and >= 0",
                             "position 0")
        assert str(bad) in msg
        if not filled:
            fill = {k: np.stack([v] * envs, axis=1) for k, v in steps(2).items()} if envs > 1 else steps(4)
            buf.extend(fill, priorities=np.arange(4.0).reshape(fill["action"].shape))
    assert len(buf) == 4 and np.isfinite(buf.total_priority) and buf.total_priority > 0


def test_rejected_add_into_an_empty_buffer_leaves_it_empty():
    buf = make(fill=0)
    check_rejected(buf, lambda b: b.add(**step(action=0.5)), ValueError, "action")
    check_rejected(buf, lambda b: b.extend(steps(3), priorities=[1, 2, -3]), ValueError, "priorities")
    assert len(buf) == 0 and buf.total_priority == 0.0


# -- sample -----------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 2.5, 3.0, True, "4", None, np.float64(4)])
def test_sample_rejects_a_bad_batch_size(bad):
    check_rejected(make(), lambda b: b.sample(bad), (ValueError, TypeError), "batch_size", repr(bad))


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, 1.5])
def test_sample_rejects_a_bad_beta_override(bad):
    check_rejected(make(), lambda b: b.sample(4, beta=bad), ValueError, "beta", repr(bad))


def test_sampling_an_empty_buffer():
    buf = make(fill=0)
    check_rejected(buf, lambda b: b.sample(4), ValueError, "len=0")


def test_sampling_when_every_priority_is_zero():
    buf = bigper.PrioritizedReplayBuffer(4, {"x": ((), np.float32)}, eps=0.0, seed=0)
    buf.extend({"x": np.zeros(3, np.float32)}, priorities=np.zeros(3))
    assert len(buf) == 3
    check_rejected(buf, lambda b: b.sample(2), ValueError, "sample")


def test_an_empty_update_is_a_no_op():
    buf = make()
    before = fingerprint(buf)
    buf.update_priorities(np.zeros(0, np.int64), np.zeros(0))
    assert_same(before, fingerprint(buf))


# -- constructor ------------------------------------------------------------

def build(**over):
    kw = dict(capacity=CAP, fields=FIELDS)
    kw.update(over)
    cap = kw.pop("capacity")
    fields = kw.pop("fields")
    return bigper.PrioritizedReplayBuffer(cap, fields, **kw)


@pytest.mark.parametrize("arg,value", [
    ("capacity", 0), ("capacity", -5), ("capacity", 2.5), ("capacity", True), ("capacity", "8"),
    ("alpha", -0.1), ("alpha", math.nan), ("alpha", math.inf), ("alpha", "0.6"),
    ("eps", -1e-6), ("eps", math.nan),
    ("max_priority", 0.0), ("max_priority", -1.0), ("max_priority", math.nan),
    ("gamma", 1.5), ("gamma", -0.1),
    ("beta", -0.4), ("beta", math.nan), ("beta", "0.4"),
    ("weight_norm", "max"), ("weight_norm", None),
    ("storage", "cloud"),
    ("n_step", 0), ("n_step", 1.5),
    ("num_envs", 0),
    ("seed", -1), ("seed", 1.5),
    ("next_of", "nope"),
])
def test_constructor_rejects(arg, value):
    with pytest.raises((ValueError, TypeError)) as info:
        build(**{arg: value})
    msg = str(info.value)
    assert arg in msg, msg
    assert repr(value) in msg or str(value) in msg, msg


@pytest.mark.parametrize("fields,names", [
    ({}, ["fields", "{}"]),
    ([("obs", ((2,), np.float32))], ["fields"]),
    ({"obs": ((2,), "no-such-dtype")}, ["obs", "no-such-dtype"]),
    ({"obs": ((2,), object)}, ["obs", "object"]),
    ({"obs": ((0,), np.float32)}, ["obs", "(0,)"]),
    ({"obs": ((-2,), np.float32)}, ["obs", "(-2,)"]),
    ({"obs": "float32"}, ["obs", "float32"]),
    ({"discount": ((), np.float32)}, ["discount"]),
    ({"terminated": ((), bool)}, ["terminated"]),
    ({"a/b": ((), np.float32)}, ["a/b"]),
    ({"..": ((), np.float32)}, [".."]),
    ({"obs": ((2,), np.float32), "next_obs": ((2,), np.float32)}, ["next_obs"]),
])
def test_constructor_rejects_bad_fields(fields, names):
    with pytest.raises((ValueError, TypeError)) as info:
        build(fields=fields)
    for part in names:
        assert part in str(info.value), str(info.value)


@pytest.mark.parametrize("args,names", [
    ((0.4, 1.0, 0), ["steps", "0"]),
    ((0.4, 1.0, 2.5), ["steps", "2.5"]),
    ((math.nan, 1.0, 10), ["start", "nan"]),
    ((0.4, math.inf, 10), ["end", "inf"]),
])
def test_linear_schedule_rejects(args, names):
    with pytest.raises(ValueError) as info:
        bigper.LinearSchedule(*args)
    for part in names:
        assert part in str(info.value)


def test_n_step_is_bounded_so_a_recorded_one_cannot_ask_for_gigabytes():
    from bigper.config import MAX_N_STEP, Config

    with pytest.raises(bigper.InvalidArgumentError, match="n_step"):
        bigper.PrioritizedReplayBuffer(8, {"reward": ((), np.float32)}, n_step=MAX_N_STEP + 1)
    cfg = Config.build(capacity=8, fields={"reward": ((), np.float32)}, n_step=3).to_dict()
    with pytest.raises(bigper.InvalidArgumentError, match="n_step"):
        Config.from_dict(dict(cfg, n_step=2**29))  # (a resigned manifest's n_step: 16 GiB at the first sample)
