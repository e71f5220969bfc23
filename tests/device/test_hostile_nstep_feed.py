"""Hostile tests of the feed's n-step returns (``core/feed.py draw_kernel``'s
windows, ``Block.rows``, ``gather_kernel``/``serve_kernel`` reading
``next_*`` at each window's last slot).

Two oracles: a twin buffer given the same adds, ``twin.sample(B).to_torch("cpu")``
draw for draw (``prefetch=0``), compared byte for byte; and, where a thread
draws ahead, each row against a record of what was added (the ``step``
field names the transition), by the rules of ``docs/guide/semantics.md``."""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bigper  # noqa: E402
from bigper.device.feed import FeedSampler, covered  # noqa: E402
from bigper.device.native import NativeFeed  # noqa: E402
from tests.device.test_feed import thread_calls_a_batch  # noqa: E402
from tests.hook import thread_feed  # noqa: E402

FEEDS = (FeedSampler, NativeFeed)
FSHAPE = (2, 3)  # a frame: pixel [0, 0] and [0, 1] name the step it was made at


def _np(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# -- what was added -----------------------------------------------------------------------------

class Record:
    """Every transition added, by its global id ``g`` (env ``g % K``'s step ``g // K``)."""

    def __init__(self, kw):
        self.kw = kw
        self.K = kw.get("num_envs", 1)
        self.n = kw.get("n_step", 1)
        self.gamma = kw.get("gamma", 0.99)
        self.k = kw.get("frame_stack")
        self.next_of = kw.get("next_of", ("obs",) if "obs" in kw["fields"] else ())
        self.rows = []  # per g: dict of values, or None where valid was False

    def expect(self, g):
        """The row ``sample`` gives for transition ``g`` (the semantics guide's rules)."""
        first = self.rows[g]
        assert first is not None, f"transition {g} was added with valid=False and was sampled"
        powers = self.gamma ** np.arange(self.n, dtype=np.float64)
        r, term, trunc, m, last = 0.0, False, False, 0, g
        for j in range(self.n):
            h = g + j * self.K
            row = self.rows[h]
            assert row is not None, f"window of {g} reached an invalid row {h}"
            r += powers[j] * float(row["reward"])
            m += 1
            last = h
            if row["terminated"]:
                term = True
                break
            if row["truncated"]:
                trunc = True
                break
        rdt = np.dtype(self.kw["fields"]["reward"][1])
        out = {"reward": np.array(r).astype(rdt if rdt.kind == "f" else np.float32),
               "terminated": np.bool_(term), "truncated": np.bool_(trunc),
               "discount": np.float32(0.0 if term else self.gamma ** m)}
        for name in self.kw["fields"]:
            if name != "reward":
                out[name] = first[name]
        for name in self.next_of:
            out[f"next_{name}"] = self.rows[last][f"next_{name}"]
        return out, last


def check_rows(t, rec: Record, capacity):
    """Every row of batch ``t`` (a dict of tensors) is the transition its ``step`` names, exactly."""
    steps = _np(t["step"])
    np.testing.assert_array_equal(_np(t["generations"]), steps)
    np.testing.assert_array_equal(_np(t["indices"]), steps % capacity)
    for i, g in enumerate(steps):
        want, _ = rec.expect(int(g))
        for name, v in want.items():
            got = _np(t[name])[i]
            v = np.asarray(v)
            assert got.dtype == v.dtype and got.shape == v.shape, (name, got.dtype, v.dtype, got.shape, v.shape)
            if v.dtype.kind == "f" and np.isnan(v).any():  # (which NaN: sample's, held bit for bit by the twin)
                assert np.array_equal(np.isnan(got), np.isnan(v)), (name, int(g), got, v)
                continue
            assert got.tobytes() == v.tobytes(), (name, int(g), got, v)


def ahead_rows(a, twin, rec, b, n=3, kind=None):
    """``n`` batches of ``a.sampler(b, prefetch=2)`` (drawn ahead: each row held to the record), then
    the sampler and both buffers closed; ``kind``: the sampler's class it must be."""
    it = a.sampler(b, prefetch=2, device="cpu")
    if kind is not None:
        assert isinstance(it, kind)
    for _ in range(n):
        check_rows(next(it), rec, a.capacity)
    it.close()
    a.close()
    twin.close()


def _reward_values(rng, rdt, size):
    rdt = np.dtype(rdt)
    if rdt.kind == "b":
        return rng.random(size) < 0.5
    if rdt.kind in "iu":
        info = np.iinfo(rdt)
        pick = rng.integers(0, 4, size)
        mid = rng.integers(info.min if rdt.kind == "i" else 0, info.max, size, dtype=rdt, endpoint=True)
        return np.where(pick == 0, info.min, np.where(pick == 1, info.max, np.where(pick == 2, 0, mid))).astype(rdt)
    info = np.finfo(rdt)
    special = np.array([info.max, -info.max, np.inf, -np.inf, np.nan, -0.0, info.tiny, 1e30], dtype=rdt)
    out = (rng.standard_normal(size) * 1e3).astype(rdt)
    hit = rng.random(size) < 0.2
    out[hit] = special[rng.integers(0, len(special), hit.sum())]
    return out


_ENVS: dict = {}


def generate(rng, kw, T, *, ends="random", valid_mode=False, p_end=0.15, start=0):
    """``T`` steps of ``num_envs`` envs for buffer config ``kw``: data for
    ``extend`` (time axis, then env axis where ``num_envs > 1``), ``valid``
    (or None) and the rows in global-id order, for a ``Record``. ``ends``:
    "random", "cycle" (each env's episodes of lengths 1, 2, ..., n + 1 in
    turn, ending terminated and truncated alternately), or "none".
    ``valid_mode``: Gymnasium's NEXT_STEP autoreset (the step after an end is
    ``valid=False``)."""
    K = kw.get("num_envs", 1)
    n = kw.get("n_step", 1)
    k = kw.get("frame_stack")
    fields = kw["fields"]
    next_of = kw.get("next_of", ("obs",) if "obs" in fields else ())
    rdt = fields["reward"][1]
    cols = {name: [] for name in list(fields) + [f"next_{x}" for x in next_of] + ["terminated", "truncated"]}
    valid = np.ones((T, K), bool)
    rows = []
    if id(rng) not in _ENVS:  # (each env's episode goes on across calls with the same generator)
        _ENVS[id(rng)] = (rng, [dict(cur=None, t=0, ep=0, len=1, resetting=False) for _ in range(K)])
    state = _ENVS[id(rng)][1]
    rewards = _reward_values(rng, rdt, (T, K))
    for t in range(T):
        step = {name: [] for name in cols}
        for e in range(K):
            s = state[e]
            g = (start + t) * K + e
            if k and s["cur"] is None:
                s["cur"] = rng.integers(0, 255, (k, *FSHAPE), dtype=np.uint8)
            new = None
            if k:
                new = rng.integers(0, 255, (1, *FSHAPE), dtype=np.uint8)
                new[0, 0, 0], new[0, 0, 1] = g % 251, (g // 251) % 251
            row = {}
            if "obs" in fields:
                row["obs"] = s["cur"].copy() if k else rng.standard_normal(fields["obs"][0]).astype(fields["obs"][1])
                if "obs" in next_of:
                    row["next_obs"] = np.concatenate([s["cur"][1:], new]) if k else \
                        rng.standard_normal(fields["obs"][0]).astype(fields["obs"][1])
            row["step"] = np.int64(g)
            row["reward"] = rewards[t, e]
            if "reward" in next_of:
                row["next_reward"] = _reward_values(rng, rdt, (1,))[0]
            for name, (shape, dt) in fields.items():
                if name in ("obs", "step", "reward"):
                    continue
                row[name] = (rng.standard_normal(shape) * 50).astype(dt)
                if name in next_of:
                    row[f"next_{name}"] = (rng.standard_normal(shape) * 50).astype(dt)
            term = trunc = False
            if valid_mode and s["resetting"]:
                valid[t, e] = False
                s["resetting"] = False
                if k:  # the reset: a fresh stack from here on
                    s["cur"] = rng.integers(0, 255, (k, *FSHAPE), dtype=np.uint8)
                    if "obs" in next_of:
                        row["next_obs"] = s["cur"].copy()
            else:
                s["t"] += 1
                if ends == "random":
                    if rng.random() < p_end:
                        term, trunc = (True, False) if rng.random() < 0.5 else (False, True)
                elif ends == "cycle":
                    if s["t"] >= s["len"]:
                        term, trunc = (True, False) if (s["ep"] + e) % 2 == 0 else (False, True)
                if term or trunc:
                    s["t"], s["ep"] = 0, s["ep"] + 1
                    s["len"] = s["ep"] % (n + 1) + 1
                    if valid_mode:
                        s["resetting"] = True
                    elif k:
                        s["cur"] = rng.integers(0, 255, (k, *FSHAPE), dtype=np.uint8)
                elif k:
                    s["cur"] = row["next_obs"].copy() if "obs" in next_of else np.concatenate([s["cur"][1:], new])
            row["terminated"], row["truncated"] = term, trunc
            for name in cols:
                step[name].append(row[name])
            rows.append(dict(row) if valid[t, e] else None)
        for name in cols:
            cols[name].append(np.stack([np.asarray(v) for v in step[name]]))
    data = {name: np.stack(v) for name, v in cols.items()}
    for name, (shape, dt) in fields.items():
        data[name] = data[name].astype(dt)
        if f"next_{name}" in data:
            data[f"next_{name}"] = data[f"next_{name}"].astype(dt)
    if K == 1:
        data = {name: v[:, 0] for name, v in data.items()}
        valid = valid[:, 0]
    return data, (valid if valid_mode else None), rows


def fields_of(k=None, rdt=np.float32, x=True):
    f = {"step": ((), np.int64), "reward": ((), rdt)}
    if k:
        f["obs"] = ((k, *FSHAPE), np.uint8)
    if x:
        f["x"] = ((2,), np.float32)
    return f


def pair(kw, tmp_path=None):
    bufs = []
    for name in "ab":
        k = dict(kw)
        if k.get("storage") in ("memmap",):
            k["path"] = tmp_path / name
        bufs.append(bigper.PrioritizedReplayBuffer(**k))
    return bufs


def same(got, want):
    """Keys in order, dtypes, shapes and bytes (NaN payloads, signed zeros) of every tensor."""
    assert list(got) == list(want), (list(got), list(want))
    for key in want:
        g, w = _np(got[key]), _np(want[key])
        assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, w.dtype, g.shape, w.shape)
        assert g.tobytes() == w.tobytes(), (key, g, w)


def twin_draws(a, twin, b, draws, rng, rec=None, it=None, update=True):
    """``draws`` batches of the feed against the twin's ``sample`` draw for
    draw, priorities updated alike through each; the trees compared after."""
    it = it if it is not None else a.sampler(b, prefetch=0, device="cpu")
    assert isinstance(it, FEEDS), type(it)
    for _ in range(draws):
        got = next(it)
        want = twin.sample(b).to_torch("cpu")
        same(got, want)
        if rec is not None:
            check_rows(got, rec, a.capacity)
        if update:
            p = rng.random(b) * 10
            a.update_priorities(got, torch.tensor(p))
            twin.update_priorities(want, torch.tensor(p))
    assert a.total_priority == twin.total_priority
    c = a.capacity
    np.testing.assert_array_equal(a.leaves(np.arange(c)), twin.leaves(np.arange(c)))
    return it


def feed_both(a, twin, data, valid):
    for buf in (a, twin):
        buf.extend(data, valid=valid) if valid is not None else buf.extend(data)


# -- windows: episode ends at every position, n 2..7, gamma 0 / 0.5 / 1, 1..4 envs --------------

@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_episode_ends_at_every_position_of_a_window(n):
    for K in (1, 2, 3, 4):
        for gamma in (0.0, 0.5, 1.0):
            kw = dict(capacity=4 * n * K + 3, fields=fields_of(k=None, rdt=np.float64), n_step=n, gamma=gamma,
                      num_envs=K, next_of=("x",), seed=n * 10 + K)
            rng = np.random.default_rng(n * 100 + K)
            rec = Record(kw)
            a, twin = pair(kw)
            data, valid, rows = generate(rng, kw, 3 * n + 4, ends="cycle")
            rec.rows += rows
            feed_both(a, twin, data, valid)
            twin_draws(a, twin, 24, 3, rng, rec)
            a.close()
            twin.close()


@pytest.mark.parametrize("K", [1, 2, 3, 4])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_autoreset_rows_valid_false_never_sampled_nor_read(K, compression):
    """Gymnasium's NEXT_STEP autoreset: the row after each end is ``valid=False``;
    no window reads it and no batch holds it."""
    kw = dict(capacity=97, fields=fields_of(k=3, rdt=np.float32), frame_stack=3, n_step=4, gamma=0.9,
              num_envs=K, next_of=("obs", "x"), seed=K, compression=compression)
    rng = np.random.default_rng(K)
    rec = Record(kw)
    a, twin = pair(kw)
    data, valid, rows = generate(rng, kw, 60 // K + 5, ends="random", valid_mode=True, p_end=0.3)
    assert not valid.all()
    rec.rows += rows
    feed_both(a, twin, data, valid)
    twin_draws(a, twin, 64, 4, rng, rec)
    ahead_rows(a, twin, rec, 64)


# -- capacity wrap ------------------------------------------------------------------------------

@pytest.mark.parametrize("K,n", [(1, 2), (1, 5), (2, 3), (3, 4), (4, 2)])
def test_tiny_ring_wrapping_many_times(K, n):
    """Capacities around n * K (windows longer than the ring hold itself among
    them): adds and draws interleaved while the ring wraps dozens of times."""
    for capacity in sorted({max(K, n * K - K), n * K, n * K + 1, 2 * n * K - 1}):
        kw = dict(capacity=capacity, fields=fields_of(k=None, rdt=np.float32), n_step=n, gamma=0.5, num_envs=K,
                  next_of=("x",), seed=capacity)
        rng = np.random.default_rng(capacity * 7 + K)
        rec = Record(kw)
        a, twin = pair(kw)
        it, b = None, int(rng.integers(1, 9))
        for r in range(25):
            T = int(rng.integers(1, 2 * n + 1))
            data, valid, rows = generate(rng, kw, T, ends="random", p_end=0.25, start=len(rec.rows) // K)
            rec.rows += rows
            feed_both(a, twin, data, valid)
            if not twin._parts.prio.sampleable:
                with pytest.raises(bigper.InvalidArgumentError):
                    twin.sample(3)
                with pytest.raises(bigper.InvalidArgumentError):
                    next(a.sampler(3, prefetch=0, device="cpu"))
                it = None  # (that sampler ended: a new one next time)
                continue
            it = twin_draws(a, twin, b, 2, rng, rec, it=it)  # (one sampler across the adds)
        a.close()
        twin.close()


def _code(g):
    return np.array([g % 251, (g // 251) % 251], dtype=np.uint8)


class Det:
    """Deterministic steps by global id, for writer threads: everything a row
    holds follows from its ``step`` (so a torn row shows)."""

    K, n, k, gamma = 2, 3, 4, 0.5

    @classmethod
    def term(cls, g):
        t, e = divmod(g, cls.K)
        return (t + 3 * e) % 9 == 8

    @classmethod
    def trunc(cls, g):
        t, e = divmod(g, cls.K)
        return (t + 3 * e) % 7 == 6 and not cls.term(g)

    @staticmethod
    def reward(g):
        return np.float32((g % 1000) * 0.25 - 100)

    @staticmethod
    def x(g):
        return np.array([g, -g], dtype=np.float32)

    @staticmethod
    def nx(g):
        return np.array([g + 0.5, 7], dtype=np.float32)

    @classmethod
    def frame(cls, g):
        f = np.zeros(FSHAPE, np.uint8)
        f[0, :2] = _code(g)
        return f

    @classmethod
    def steps(cls, t0, T):
        K, k = cls.K, cls.k
        d = {n: [] for n in ("obs", "next_obs", "step", "reward", "x", "next_x", "terminated", "truncated")}
        for t in range(t0, t0 + T):
            for e in range(K):
                g = t * K + e
                d["obs"].append(np.stack([cls.frame(g - (k - 1 - j) * K) for j in range(k)]))
                d["next_obs"].append(np.stack([cls.frame(g + K - (k - 1 - j) * K) for j in range(k)]))
                d["step"].append(g)
                d["reward"].append(cls.reward(g))
                d["x"].append(cls.x(g))
                d["next_x"].append(cls.nx(g))
                d["terminated"].append(cls.term(g))
                d["truncated"].append(cls.trunc(g))
        return {n: np.array(v).reshape(T, K, *np.shape(v[0])) for n, v in d.items()}

    @classmethod
    def buffer(cls, capacity, tmp=None, **kw):
        store = dict(storage="memmap", path=tmp) if tmp is not None else {}
        fields = {"obs": ((cls.k, *FSHAPE), np.uint8), "step": ((), np.int64), "reward": ((), np.float32),
                  "x": ((2,), np.float32)}
        return bigper.PrioritizedReplayBuffer(capacity=capacity, fields=fields, frame_stack=cls.k, n_step=cls.n,
                                              gamma=cls.gamma, num_envs=cls.K, next_of=("obs", "x"), seed=5,
                                              **store, **kw)

    @classmethod
    def check(cls, t, capacity):
        K, k, n = cls.K, cls.k, cls.n
        steps = _np(t["step"])
        np.testing.assert_array_equal(_np(t["generations"]), steps)
        np.testing.assert_array_equal(_np(t["indices"]), steps % capacity)
        powers = cls.gamma ** np.arange(n, dtype=np.float64)
        for i, g in enumerate(steps.tolist()):
            r, m, last, term, trunc = 0.0, 0, g, False, False
            for j in range(n):
                h = g + j * K
                r += powers[j] * float(cls.reward(h))
                m, last = m + 1, h
                if cls.term(h):
                    term = True
                    break
                if cls.trunc(h):
                    trunc = True
                    break
            assert _np(t["reward"])[i] == np.float32(r), (g, _np(t["reward"])[i], r)
            assert bool(_np(t["terminated"])[i]) == term and bool(_np(t["truncated"])[i]) == trunc, g
            assert _np(t["discount"])[i] == np.float32(0.0 if term else cls.gamma ** m), g
            np.testing.assert_array_equal(_np(t["x"])[i], cls.x(g))
            np.testing.assert_array_equal(_np(t["next_x"])[i], cls.nx(last), err_msg=str(g))
            np.testing.assert_array_equal(_np(t["obs"])[i, :, 0, :2],
                                          np.stack([_code(g - (k - 1 - j) * K) for j in range(k)]), err_msg=str(g))
            np.testing.assert_array_equal(_np(t["next_obs"])[i, :, 0, :2],
                                          np.stack([_code(last + K - (k - 1 - j) * K) for j in range(k)]),
                                          err_msg=str(g))


@pytest.mark.parametrize("how", ["native", "thread", "compressed"])
def test_writes_racing_the_gather_never_tear_an_nstep_batch(tmp_path, how):
    """A writer thread adds while the feed gathers without the lock (the
    native feed's GIL-free thread, FeedSampler's own thread, compressed
    frames): every row's reward, flags, discount, x, next_x (read at the
    window's last slot), obs and next_obs stacks are of one transition."""
    extra = dict(compression="zstd") if how == "compressed" else {}
    capacity = 64
    buf = Det.buffer(capacity, tmp_path / "b" if how == "thread" else None, **extra)
    buf.extend(Det.steps(0, capacity // Det.K))
    stop = threading.Event()
    errors = []

    def writer():
        t = capacity // Det.K
        try:
            while not stop.is_set() and t < 30_000:
                buf.extend(Det.steps(t, 3))
                t += 3
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    it = thread_feed(buf, 32, 2) if how == "thread" else buf.sampler(32, prefetch=2, device="cpu")
    assert isinstance(it, NativeFeed if how == "native" else FeedSampler)
    th = threading.Thread(target=writer)
    th.start()
    try:
        for _ in range(150):
            t = next(it)
            Det.check(t, capacity)
            buf.update_priorities(t, t["weights"].float() + 0.1)
    finally:
        stop.set()
        th.join()
        it.close()
    assert not errors, errors
    buf.close()


# -- reward dtypes ------------------------------------------------------------------------------

REWARDS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_,
           np.float32, np.float64]


@pytest.mark.parametrize("rdt", REWARDS, ids=lambda d: np.dtype(d).name)
def test_reward_dtypes_at_their_limits_bit_for_bit(rdt):
    """Integers at their limits, bools, floats huge, inf, -inf, NaN and -0.0:
    whatever ``sample`` sums, the feed gives bit for bit (and the record's sum)."""
    for gamma in (0.0, 0.5, 1.0):
        kw = dict(capacity=61, fields=fields_of(k=2, rdt=rdt, x=False), frame_stack=2, n_step=4, gamma=gamma,
                  num_envs=2, seed=1)
        rng = np.random.default_rng(int(gamma * 10) + 3)
        rec = Record(kw)
        a, twin = pair(kw)
        assert covered(a._parts, torch.device("cpu")) is None
        data, valid, rows = generate(rng, kw, 40, ends="random", p_end=0.1)
        rec.rows += rows
        feed_both(a, twin, data, valid)
        twin_draws(a, twin, 50, 3, rng, rec)
        ahead_rows(a, twin, rec, 40, kind=NativeFeed)  # drawn ahead (NativeFeed): the record's sums


@pytest.mark.parametrize("rdt", [np.float16, ">f4", ">f8", ">i4", np.longdouble],
                         ids=["float16", "f4be", "f8be", "i4be", "longdouble"])
def test_rewards_numba_cannot_sum_take_the_general_path(rdt):
    """float16, big-endian and extended rewards: ``covered`` says why, and the
    sampler (the general path) still gives the twin's batches."""
    kw = dict(capacity=50, fields={"step": ((), np.int64), "reward": ((), rdt)}, n_step=3, gamma=0.5, seed=2,
              next_of=())
    try:
        a, twin = pair(kw)
    except bigper.InvalidArgumentError as e:  # (refused at construction: nothing to feed)
        assert "reward" in str(e)
        return
    why = covered(a._parts, torch.device("cpu"))
    assert why is not None and "reward" in why or "byte order" in why, why
    rng = np.random.default_rng(0)
    data = {"step": np.arange(30), "reward": (rng.standard_normal(30) * 100).astype(rdt),
            "terminated": np.arange(30) % 7 == 6}
    feed_both(a, twin, data, None)
    it = a.sampler(8, prefetch=0, device="cpu")
    assert not isinstance(it, FEEDS)
    if np.dtype(rdt).itemsize > 8:  # (torch holds no float128: both refuse alike)
        with pytest.raises(bigper.InvalidTypeError):
            twin.sample(8).to_torch("cpu")
        with pytest.raises(bigper.InvalidTypeError):
            next(it)
        a.close()
        twin.close()
        return
    for _ in range(3):
        same(next(it), twin.sample(8).to_torch("cpu"))
    a.close()
    twin.close()


def test_a_reward_of_another_shape_is_refused_at_construction():
    for shape in ((2,), (1,), (1, 1)):
        with pytest.raises(bigper.InvalidArgumentError, match="reward"):
            bigper.PrioritizedReplayBuffer(capacity=10, fields={"reward": (shape, np.float32)}, n_step=2)


# -- frame stacks, successors, storages ---------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("next_of", [("obs",), (), ("obs", "x"), ("x",)], ids=["obs", "none", "obs+x", "x"])
def test_frame_stacks_and_successor_fields(k, next_of):
    kw = dict(capacity=83, fields=fields_of(k=k, rdt=np.float32), frame_stack=k, n_step=3, gamma=0.5, num_envs=2,
              next_of=next_of, seed=k)
    rng = np.random.default_rng(k)
    rec = Record(kw)
    a, twin = pair(kw)
    data, valid, rows = generate(rng, kw, 70, ends="random", p_end=0.2)
    rec.rows += rows
    feed_both(a, twin, data, valid)
    twin_draws(a, twin, 32, 3, rng, rec)
    ahead_rows(a, twin, rec, 32)


@pytest.mark.parametrize("storage", ["memory", "memmap"])
def test_compressed_frames_with_nstep(tmp_path, storage):
    """``compression="zstd"``: FeedSampler (its own thread with prefetch), twin-exact at prefetch 0."""
    kw = dict(capacity=120, fields=fields_of(k=4, rdt=np.float32), frame_stack=4, n_step=5, gamma=0.9, num_envs=3,
              next_of=("obs", "x"), seed=4, compression="zstd", storage=storage)
    rng = np.random.default_rng(9)
    rec = Record(kw)
    a, twin = pair(kw, tmp_path)
    for r in range(4):  # (the ring wraps: frames and windows overwritten)
        data, valid, rows = generate(rng, kw, 30, ends="random", p_end=0.1, start=len(rec.rows) // 3)
        rec.rows += rows
        feed_both(a, twin, data, valid)
        twin_draws(a, twin, 16, 2, rng, rec)
    ahead_rows(a, twin, rec, 16, n=4, kind=FeedSampler)


def test_memmap_storage_twin(tmp_path):
    kw = dict(capacity=50, fields=fields_of(k=2, rdt=np.int16), frame_stack=2, n_step=6, gamma=1.0, num_envs=1,
              next_of=("obs", "x"), seed=4, storage="memmap")
    rng = np.random.default_rng(5)
    rec = Record(kw)
    a, twin = pair(kw, tmp_path)
    for _ in range(3):
        data, valid, rows = generate(rng, kw, 40, ends="cycle", start=len(rec.rows))
        rec.rows += rows
        feed_both(a, twin, data, valid)
        twin_draws(a, twin, 20, 2, rng, rec)
    a.close()
    twin.close()


# -- state between batches ----------------------------------------------------------------------

def _kw_state(**extra):
    return dict(capacity=70, fields=fields_of(k=3, rdt=np.float32), frame_stack=3, n_step=3, gamma=0.9,
                num_envs=2, next_of=("obs", "x"), seed=11, beta=bigper.LinearSchedule(0.3, 1.0, 9), **extra)


def test_load_state_between_batches():
    """``load_state`` under a running feed: its next batch is drawn from the
    restored state (the sources made anew), as the twin's ``sample`` is."""
    kw = _kw_state()
    rng = np.random.default_rng(3)
    a, twin = pair(kw)
    data, valid, _ = generate(rng, kw, 50, ends="random")
    feed_both(a, twin, data, valid)
    saved = twin.state_dict()
    saved = (dict(saved[0]), {n: np.array(v) for n, v in saved[1].items()})
    it = twin_draws(a, twin, 12, 3, rng)
    data, valid, _ = generate(rng, kw, 20, ends="random", start=50)  # (writes the state will not know)
    feed_both(a, twin, data, valid)
    it = twin_draws(a, twin, 12, 2, rng, it=it)
    a.load_state(*saved)
    twin.load_state(*saved)
    twin_draws(a, twin, 12, 3, rng, it=it)
    a.close()
    twin.close()


def test_save_load_and_resume_between_batches(tmp_path):
    """A feed's batches, ``save``, ``load`` (and a ``Snapshots`` load): the
    resumed buffer's feed draws what the run that never stopped draws next."""
    kw = _kw_state(storage="memmap")
    rng = np.random.default_rng(4)
    a, twin = pair(kw, tmp_path)
    data, valid, _ = generate(rng, kw, 60, ends="random")
    feed_both(a, twin, data, valid)
    it = twin_draws(a, twin, 10, 3, rng)
    a.save(tmp_path / "snap")
    snaps = bigper.Snapshots(tmp_path / "snaps", keep=2)
    snaps.save(a)
    it.close()
    a.close()
    for i, b in enumerate((bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "r1"),
                           snaps.load_latest(path=tmp_path / "r2"))):
        sub = np.random.default_rng(7)
        mirror = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / f"m{i}")
        twin_draws(b, mirror, 10, 3, sub)
        b.close()
        mirror.close()
    # the uninterrupted twin: the resumed draw equals its next draw (key by key: a snapshot keeps
    # the fields' order sorted by name, ``sample``'s of a loaded buffer as well as the feed's)
    b = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "r3", continue_episodes=True)
    got, want = next(b.sampler(10, prefetch=0, device="cpu")), twin.sample(10).to_torch("cpu")
    same({k: got[k] for k in sorted(got)}, {k: want[k] for k in sorted(want)})
    b.close()
    twin.close()


def test_reopen_with_mode_resume_between_batches(tmp_path):
    kw = _kw_state(storage="memmap")
    rng = np.random.default_rng(6)
    a, twin = pair(kw, tmp_path)
    data, valid, _ = generate(rng, kw, 60, ends="random")
    feed_both(a, twin, data, valid)
    it = twin_draws(a, twin, 10, 2, rng)
    it.close()
    a.close()
    # (episodes open at the close go on: the twin's do)
    a = bigper.PrioritizedReplayBuffer(**dict(kw, path=tmp_path / "a"), mode="resume", continue_episodes=True)
    twin_draws(a, twin, 10, 3, rng)
    data, valid, _ = generate(rng, kw, 25, ends="random", start=60)
    feed_both(a, twin, data, valid)
    twin_draws(a, twin, 10, 3, rng)
    a.close()
    twin.close()


@pytest.mark.parametrize("how", ["native", "thread"])
def test_close_from_another_thread_while_the_feed_draws(how):
    for rep in range(3):
        buf = Det.buffer(64)
        buf.extend(Det.steps(0, 40))
        it = thread_feed(buf, 16, 2) if how == "thread" else buf.sampler(16, prefetch=2, device="cpu")
        closer = threading.Timer(0.01 * (rep + 1), buf.close)
        closer.start()
        t0 = time.monotonic()
        with pytest.raises(bigper.BufferClosedError):
            while time.monotonic() - t0 < 20:
                Det.check(next(it), 64)
        closer.join()
        with pytest.raises(bigper.BufferClosedError):
            next(it)


# -- draws: beta, B, weight_norm, priorities -----------------------------------------------------

@pytest.mark.parametrize("b", [1, 7, 200])
@pytest.mark.parametrize("weight_norm", ["global", "batch"])
def test_batch_sizes_beta_schedules_and_weight_norms(b, weight_norm):
    """B=1 and B past the live transitions, a beta schedule advancing, both
    weight norms; priority updates through the feed's batches land on the twin's slots."""
    kw = dict(capacity=90, fields=fields_of(k=2, rdt=np.float64), frame_stack=2, n_step=4, gamma=0.99, num_envs=3,
              next_of=("obs", "x"), seed=b, weight_norm=weight_norm, beta=bigper.LinearSchedule(0.1, 1.0, 5),
              alpha=0.7)
    rng = np.random.default_rng(b)
    rec = Record(kw)
    a, twin = pair(kw)
    data, valid, rows = generate(rng, kw, 12, ends="random", p_end=0.2)
    rec.rows += rows
    feed_both(a, twin, data, valid)
    twin_draws(a, twin, b, 8, rng, rec)
    a.close()
    twin.close()


def test_priority_updates_from_prefetched_batches_land_on_their_slots():
    """Batches the native feed drew ahead (prefetch 3), updated in turn: the
    tree equals a twin's given the same (indices, priorities) by raw indices."""
    kw = dict(capacity=100, fields=fields_of(k=2, rdt=np.float32), frame_stack=2, n_step=3, gamma=0.5, num_envs=2,
              next_of=("obs", "x"), seed=8)
    rng = np.random.default_rng(8)
    rec = Record(kw)
    a, twin = pair(kw)
    data, valid, rows = generate(rng, kw, 45, ends="random")
    rec.rows += rows
    feed_both(a, twin, data, valid)
    it = a.sampler(24, prefetch=3, device="cpu")
    for _ in range(10):
        t = next(it)
        check_rows(t, rec, a.capacity)
        p = rng.random(24) * 5
        a.update_priorities(t, torch.tensor(p))
        twin.update_priorities(_np(t["indices"]), p)
    it.close()
    assert a.total_priority == twin.total_priority
    np.testing.assert_array_equal(a.leaves(np.arange(100)), twin.leaves(np.arange(100)))
    a.close()
    twin.close()


def test_thread_python_calls_a_batch_as_with_one_step():
    """FeedSampler's own thread: n-step windows add no Python calls a batch."""
    counts = {}
    for n in (1, 3):
        kw = dict(capacity=400, fields=fields_of(k=4, rdt=np.float32), frame_stack=4, n_step=n, gamma=0.9,
                  next_of=("obs", "x"), seed=0)
        buf = bigper.PrioritizedReplayBuffer(**kw)
        data, _, _ = generate(np.random.default_rng(0), kw, 400, ends="random", p_end=0.05)
        buf.extend(data)
        counts[n] = (thread_calls_a_batch(lambda: thread_feed(buf, 32, 1)),
                     thread_calls_a_batch(lambda: buf.sampler(32, prefetch=1, device="cpu")))
        buf.close()
    assert counts[3][0] <= counts[1][0] + 1, counts
    assert counts[3][1] <= counts[1][1] + 1, counts
    assert counts[3][0] <= 12, counts


# -- odd corners --------------------------------------------------------------------------------

def test_reward_and_obs_without_frames_as_successor_fields():
    """``next_of=("reward", "obs")`` with ``obs`` a plain field: ``next_reward``
    and ``next_obs`` are read at each window's last slot; ``reward`` is the sum."""
    fields = {"step": ((), np.int64), "reward": ((), np.float32), "obs": ((3,), np.float64)}
    kw = dict(capacity=41, fields=fields, n_step=4, gamma=0.5, num_envs=2, next_of=("reward", "obs"), seed=3)
    rng = np.random.default_rng(3)
    a, twin = pair(kw)
    data, valid, rows = generate(rng, kw, 30, ends="random", p_end=0.2)
    rec = Record(kw)
    rec.rows += rows
    feed_both(a, twin, data, valid)
    twin_draws(a, twin, 24, 3, rng, rec)
    ahead_rows(a, twin, rec, 24)


def test_terminated_and_truncated_at_once_and_invalid_first_steps():
    """A step both terminated and truncated (terminated wins: discount 0), and
    envs whose first rows are ``valid=False`` (before their first step)."""
    kw = dict(capacity=60, fields=fields_of(k=2, rdt=np.float32), frame_stack=2, n_step=3, gamma=0.5, num_envs=3,
              next_of=("obs", "x"), seed=1)
    rng = np.random.default_rng(1)
    a, twin = pair(kw)
    data, _, rows = generate(rng, kw, 20, ends="random", p_end=0.3)
    valid = np.ones((20, 3), bool)
    valid[:2, 1] = False  # env 1 starts late
    valid[0, 2] = False
    both = rng.random((20, 3)) < 0.2
    both[:2] = False
    data["terminated"] = data["terminated"] | both
    data["truncated"] = data["truncated"] | both
    rec = Record(kw)
    for t in range(20):
        for e in range(3):
            row = rows[t * 3 + e]
            if not valid[t, e]:
                rows[t * 3 + e] = None
            else:
                row["terminated"], row["truncated"] = data["terminated"][t, e], data["truncated"][t, e]
    rec.rows += rows
    feed_both(a, twin, data, valid)
    it = twin_draws(a, twin, 40, 3, rng, rec)
    seen = set()
    for _ in range(5):
        t = next(it)
        check_rows(t, rec, a.capacity)
        seen |= set(_np(t["step"]).tolist())
    assert not {0 * 3 + 1, 1 * 3 + 1, 2}.intersection(seen)
    it.close()
    a.close()
    twin.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_sampler_beta_and_unstratified_overrides(prefetch):
    kw = dict(capacity=80, fields=fields_of(k=None, rdt=np.int32), n_step=5, gamma=0.99, num_envs=2, next_of=("x",),
              seed=9, beta=bigper.LinearSchedule(0.2, 1.0, 4))
    rng = np.random.default_rng(9)
    a, twin = pair(kw)
    data, valid, rows = generate(rng, kw, 40, ends="cycle")
    rec = Record(kw)
    rec.rows += rows
    feed_both(a, twin, data, valid)
    it = a.sampler(16, prefetch=prefetch, device="cpu", beta=0.7, stratified=False)
    assert isinstance(it, FEEDS)
    for _ in range(4):
        got = next(it)
        want = twin.sample(16, beta=0.7, stratified=False).to_torch("cpu")
        same(got, want)
        check_rows(got, rec, a.capacity)
    it.close()
    a.close()
    twin.close()


@pytest.mark.parametrize("how", ["native", "thread"])
def test_close_of_a_disk_buffer_while_its_feed_gathers(tmp_path, how):
    """``close`` from another thread unmaps the storage the feed reads
    (memmap): the learner gets ``BufferClosedError``, never a crash."""
    for rep in range(3):
        buf = Det.buffer(64, tmp_path / f"b{rep}")
        buf.extend(Det.steps(0, 40))
        it = thread_feed(buf, 16, 3) if how == "thread" else buf.sampler(16, prefetch=3, device="cpu")
        stop = threading.Event()

        def writer(buf=buf):
            t = 40
            while not stop.is_set():
                try:
                    buf.extend(Det.steps(t, 2))
                except bigper.BufferClosedError:
                    return
                t += 2

        th = threading.Thread(target=writer)
        th.start()
        closer = threading.Timer(0.02 * (rep + 1), buf.close)
        closer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(bigper.BufferClosedError):
                while time.monotonic() - t0 < 20:
                    Det.check(next(it), 64)
        finally:
            stop.set()
            closer.join()
            th.join()


def test_two_feeds_and_sample_on_one_buffer_with_a_writer():
    """Two n-step feeds (native and threaded) and plain ``sample`` calls on one
    buffer, a writer thread adding: every row exact in all three."""
    capacity = 48
    buf = Det.buffer(capacity)
    buf.extend(Det.steps(0, 24))
    stop = threading.Event()
    errors = []

    def writer():
        t = 24
        try:
            while not stop.is_set() and t < 20_000:
                buf.extend(Det.steps(t, 1))
                t += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=writer)
    th.start()
    n1, n2 = buf.sampler(8, prefetch=2, device="cpu"), thread_feed(buf, 5, 2)
    try:
        for _ in range(100):
            Det.check(next(n1), capacity)
            Det.check(next(n2), capacity)
            Det.check(buf.sample(4).to_torch("cpu"), capacity)
    finally:
        stop.set()
        th.join()
        n1.close()
        n2.close()
    assert not errors, errors
    buf.close()


@pytest.mark.parametrize("how", ["native", "thread"])
def test_load_state_under_batches_in_flight(how):
    """Batches drawn ahead (prefetch 3), then ``load_state`` (a restore: the
    sources made anew, the thread restarted) and writes: every later row exact."""
    capacity = 60
    buf = Det.buffer(capacity)
    buf.extend(Det.steps(0, 30))
    it = thread_feed(buf, 12, 3) if how == "thread" else buf.sampler(12, prefetch=3, device="cpu")
    t = 30
    for r in range(12):
        buf.extend(Det.steps(t, 1))
        t += 1
        Det.check(next(it), capacity)
        meta, arrays = buf.state_dict()  # (the state as it is: a restore all the same)
        buf.load_state(dict(meta), {n: np.array(v) for n, v in arrays.items()})
        for _ in range(2):
            Det.check(next(it), capacity)
    it.close()
    buf.close()


def fuzz_case(seed, tmp_path):
    """One random config and a random run of adds, feed draws against the twin's
    ``sample``, priority updates, restores and new samplers; every row against the record."""
    rng = np.random.default_rng(seed)
    K = int(rng.integers(1, 5))
    n = int(rng.integers(2, 8))
    k = [None, 1, 2, 3, 4][int(rng.integers(0, 5))]
    rdt = REWARDS[int(rng.integers(0, len(REWARDS)))]
    fields = fields_of(k=k, rdt=rdt, x=bool(rng.integers(0, 2)))
    opts = [()] + ([("obs",)] if k else []) + ([("x",), ("obs", "x") if k else ("x",)] if "x" in fields else [])
    next_of = opts[int(rng.integers(0, len(opts)))]
    capacity = int(rng.integers(max(K, 2), 6 * n * K + 2))
    kw = dict(capacity=capacity, fields=fields, frame_stack=k, n_step=n, gamma=[0.0, 0.5, 1.0, 0.99][seed % 4],
              num_envs=K, next_of=next_of, seed=seed, weight_norm=["global", "batch"][seed % 2],
              alpha=float(rng.choice([0.0, 0.6, 1.0])), storage=["memory", "memmap"][int(rng.integers(0, 2))])
    if k and rng.random() < 0.3:
        kw["compression"] = "zstd"
    if rng.random() < 0.5:
        kw["beta"] = bigper.LinearSchedule(0.2, 1.0, int(rng.integers(1, 10)))
    try:
        a, twin = pair(kw, tmp_path)
    except bigper.InvalidArgumentError:  # (a ring too small for the frames the config needs: refused alike)
        with pytest.raises(bigper.InvalidArgumentError):
            bigper.PrioritizedReplayBuffer(**dict(kw, storage="memory"))
        return
    rec = Record(kw)
    b = int(rng.integers(1, 3 * capacity))
    it = None
    valid_mode = bool(rng.integers(0, 2))
    for step in range(int(rng.integers(3, 12))):
        T = int(rng.integers(1, 3 * n))
        data, valid, rows = generate(rng, kw, T, ends="random", p_end=float(rng.choice([0.05, 0.3])),
                                     valid_mode=valid_mode, start=len(rec.rows) // K)
        rec.rows += rows
        feed_both(a, twin, data, valid)
        if not twin._parts.prio.sampleable:
            with pytest.raises(bigper.InvalidArgumentError):
                twin.sample(b)
            with pytest.raises(bigper.InvalidArgumentError):
                next(a.sampler(b, prefetch=0, device="cpu"))
            it = None
            continue
        if it is None or rng.random() < 0.2:
            it = a.sampler(b, prefetch=0, device="cpu")
        it = twin_draws(a, twin, b, int(rng.integers(1, 4)), rng, rec, it=it)
        if rng.random() < 0.2:
            meta, arrays = twin.state_dict()
            state = (dict(meta), {name: np.array(v) for name, v in arrays.items()})
            a.load_state(*state)
            twin.load_state(*state)
    ahead = a.sampler(b, prefetch=2, device="cpu") if twin._parts.prio.sampleable else None
    for _ in range(2 if ahead is not None else 0):
        check_rows(next(ahead), rec, capacity)
    a.close()
    twin.close()


@pytest.mark.parametrize("seed", range(16))
def test_fuzzed_runs_against_the_twin_and_the_record(tmp_path, seed):
    fuzz_case(seed, tmp_path)


@pytest.mark.parametrize("how", ["native", "thread"])
def test_save_under_batches_drawn_ahead_resumes_with_the_next_draw(tmp_path, how):
    """A snapshot taken while batches are drawn ahead: the resumed buffer's
    first batch is the one the running sampler draws after them."""
    kw = _kw_state(storage="memmap")
    rng = np.random.default_rng(12)
    a = bigper.PrioritizedReplayBuffer(**dict(kw, path=tmp_path / "a"))
    data, valid, _ = generate(rng, kw, 60, ends="random")
    a.extend(data)
    it = thread_feed(a, 9, 2) if how == "thread" else a.sampler(9, prefetch=2, device="cpu")
    for _ in range(3):
        next(it)
    time.sleep(0.2)  # (a thread of its own draws ahead on its own)
    a.save(tmp_path / "snap")
    later = [next(it) for _ in range(8)]
    b = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "b", continue_episodes=True)
    drawn = b.state_dict()[0]["beta_step"]  # (the sampler's draws before the save: 3 taken, the rest ahead)
    assert 4 <= drawn <= 3 + 6, drawn
    first = next(b.sampler(9, prefetch=0, device="cpu"))
    want = later[drawn - 3]
    same({key: first[key] for key in sorted(first)}, {key: want[key] for key in sorted(want)})
    it.close()
    a.close()
    b.close()


@pytest.mark.parametrize("prefetch", [2, 3, 5])
def test_batches_redrawn_after_a_write_keep_their_own_uniforms(prefetch):
    """Batches drawn ahead, then a write that overwrites every slot: each is
    drawn again under the lock with its own uniforms and beta (as a draw made
    after the write), so the run equals a twin's ``sample`` calls with the
    write between them; never two batches of the same uniforms. (The native
    feed redrew each with the uniforms of the newest draw: two consecutive
    batches came out identical.) The native feed checks a batch when it hands
    it out; FeedSampler's thread checks it right after its gather, and hands
    out what it drew before a later write (rows as of their draw), so no twin
    of this shape exists for it."""
    capacity = 64
    a, twin = Det.buffer(capacity, beta=bigper.LinearSchedule(0.1, 1.0, 6)), \
        Det.buffer(capacity, beta=bigper.LinearSchedule(0.1, 1.0, 6))
    for buf in (a, twin):
        buf.extend(Det.steps(0, 32))
    it = a.sampler(16, prefetch=prefetch, device="cpu")
    assert isinstance(it, NativeFeed)
    got = [{k: v.clone() for k, v in next(it).items()} for _ in range(2)]
    want = [twin.sample(16).to_torch("cpu") for _ in range(2)]
    for buf in (a, twin):
        buf.extend(Det.steps(32, 32))  # every slot overwritten: no batch drawn before is intact
    for _ in range(prefetch + 3):
        got.append({k: v.clone() for k, v in next(it).items()})
        want.append(twin.sample(16).to_torch("cpu"))
    for g, w in zip(got, want):
        Det.check(g, capacity)
        same(g, w)
    it.close()
    a.close()
    twin.close()


def test_after_a_load_into_a_copied_run_a_new_episode_feeds_as_sample_does(tmp_path):
    """As users resume: a run's snapshot loaded into a new folder (a forked run;
    the original untouched), the open episodes ended by the load, then a new
    episode added (the environment after a crash is new): the n-step feed gives
    what a twin loaded and fed alike gives with ``sample``, draw for draw."""
    from tests._hostile_snapshot_cases import fingerprint

    run = Det.buffer(64, tmp_path / "run")
    run.extend(Det.steps(0, 30))
    run.save(tmp_path / "snap")
    run.close()
    before = fingerprint(tmp_path / "run", tmp_path / "snap")
    a = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "fork")
    twin = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "twin")
    fresh = Det.steps(100, 12)  # a new episode: steps never seen before, from its first frame
    for buf in (a, twin):
        buf.extend(fresh)
    it = a.sampler(24, prefetch=0, device="cpu")
    rng = np.random.default_rng(4)
    for _ in range(5):
        got, want = next(it), twin.sample(24).to_torch("cpu")
        assert list(got) == list(want)
        for key in want:
            np.testing.assert_array_equal(_np(got[key]), _np(want[key]), err_msg=key)
        p = torch.tensor(rng.random(24) * 4 + 0.1)
        a.update_priorities(got, p)
        twin.update_priorities(want, p)
    it.close()
    np.testing.assert_array_equal(a.leaves(np.arange(64)), twin.leaves(np.arange(64)))
    a.close()
    twin.close()
    assert fingerprint(tmp_path / "run", tmp_path / "snap") == before
