"""The fused paths equal the general ones, bit for bit.

Two buffers get the same random sequence of calls (adds, vector-env adds,
extends with and without priorities or ``valid``, samples, priority updates
by batch and by index, bulk updates): one on the fused paths (frames and
references written in place by one kernel, small fields straight into the
storage's arrays, draws into caller-made arrays, one-kernel batch
bookkeeping, one-kernel checked updates, threaded rebuilds and gathers), the
other with ``_fused``/``fused``/``threaded`` off (staged storage writes, one
numpy call a step, keys then the update kernel, one-thread rebuilds). After
every call their state arrays, counters, storage arrays and returned batches
must be identical, and a call that fails must fail the same way in both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
from bigper.frames import store as FR
from bigper.prioritization import tree as TR
from bigper.errors import BigperError

FRAME = (3, 4)


def general(buf):
    buf._fused = False
    prio = buf.prioritization
    if hasattr(prio, "fused"):
        prio.fused = False
        prio.tree.threaded = False
    return buf


def make(cfg, path=None):
    fields = {"obs": ((cfg["k"], *FRAME) if cfg["k"] else FRAME, cfg.get("fdt", np.uint8)), "action": ((), np.int64),
              "reward": ((), np.float32)}
    kw = dict(frame_stack=cfg["k"] or None, n_step=cfg["n"], num_envs=cfg["envs"], seed=cfg["seed"],
              alpha=0.7, beta=0.5, weight_norm=cfg["norm"], prioritization=cfg["prio"])
    if cfg["storage"] == "memmap":
        kw.update(storage="memmap", path=path)
    if cfg.get("zstd") and cfg["k"]:  # compressed frames: the fused path's one call (FrameStore.logged_args)
        kw.update(compression="zstd")
    return bigper.PrioritizedReplayBuffer(cfg["cap"], fields, **kw)


def step_data(cfg, rng, lead):
    k = cfg["k"]
    shape = (k, *FRAME) if k else FRAME
    # Few distinct frame values, so stacks continue and repeat (dedup is exercised).
    fdt = cfg.get("fdt", np.uint8)  # float32 frames: 48 bytes, compared as 8-byte words; uint8: 12, bytes
    base = rng.integers(0, 3, (*lead, *shape)).astype(fdt)
    nxt = np.roll(base, -1, axis=len(lead)) if k else rng.integers(0, 3, (*lead, *shape)).astype(fdt)
    if k and rng.random() < 0.7:
        nxt[..., -1, :, :] = rng.integers(0, 3, (*lead, *FRAME))
    if rng.random() < 0.2:  # a strided view (a slice of a wider array), not C-contiguous
        base = np.repeat(base, 2, axis=-1)[..., ::2]
    return {"obs": base, "next_obs": nxt, "action": rng.integers(0, 5, lead).astype(np.int64),
            "reward": rng.standard_normal(lead).astype(np.float32),
            "terminated": rng.random(lead) < 0.15, "truncated": rng.random(lead) < 0.05}


def same_state(a, b):
    ma, aa = a.state_dict()
    mb, ab = b.state_dict()
    assert repr(ma) == repr(mb)
    assert aa.keys() == ab.keys()
    for key in aa:
        assert np.array_equal(np.asarray(aa[key]), np.asarray(ab[key])), key
    sa, sb = a.storage, b.storage
    for name, arr in (sa.arrays or {}).items():
        assert np.array_equal(arr, sb.arrays[name]), name
    assert a.total_priority == b.total_priority


def same_batch(x, y):
    for attr in ("indices", "weights", "probabilities", "generations"):
        assert np.array_equal(getattr(x, attr), getattr(y, attr)), attr
    assert x.keys() == y.keys()
    for key in x:
        assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), key


def both(fa, fb):
    """Run a call on both buffers; both succeed or both fail with the same error."""
    ra = rb = ea = eb = None
    try:
        ra = fa()
    except BigperError as e:
        ea = e
    try:
        rb = fb()
    except BigperError as e:
        eb = e
    assert (ea is None) == (eb is None), (ea, eb)
    if ea is not None:
        assert type(ea) is type(eb) and str(ea) == str(eb)
    return ra, rb


configs = st.fixed_dictionaries({
    "k": st.sampled_from([0, 2, 4]),
    "n": st.sampled_from([1, 1, 3]),
    "envs": st.sampled_from([1, 1, 2]),
    "cap": st.integers(1, 40),
    "seed": st.integers(0, 3),
    "norm": st.sampled_from(["global", "batch"]),
    "prio": st.sampled_from(["proportional", "proportional", "rank"]),
    "storage": st.sampled_from(["memory", "memory", "memmap"]),
    "fdt": st.sampled_from([np.uint8, np.uint8, np.float32]),
    "zstd": st.sampled_from([False, False, True]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=configs, ops=st.lists(st.integers(0, 10_000), min_size=5, max_size=30))
def test_random_call_sequences_match_bit_for_bit(tmp_path_factory, cfg, ops):
    root = tmp_path_factory.mktemp("fused")
    a = make(cfg, root / "a")
    b = general(make(cfg, root / "b"))
    rng = np.random.default_rng(cfg["seed"] + 17)
    last = None
    lead1 = (cfg["envs"],) if cfg["envs"] > 1 else ()
    try:
        for op in ops:
            kind = op % 6
            if kind in (0, 1):  # add one step (of every env)
                d = step_data(cfg, rng, lead1)
                pr = rng.random(lead1) * 3 if op % 5 == 0 else None
                both(lambda: a.add(priorities=pr, **d), lambda: b.add(priorities=pr, **d))
            elif kind == 2:  # extend, sometimes past the capacity, sometimes with valid=False rows
                m = int(rng.integers(1, 2 * cfg["cap"] + 3))
                lead = (m, cfg["envs"]) if cfg["envs"] > 1 else (m,)
                d = step_data(cfg, rng, lead)
                pr = rng.random(lead) * 2 if op % 3 == 0 else None
                valid = None
                if op % 4 == 1:
                    ended = d["terminated"] | d["truncated"]
                    valid = np.ones(lead, bool)
                    # a placeholder may follow an episode end of its env
                    valid[1:] = ~(ended[:-1] & (rng.random(ended[:-1].shape) < 0.5))
                both(lambda: a.extend(d, priorities=pr, valid=valid),
                     lambda: b.extend(d, priorities=pr, valid=valid))
            elif kind == 3:  # sample
                bs = int(rng.integers(1, 9))
                beta = None if op % 2 else float(rng.random())
                strat = bool(op % 3)
                x, y = both(lambda: a.sample(bs, beta=beta, stratified=strat),
                            lambda: b.sample(bs, beta=beta, stratified=strat))
                if x is not None:
                    same_batch(x, y)
                    last = (x, y)
            elif kind == 4 and last is not None:  # update by the batch (stale slots skipped)
                td = rng.random(last[0].size) * 4
                if op % 7 == 0:
                    td[0] = np.nan
                both(lambda: a.update_priorities(last[0], td), lambda: b.update_priorities(last[1], td))
            elif kind == 5:  # update by raw indices, some out of range or never written
                m = int(rng.integers(1, 12))
                idx = rng.integers(-1 if op % 9 == 0 else 0, cfg["cap"], m)
                p = rng.random(m) * 5
                both(lambda: a.update_priorities(idx, p), lambda: b.update_priorities(idx, p))
            same_state(a, b)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("prio", ["proportional", "rank"])
def test_bulk_updates_and_threaded_rebuilds_match(monkeypatch, prio):
    """Updates over most of the slots (the O(N) rebuild path), split over 4
    threads with small chunks so the ranges really run in the pool."""
    monkeypatch.setenv("BIGPER_THREADS", "4")
    monkeypatch.setattr(TR, "_REBUILD_CHUNK", 8)
    cfg = {"k": 0, "n": 1, "envs": 1, "cap": 5000, "seed": 1, "norm": "global", "prio": prio,
           "storage": "memory"}
    a, b = make(cfg), general(make(cfg))
    rng = np.random.default_rng(0)
    d = step_data(cfg, rng, (6000,))
    a.extend(d)
    b.extend(d)
    for r in range(4):
        idx = rng.permutation(5000)[:4500] if r % 2 else np.arange(5000)
        p = rng.random(idx.shape[0]) * 10
        a.update_priorities(idx, p)
        b.update_priorities(idx, p)
        same_state(a, b)
        same_batch(a.sample(64), b.sample(64))
    pr = rng.random(6000)  # a bulk insert with priorities: the rebuild path of insert
    a.extend(d, priorities=pr)
    b.extend(d, priorities=pr)
    same_state(a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), cap=st.integers(8, 300), n_step=st.sampled_from([1, 3]),
       alpha=st.sampled_from([0.7, 1.6]), fill=st.floats(0.3, 2.5), rounds=st.integers(1, 6))
def test_bulk_updates_equal_the_in_order_kernel(monkeypatch, seed, cap, n_step, alpha, fill, rounds):
    """The bulk path (one threaded scan, then the writes last row first and a
    rebuild; prioritization/_bulk.py) against the general path, made to run at
    small sizes: duplicates, stale batches, n-step pending slots, dead and
    never-written slots, out-of-range indices, bad priorities and keys above
    the cap. Same state after every call, same error for every refusal."""
    from bigper.prioritization import proportional as PR

    monkeypatch.setenv("BIGPER_THREADS", "4")
    monkeypatch.setattr(PR, "_BULK", 4)
    monkeypatch.setattr(PR, "_POW_CHUNK", 8)
    monkeypatch.setattr(PR, "_REBUILD_MIN", 0)
    fields = {"obs": ((2,), np.float32), "reward": ((), np.float32)}

    def new():
        return bigper.PrioritizedReplayBuffer(cap, fields, n_step=n_step, alpha=alpha, seed=3)

    a, b = new(), general(new())
    rng = np.random.default_rng(seed)
    m = max(1, int(cap * fill))
    term = rng.random(m) < 0.1
    valid = np.ones(m, bool)
    valid[1:] = ~(term[:-1] & (rng.random(m - 1) < 0.5))  # a few dead rows, each after an episode end
    d = {"obs": rng.standard_normal((m, 2)).astype(np.float32), "next_obs": np.zeros((m, 2), np.float32),
         "reward": rng.standard_normal(m).astype(np.float32), "terminated": term}
    both(lambda: a.extend(d, valid=valid), lambda: b.extend(d, valid=valid))
    for r in range(rounds):
        kind = rng.integers(0, 3)
        if kind == 0 and a.prioritization.sampleable:  # by the batch, stale after more adds
            size = int(rng.integers(5, 3 * cap))
            x, y = a.sample(size), b.sample(size)
            same_batch(x, y)
            k = int(rng.integers(0, cap))
            e = {"obs": np.ones((k, 2), np.float32), "next_obs": np.ones((k, 2), np.float32),
                 "reward": np.ones(k, np.float32)}
            if k:
                both(lambda: a.extend(e), lambda: b.extend(e))
            td = rng.random(x.size) * 3
            both(lambda: a.update_priorities(x, td), lambda: b.update_priorities(y, td))
        else:  # by raw indices: duplicates, sometimes bad ones
            n = int(rng.integers(5, 3 * cap))
            hi = cap + (2 if rng.random() < 0.2 else 0)
            idx = rng.integers(-1 if rng.random() < 0.1 else 0, hi, n)
            p = rng.random(n) * 10
            if rng.random() < 0.2:
                p[rng.integers(0, n)] = rng.choice([np.nan, np.inf, -1.0])
            if rng.random() < 0.2:
                p[rng.integers(0, n)] = 1e300  # with alpha 1.6 a key above the cap
            both(lambda: a.update_priorities(idx, p), lambda: b.update_priorities(idx, p))
        same_state(a, b)


def test_threaded_keys_and_gathers_equal_one_thread(monkeypatch):
    from bigper.prioritization.proportional import Proportional

    rng = np.random.default_rng(3)
    p = rng.random(300_000) * 100
    p[::7] = 0.0
    monkeypatch.setenv("BIGPER_THREADS", "1")
    one = Proportional(10, alpha=0.6, eps=1e-6, max_priority=50.0, weight_norm="global").keys(p)
    monkeypatch.setenv("BIGPER_THREADS", "5")
    many = Proportional(10, alpha=0.6, eps=1e-6, max_priority=50.0, weight_norm="global").keys(p)
    assert np.array_equal(one, many)
    # The definition, one libm pow a value (numpy's SIMD power may differ in the last bit on
    # AVX-512 machines; every key bigper makes comes from the one scalar pow, whatever the size).
    assert np.array_equal(one, [math.pow(min(x, 50.0) + 1e-6, 0.6) for x in p])
    src = rng.integers(0, 256, (1000, 7, 9), dtype=np.uint8)
    rows = rng.integers(0, 1000, 700)
    out = np.empty((700, 7, 9), np.uint8)
    monkeypatch.setattr(FR, "GATHER_MIN_THREADS", 1)
    monkeypatch.setattr(FR, "GATHER_CHUNK", 16)
    FR._take_rows(src, rows, out)
    assert np.array_equal(out, src[rows])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=configs, which=st.sets(st.sampled_from(["obs", "next_obs", "action", "reward", "terminated",
                                                     "truncated", "discount"])), bs=st.integers(1, 9))
def test_sample_into_out_arrays_equals_sample(tmp_path_factory, cfg, which, bs):
    root = tmp_path_factory.mktemp("out")
    a, b = make(cfg, root / "a"), make(cfg, root / "b")
    rng = np.random.default_rng(cfg["seed"])
    lead = (cfg["cap"] + 5, cfg["envs"]) if cfg["envs"] > 1 else (cfg["cap"] + 5,)
    d = step_data(cfg, rng, lead)
    try:
        a.extend(d)
        b.extend(d)
        if not a.prioritization.sampleable:
            return
        ref = b.sample(bs)
        out = {k: np.full_like(ref[k], 7) for k in which}
        got = a.sample(bs, out=out)
        same_batch(got, ref)
        for k in which:
            assert got[k] is out[k]
        same_state(a, b)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("out", [
    {"obs": np.zeros((4, 2, 3, 4), np.uint8)},              # wrong batch size
    {"obs": np.zeros((3, 2, 3, 4), np.int16)},              # wrong dtype
    {"obs": np.zeros((3, 2, 3, 8), np.uint8)[..., ::2]},    # not contiguous
    {"bogus": np.zeros(3)},                                 # not a field
    {"action": np.zeros(3, np.int64), "reward": np.zeros(6, np.float32)[:3]},  # fine / fine ...
    {"action": [0, 0, 0]},                                  # not an array
    "obs",                                                  # not a mapping
])
def test_bad_out_refused_and_nothing_drawn(out):
    cfg = {"k": 2, "n": 1, "envs": 1, "cap": 20, "seed": 0, "norm": "global", "prio": "proportional",
           "storage": "memory"}
    buf = make(cfg)
    buf.extend(step_data(cfg, np.random.default_rng(0), (25,)))
    before = buf.state_dict()
    before = (repr(before[0]), {k: np.array(v) for k, v in before[1].items()})
    if isinstance(out, dict) and set(out) == {"action", "reward"}:
        out = dict(out, discount=out["action"].view(np.float32)[:3])  # shares memory with action
    with pytest.raises(BigperError):
        buf.sample(3, out=out)
    after = buf.state_dict()
    assert repr(after[0]) == before[0]
    assert all(np.array_equal(np.asarray(after[1][k]), before[1][k]) for k in before[1])
