"""Sequence items (``sequence=bigper.Sequence(...)``): every sampled and
gathered sequence against a plain reference built from what was added
(tests/_sequence_reference.py), the item law by chi-square, the priority
reduction against numpy, and bad input refused with nothing changed."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

import bigper
from bigper import Sequence

from tests._sequence_reference import Ref, assert_window
from tests.buffer.test_validation import assert_same, check_rejected, fingerprint


def build(ref, capacity, *, storage="memory", path=None, prioritization="proportional", eta=0.9, **kw):
    return bigper.PrioritizedReplayBuffer(
        capacity, ref.fields(), frame_stack=ref.fs, num_envs=ref.k, storage=storage, path=path,
        prioritization=prioritization,
        sequence=Sequence(ref.length, burn_in=ref.burn_in, period=ref.period, eta=eta), **kw)


def feed(buf, ref, ends, chunk=1, placeholders=()):
    """Add ``len(ends)`` time steps of every env: ``ends[t][e]`` is 0 (none),
    1 (terminated) or 2 (truncated); ``placeholders``: (t, e) whose row is a
    valid=False reset row (only right after an episode end of that env).
    Steps go in as ``add`` (chunk 1) or ``extend`` calls of ``chunk`` steps."""
    k = ref.k
    prev_end = [True] * k
    batch = []
    for t, row_ends in enumerate(ends):
        rows = []
        for e in range(k):
            g = ref.count
            valid = not ((t, e) in placeholders and prev_end[e])
            end = row_ends[e] if valid else 0
            r = ref.make_row(g, end == 1, end == 2, valid)
            ref.add(r)
            rows.append(r)
            prev_end[e] = (end != 0) or not valid
        batch.append(rows)
        if len(batch) == chunk:
            _put(buf, batch, k)
            batch = []
    if batch:
        _put(buf, batch, k)


def _put(buf, batch, k):
    def col(name):
        if name in ("terminated", "truncated", "valid"):
            key = {"terminated": "term", "truncated": "trunc", "valid": "valid"}[name]
            a = np.array([[r[key] for r in rows] for rows in batch])
        else:
            a = np.stack([np.stack([r["data"][name] for r in rows]) for rows in batch])
        return a if k > 1 else a[:, 0]

    names = list(batch[0][0]["data"]) + ["terminated", "truncated"]
    valid = col("valid")
    if len(batch) == 1:
        step = {n: col(n)[0] for n in names}
        buf.add(**step, valid=None if valid.all() else valid[0])
    else:
        buf.extend({n: col(n) for n in names}, valid=None if valid.all() else valid)


def live_slots(buf):
    return set(np.flatnonzero(buf.leaves(np.arange(buf.capacity)) > 0).tolist())


def check_against(buf, ref, frames_exact=True, samples=2):
    """The buffer's live items equal the reference's (a subset with frame
    stacks, whose frames may expire before the ring overwrites the step),
    and every live item and every sampled one comes back exactly."""
    items = ref.items()
    want = {g % ref.c: g for g, s in items.items() if s == "live"}
    got = live_slots(buf)
    if ref.fs:
        assert got <= set(want), sorted(got - set(want))
    else:
        assert got == set(want), (sorted(got), sorted(want))
    if not got:
        return
    slots = np.array(sorted(got), dtype=np.int64)
    data = buf.gather(slots)
    mask = data.pop("mask")
    for i, s in enumerate(slots):
        assert_window({n: v[i] for n, v in data.items()}, mask[i], ref.window(want[int(s)]), f"slot {s}")
    for _ in range(samples):
        b = buf.sample(8)
        assert b.burn_in == ref.burn_in and b.mask.shape == (8, ref.T)
        for i, s in enumerate(b.indices):
            assert int(s) in got
            assert b.generations[i] == want[int(s)]
            assert_window({n: v[i] for n, v in b.data.items()}, b.mask[i], ref.window(want[int(s)]))


# -- every sampled sequence against the reference -----------------------------------

configs = st.fixed_dictionaries({
    "num_envs": st.integers(1, 3), "length": st.integers(1, 5), "burn_in": st.integers(0, 3),
    "period": st.integers(1, 6), "extra": st.integers(0, 12), "frame_stack": st.sampled_from([None, 2, 3]),
    "chunk": st.sampled_from([1, 1, 3, 7]), "seed": st.integers(0, 1000),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, data=st.data())
def test_every_sequence_matches_the_reference(cfg, data):
    ref = Ref(0, cfg["num_envs"], cfg["length"], cfg["burn_in"], cfg["period"], cfg["frame_stack"],
              seed=cfg["seed"])
    ref.c = (cfg["burn_in"] + cfg["length"]) * cfg["num_envs"] + cfg["extra"]
    buf = build(ref, ref.c, seed=cfg["seed"])
    n = data.draw(st.integers(0, 40), label="steps")
    ends = data.draw(st.lists(st.lists(st.sampled_from([0, 0, 0, 0, 1, 2]), min_size=ref.k, max_size=ref.k),
                              min_size=n, max_size=n), label="ends")
    holes = set(data.draw(st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(0, ref.k - 1)),
                                   max_size=4), label="placeholders"))
    feed(buf, ref, ends, cfg["chunk"], holes)
    check_against(buf, ref)
    # more steps after a first check: the ring wraps, items die
    m = data.draw(st.integers(0, 30), label="more")
    more = data.draw(st.lists(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=ref.k, max_size=ref.k),
                              min_size=m, max_size=m), label="more ends")
    feed(buf, ref, more, cfg["chunk"])
    check_against(buf, ref)
    buf.close()


@pytest.mark.parametrize("end_at", range(0, 9))
@pytest.mark.parametrize("length,burn_in,period", [(4, 2, 3), (3, 0, 3), (5, 3, 2), (2, 1, 5)])
def test_an_episode_end_at_every_position(end_at, length, burn_in, period):
    """One episode ending at ``end_at``, then another that continues: every
    item of both comes back exactly, padded after the end and before the start."""
    ref = Ref(0, 1, length, burn_in, period)
    ref.c = 40
    buf = build(ref, ref.c)
    ends = [[1 if t == end_at else 0] for t in range(end_at + 1)] + [[0]] * 9
    feed(buf, ref, ends)
    check_against(buf, ref)
    starts = sorted(g for g, s in ref.items().items())
    assert starts[0] == 0 and all(g % period == 0 or g > end_at for g in starts)


def test_period_not_dividing_the_length_and_overlapping_items():
    ref = Ref(0, 1, 5, 2, 3)
    ref.c = 64
    buf = build(ref, ref.c)
    feed(buf, ref, [[0]] * 20)
    check_against(buf, ref)
    # items at 0, 3, 6, ...: each shares steps with the next; steps are stored once
    assert len(buf) == 20 and sorted(live_slots(buf)) == [0, 3, 6, 9, 12, 15]


def test_vector_envs_each_their_own_stream():
    ref = Ref(0, 3, 3, 1, 2)
    ref.c = 60
    buf = build(ref, ref.c)
    ends = [[int(t == 4), int(t == 6), 0] for t in range(12)]
    feed(buf, ref, ends, chunk=4)
    check_against(buf, ref)
    # env 0's second episode starts at its 6th step (row 15): an item there
    assert 15 in live_slots(buf)


def test_wrap_around_kills_items_whose_earliest_step_is_overwritten():
    ref = Ref(0, 1, 3, 2, 3)
    ref.c = 10
    buf = build(ref, ref.c)
    feed(buf, ref, [[0]] * 10)
    # items at 0, 3 (burn-in from 1), 6 (burn-in from 4); 9 pending
    assert live_slots(buf) == {0, 3, 6}
    feed(buf, ref, [[0]])  # row 10 overwrites row 0: item 0 dies
    assert live_slots(buf) == {3, 6}
    feed(buf, ref, [[0]])  # row 11 overwrites row 1, the first burn-in step of item 3
    assert live_slots(buf) == {6, 9}
    check_against(buf, ref)


def test_frame_expiry_kills_items_containing_a_step_that_lost_its_frames():
    """Short episodes of new frames write more frames than the ring has rows
    for steps: frames expire before the ring overwrites the steps, and the
    items whose earliest step lost its frames must die with it."""
    ref = Ref(0, 1, 2, 1, 1, frame_stack=3)
    ref.c = 64
    buf = build(ref, ref.c)
    ends = [[int(t % 2 == 1)] for t in range(120)]
    feed(buf, ref, ends, chunk=5)
    status = buf.status
    live = live_slots(buf)
    dead_steps = set(np.flatnonzero(status == 3).tolist())
    assert dead_steps, "the scenario must expire frames"
    assert not (live & dead_steps)
    pos, gens = ref.positions(), buf.generations
    killed = 0
    for s in range(ref.c):  # an item lives iff its earliest step (burn-in included) has its frames
        g = int(gens[s])
        if pos[g] < 0 or pos[g] % ref.period:
            continue
        early = (g - min(pos[g], ref.burn_in)) % ref.c
        assert (s in live) == (early not in dead_steps), (s, early)
        killed += s not in live
    assert killed
    check_against(buf, ref, samples=5)


@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_disk_storages_serve_the_same_sequences(tmp_path, storage):
    ref = Ref(0, 2, 3, 2, 2, frame_stack=2)
    ref.c = 40
    buf = build(ref, ref.c, storage=storage, path=tmp_path / "buf")
    ends = [[int(t % 7 == 6), int(t % 5 == 4)] for t in range(30)]
    feed(buf, ref, ends, chunk=3)
    check_against(buf, ref)
    buf.close()
    again = build(ref, ref.c, storage=storage, path=tmp_path / "buf", mode="resume", continue_episodes=True)
    check_against(again, ref)
    feed(again, ref, [[0, 1]] * 5)
    check_against(again, ref)
    again.close()


# -- the item law ------------------------------------------------------------------

def _filled(prioritization, alpha=0.7):
    ref = Ref(0, 1, 4, 2, 2)
    ref.c = 200
    buf = build(ref, ref.c, prioritization=prioritization, alpha=alpha, seed=11)
    feed(buf, ref, [[int(t % 23 == 22)] for t in range(120)])
    slots = np.array(sorted(live_slots(buf)), dtype=np.int64)
    p = np.random.default_rng(3).uniform(0.1, 5.0, slots.shape[0])
    buf.update_priorities(slots, p)
    return buf, slots, p


def _counts(buf, slots, rounds, b):
    seen = np.zeros(buf.capacity)
    for _ in range(rounds):
        np.add.at(seen, buf.sample(b).indices, 1)
    assert seen[np.setdiff1d(np.arange(buf.capacity), slots)].sum() == 0  # only items are drawn
    return seen[slots]


def test_proportional_item_law_by_chi_square():
    buf, slots, p = _filled("proportional")
    want = (p + 1e-6) ** 0.7
    seen = _counts(buf, slots, 400, 64)
    assert stats.chisquare(seen, want / want.sum() * seen.sum()).pvalue > 1e-3
    # and the test can fail: the law with another alpha is refused
    wrong = (p + 1e-6) ** 0.35
    assert stats.chisquare(seen, wrong / wrong.sum() * seen.sum()).pvalue < 1e-3


def test_rank_item_law_by_chi_square():
    buf, slots, p = _filled("rank")
    buf.prioritization.sort()  # right after a full sort, heap positions are the exact ranks
    rank = np.empty(p.shape[0])
    rank[np.argsort(-p)] = np.arange(1, p.shape[0] + 1)
    want = rank ** -0.7
    seen = _counts(buf, slots, 400, 64)
    assert stats.chisquare(seen, want / want.sum() * seen.sum()).pvalue > 1e-3
    flat = np.ones_like(want)
    assert stats.chisquare(seen, flat / flat.sum() * seen.sum()).pvalue < 1e-3


# -- priorities: the reduction rule ------------------------------------------------

@pytest.mark.parametrize("eta", [0.9, 0.0, 1.0, 0.37])
@pytest.mark.parametrize("per_step", ["T", "length"])
def test_per_step_errors_reduce_by_eta_max_plus_mean_over_real_learning_steps(eta, per_step):
    ref = Ref(0, 1, 4, 3, 2)
    ref.c = 100
    buf = build(ref, ref.c, eta=eta, alpha=1.0, eps=0.0, seed=5)
    feed(buf, ref, [[int(t % 5 == 4)] for t in range(60)])
    b = buf.sample(16)
    rng = np.random.default_rng(0)
    td = rng.uniform(0, 3, (16, ref.T))
    td[~b.mask] = np.nan  # padding may hold anything
    td[:, :ref.burn_in] = np.nan  # so may the burn-in
    arg = td if per_step == "T" else td[:, ref.burn_in:]
    buf.update_priorities(b, arg)
    for i in range(16):
        real = [td[i, t] for t in range(ref.burn_in, ref.T) if b.mask[i, t]]
        want = eta * max(real) + (1 - eta) * (sum(real) / len(real))
        last = max(j for j in range(16) if b.indices[j] == b.indices[i])  # a repeat: the last row wins
        if last == i:
            np.testing.assert_allclose(buf.leaves([b.indices[i]])[0], want, rtol=1e-12)


def test_a_flat_array_of_item_priorities_is_taken_as_it_is():
    ref = Ref(0, 1, 3, 1, 3)
    ref.c = 50
    buf = build(ref, ref.c, alpha=1.0, eps=0.0)
    feed(buf, ref, [[0]] * 20)
    b = buf.sample(4)
    p = np.array([0.5, 1.5, 2.5, 3.5])
    buf.update_priorities(b, p)
    last = {int(s): p[i] for i, s in enumerate(b.indices)}
    np.testing.assert_array_equal(buf.leaves(np.array(list(last))), np.array(list(last.values())))


def test_new_items_enter_at_the_largest_priority_seen():
    ref = Ref(0, 1, 2, 0, 2)
    ref.c = 50
    buf = build(ref, ref.c, alpha=1.0, eps=0.0)
    feed(buf, ref, [[0]] * 6)
    buf.update_priorities(np.array([0]), np.array([9.0]))
    feed(buf, ref, [[0]] * 4)
    assert buf.leaves(np.array([6]))[0] == 9.0


def test_to_torch_dict_is_a_target_for_per_step_errors():
    torch = pytest.importorskip("torch")
    ref = Ref(0, 1, 3, 1, 2)
    ref.c = 50
    buf = build(ref, ref.c, alpha=1.0, eps=0.0)
    feed(buf, ref, [[int(t == 6)] for t in range(20)])
    b = buf.sample(4)
    t = b.to_torch()
    assert t["mask"].dtype == torch.bool and tuple(t["mask"].shape) == (4, ref.T)
    assert tuple(t["obs"].shape) == (4, ref.T, 2)
    td = torch.rand(4, ref.T)
    buf.update_priorities(t, td)
    x = td.numpy()[:, 1:]
    m = b.mask[:, 1:]
    i = int(np.flatnonzero(b.indices == b.indices[-1])[-1])
    real = x[i][m[i]]
    np.testing.assert_allclose(buf.leaves([b.indices[i]])[0], 0.9 * real.max() + 0.1 * real.mean(), rtol=1e-6)


# -- bad input: refused, nothing changed ----------------------------------------------

def _used():
    ref = Ref(0, 1, 3, 2, 2)
    ref.c = 30
    buf = build(ref, ref.c, seed=2)
    feed(buf, ref, [[int(t % 9 == 8)] for t in range(40)])
    buf.sample(4)
    return buf, ref


def test_nan_in_a_real_step_is_refused_naming_the_position():
    buf, ref = _used()
    b = buf.sample(4)
    td = np.ones((4, ref.T))
    td[2, ref.burn_in] = np.nan  # the start step: always real
    check_rejected(buf, lambda x: x.update_priorities(b, td), bigper.InvalidArgumentError,
                   f"priorities[2, {ref.burn_in}]", "nan")
    td = np.ones((4, ref.length))
    td[1, 0] = -1.0
    check_rejected(buf, lambda x: x.update_priorities(b, td), bigper.InvalidArgumentError,
                   "priorities[1, 0]", "-1.0")


@pytest.mark.parametrize("shape", [(4, 4), (3, 5), (4, 5, 1), (5,)])
def test_per_step_errors_of_another_shape_are_refused(shape):
    buf, ref = _used()
    b = buf.sample(4)
    check_rejected(buf, lambda x: x.update_priorities(b, np.ones(shape)), bigper.InvalidArgumentError,
                   "shape")


def test_per_step_errors_for_raw_indices_are_refused():
    buf, ref = _used()
    b = buf.sample(4)
    check_rejected(buf, lambda x: x.update_priorities(b.indices, np.ones((4, ref.T))),
                   bigper.InvalidArgumentError, "mask")


def test_an_index_that_starts_no_item_is_refused():
    buf, ref = _used()
    live = sorted(live_slots(buf))
    step = next(s for s in range(buf.capacity) if s not in live and buf.generations[s] >= 0
                and ref.positions()[buf.generations[s]] % 2 == 1)
    check_rejected(buf, lambda x: x.update_priorities(np.array([live[0], step]), np.ones(2)),
                   bigper.InvalidArgumentError, f"indices[1] = {step}", "starts no sequence item")


def test_sample_out_and_sample_at_are_refused():
    buf, ref = _used()
    check_rejected(buf, lambda x: x.sample(2, out={}), bigper.InvalidArgumentError, "out=")
    check_rejected(buf, lambda x: x.shard.sample_at(np.array([0.5]), beta=0.4), bigper.InvalidArgumentError,
                   "sequence")


def test_gather_refuses_a_step_that_is_not_a_live_item():
    buf, ref = _used()
    dead = np.flatnonzero(buf.leaves(np.arange(buf.capacity)) == 0)[:1]
    check_rejected(buf, lambda x: x.gather(dead), bigper.InvalidIndexError, "not a sampleable sequence item")


@pytest.mark.parametrize("kw,names", [
    ({"length": 0}, ["length", "0"]),
    ({"length": 3, "burn_in": -1}, ["burn_in", "-1"]),
    ({"length": 3, "period": 0}, ["period", "0"]),
    ({"length": 3, "eta": 1.5}, ["eta", "1.5"]),
    ({"length": 2.5}, ["length", "2.5"]),
    ({"length": 3, "eta": float("nan")}, ["eta", "nan"]),
])
def test_sequence_rejects_bad_values(kw, names):
    with pytest.raises(bigper.InvalidArgumentError) as info:
        Sequence(**kw)
    for n in names:
        assert n in str(info.value)


@pytest.mark.parametrize("over,names", [
    ({"n_step": 3}, ["n_step=3", "sequence"]),
    ({"capacity": 9}, ["capacity=9", "(3 + 4) * 2 = 14"]),
    ({"fields": {"obs": ((2,), np.float32), "mask": ((), np.float32)}}, ["mask"]),
    ({"sequence": {"length": 4, "burn": 3}}, ["sequence"]),
])
def test_constructor_rejects_sequences_it_cannot_serve(over, names):
    kw = {"capacity": 50, "fields": {"obs": ((2,), np.float32)}, "num_envs": 2,
          "sequence": Sequence(4, burn_in=3)}
    kw.update(over)
    with pytest.raises(bigper.BigperError) as info:
        bigper.PrioritizedReplayBuffer(kw.pop("capacity"), kw.pop("fields"), **kw)
    for n in names:
        assert n in str(info.value)


def test_config_round_trips_through_json():
    import json

    from bigper.config import Config

    cfg = Config.build(capacity=30, fields={"obs": ((2,), np.float32)},
                       sequence=Sequence(5, burn_in=2, period=3, eta=0.5))
    back = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.seq == Sequence(5, 2, 3, 0.5)
    plain = Config.build(capacity=30, fields={"obs": ((2,), np.float32)})
    assert "sequence" not in plain.to_dict()  # configs without sequences stay as they were written


def test_resume_with_another_sequence_is_refused_and_leaves_the_path(tmp_path):
    from tests._hostile_snapshot_cases import fingerprint as disk

    ref = Ref(0, 1, 3, 1, 3)
    ref.c = 30
    buf = build(ref, ref.c, storage="memmap", path=tmp_path / "b")
    feed(buf, ref, [[0]] * 10)
    buf.close()
    before = disk(tmp_path)
    with pytest.raises(bigper.IncompatibleSnapshotError) as info:
        bigper.PrioritizedReplayBuffer(30, ref.fields(), storage="memmap", path=tmp_path / "b", mode="resume",
                                       sequence=Sequence(3, burn_in=1, period=2))
    assert "sequence" in str(info.value)
    assert disk(tmp_path) == before
    with pytest.raises(bigper.IncompatibleSnapshotError):
        bigper.PrioritizedReplayBuffer(30, ref.fields(), storage="memmap", path=tmp_path / "b", mode="resume")


def test_refused_update_changes_nothing_even_after_a_good_one():
    buf, ref = _used()
    b = buf.sample(4)
    buf.update_priorities(b, np.full((4, ref.T), 2.0))
    before = fingerprint(buf)
    td = np.full((4, ref.T), 2.0)
    td[3, -1] = np.inf if b.mask[3, -1] else td[3, -1]
    td[0, ref.burn_in] = np.inf
    with pytest.raises(bigper.InvalidArgumentError):
        buf.update_priorities(b, td)
    assert_same(before, fingerprint(buf))


# -- snapshots, exact resume, the committed fixture, crafted item tables ---------------

def _rounds(buf, ref, rng, n):
    """A learner's loop: sample, update per step, add a few steps."""
    out = []
    for i in range(n):
        b = buf.sample(4)
        td = rng.random((4, ref.T)) * 2
        td[~b.mask] = np.nan
        buf.update_priorities(b, td)
        out.append((b.indices.copy(), b.weights.copy(), b.mask.copy(),
                    {k: v.copy() for k, v in b.data.items()}))
        feed(buf, ref, [[int(i % 3 == 2), 0]] * 2)
    return out


@pytest.mark.parametrize("storage", ["memory", "memmap", "hdf5"])
@pytest.mark.parametrize("prioritization", ["proportional", "rank"])
def test_resume_from_a_snapshot_is_exact(tmp_path, storage, prioritization):
    def run(path):
        ref = Ref(0, 2, 3, 2, 2, frame_stack=2, seed=1)
        ref.c = 40
        return ref, build(ref, 40, storage=storage, path=path, prioritization=prioritization, seed=3)

    ref, a = run(None if storage == "memory" else tmp_path / "a")
    feed(a, ref, [[int(t % 7 == 6), int(t % 4 == 3)] for t in range(25)], chunk=2)
    _rounds(a, ref, np.random.default_rng(0), 3)
    snap = a.save(tmp_path / "snap")
    ref_b = Ref(0, 2, 3, 2, 2, frame_stack=2, seed=1)
    ref_b.__dict__.update({k: (v.copy() if isinstance(v, (list, dict)) else v) for k, v in ref.__dict__.items()
                           if k != "rng"})
    ref_b.rng.bit_generator.state = ref.rng.bit_generator.state
    want = _rounds(a, ref, np.random.default_rng(1), 6)
    b = bigper.PrioritizedReplayBuffer.load(snap, path=None if storage == "memory" else tmp_path / "b",
                                         continue_episodes=True)  # the stream goes on, as in the run that never stopped
    got = _rounds(b, ref_b, np.random.default_rng(1), 6)
    for (i1, w1, m1, d1), (i2, w2, m2, d2) in zip(want, got):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(w1, w2)
        np.testing.assert_array_equal(m1, m2)
        for k in d1:
            assert d1[k].tobytes() == d2[k].tobytes(), k
    check_against(b, ref_b)
    assert_same({k: v for k, v in b.state_dict()[1].items()}, {k: v for k, v in a.state_dict()[1].items()})
    a.close()
    b.close()


def test_the_committed_sequence_fixture_resumes_bit_for_bit(tmp_path):
    import hashlib
    import json
    from pathlib import Path

    from tests._hostile_snapshot_cases import fingerprint as disk

    here = Path(__file__).parents[1] / "data"
    snap = here / "snapshot-v1-sequence"
    want = json.loads((here / "snapshot-v1-sequence.expected.json").read_text())
    before = disk(snap)
    buf = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "live", continue_episodes=True)
    assert disk(snap) == before  # loading never modifies a snapshot
    assert len(buf) == want["len"] and buf.total_priority == want["total_priority"]
    assert buf.config.seq == Sequence(4, burn_in=2, period=3, eta=0.8)
    for rec in want["batches"]:
        b = buf.sample(5)
        assert b.indices.tolist() == rec["indices"] and b.generations.tolist() == rec["generations"]
        assert b.weights.tolist() == rec["weights"] and b.probabilities.tolist() == rec["probabilities"]
        assert b.mask.astype(int).tolist() == rec["mask"] and b.burn_in == rec["burn_in"]
        for n, d in rec["data"].items():
            a = np.ascontiguousarray(b[n])
            assert f"{a.dtype.str}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest() == d, n
        buf.update_priorities(b, np.array(rec["update"]))
    assert buf.total_priority == want["total_after"]
    buf.close()


def _tables(snap):
    from bigper.core.ring import expected_gid
    from bigper.snapshot._load import inspect

    body, cfg, _, state = inspect(snap)
    # (the ring's gid is not written since issue 43: what count gives, as the load derives it)
    return {"gid": expected_gid(body["state"]["meta"]["count"], cfg.capacity), **state}


CRAFTED = {
    "a live item made pending": lambda a: _first(a, "seq_status", 1, 2),
    "an item where no item starts": lambda a: _first(a, "seq_status", 3, 1, where=a["seq_pos"] % 2 == 1),
    "a written slot marked never written": lambda a: _first(a, "seq_status", 3, 0),
    "a dead item made live": lambda a: _first(a, "seq_status", 3, 1),
    "a position shifted": lambda a: _shift(a, "seq_pos", 1),
    "a position below -1": lambda a: _first(a, "seq_pos", None, -5),
    "a pointer past a live item": lambda a: _set(a, "seq_ptr", 0, int(a["gid"].max()) + 1 - (int(a["gid"].max()) + 1) % 2),
    "a wrong next position": lambda a: _set(a, "seq_next", 1, 9999),
    "a NaN pending key": lambda a: _set(a, "seq_pending", 0, np.nan),
    "a table of another dtype": lambda a: a.__setitem__("seq_status", a["seq_status"].astype(np.int64)),
    "a leaf at a step that starts no item": lambda a: _leaf_off_item(a),
}


def _first(a, name, old, new, where=None):
    arr = a[name].copy()
    hit = np.ones(arr.shape, bool) if old is None else arr == old
    if where is not None:
        hit &= where
    s = int(np.flatnonzero(hit)[0])
    arr[s] = new
    a[name] = arr


def _shift(a, name, d):
    arr = a[name].copy()
    s = int(np.flatnonzero(arr > 0)[0])
    arr[s] += d
    a[name] = arr


def _set(a, name, i, v):
    arr = a[name].copy()
    arr[i] = v
    a[name] = arr


def _leaf_off_item(a):
    leaves = a["leaves"].copy()
    s = int(np.flatnonzero((a["seq_pos"] % 2 == 1) & (a["gid"] >= 0))[0])
    leaves[s] = 0.5
    a["leaves"] = leaves


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_item_table_is_a_corrupt_snapshot(tmp_path, case):
    from tests._hostile_snapshot_cases import put_state, refused

    ref = Ref(0, 2, 3, 2, 2)
    ref.c = 30
    buf = build(ref, 30, seed=1)
    feed(buf, ref, [[int(t % 6 == 5), int(t % 9 == 8)] for t in range(40)], chunk=3)
    snap = buf.save(tmp_path / "snap")
    # the same state through load_state: refused, the live buffer unchanged
    arrays = {k: v.copy() for k, v in _tables(snap).items()}
    CRAFTED[case](arrays)
    changed = [k for k in arrays if not np.array_equal(arrays[k], _tables(snap)[k])
               or arrays[k].dtype != _tables(snap)[k].dtype]
    assert changed, "the crafted case must change a table"
    meta = buf.state_dict()[0]
    check_rejected(buf, lambda x: x.load_state(meta, arrays), bigper.CorruptSnapshotError)
    for k in changed:
        put_state(snap, k, arrays[k])
    err = refused(bigper.CorruptSnapshotError, snap)
    assert any(k in str(err) for k in ("seq_", "leaf", "slot")), str(err)


def test_verify_and_info_show_sequences(tmp_path):
    import subprocess
    import sys

    ref = Ref(0, 1, 3, 1, 2)
    ref.c = 30
    buf = build(ref, 30)
    feed(buf, ref, [[0]] * 12)
    snap = buf.save(tmp_path / "snap")
    env = {"PYTHONPATH": str(__import__("pathlib").Path(bigper.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    info = subprocess.run([sys.executable, "-m", "bigper", "info", str(snap)], capture_output=True, text=True,
                          env=env)
    assert info.returncode == 0, info.stderr
    assert "items are sequences: length 3, burn_in 1, period 2, eta 0.9" in info.stdout
    ok = subprocess.run([sys.executable, "-m", "bigper", "verify", str(snap)], capture_output=True, text=True,
                        env=env)
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stdout + ok.stderr
    from bigper.snapshot import verify

    assert verify(snap)["problems"] == []


def test_sharded_buffers_refuse_sequences():
    from bigper.distributed import ShardedPrioritizedBuffer

    with pytest.raises(bigper.InvalidArgumentError) as info:
        ShardedPrioritizedBuffer(2, 100, {"obs": ((2,), np.float32)}, sequence=Sequence(4))
    assert "sequence" in str(info.value) and "single PrioritizedReplayBuffer" in str(info.value)


def test_updating_a_batch_whose_item_slot_now_holds_another_step_skips_it():
    """Found by the state machine: a sampled item's slot overwritten by a step
    that starts no item; the batch's update skips that row (its generation is
    stale) instead of refusing the whole update."""
    ref = Ref(0, 1, 1, 0, 2)
    ref.c = 1
    buf = build(ref, 1, alpha=1.0, eps=0.0)
    feed(buf, ref, [[0]])
    b = buf.sample(1)
    feed(buf, ref, [[0]])  # row 1 (position 1: no item) overwrites slot 0
    before = fingerprint(buf)
    buf.update_priorities(b, np.zeros((1, 1)))
    assert_same(before, fingerprint(buf))


@pytest.mark.parametrize("frame_stack", [None, 2])
@pytest.mark.parametrize("chunk", [1, 4])
def test_the_one_call_write_path_equals_the_general_one(frame_stack, chunk):
    """Adds take write_rows' one compiled call (then the items); the general
    path (``_fused = False``) must leave the same state, bit for bit."""
    def run(fused):
        ref = Ref(0, 2, 3, 2, 2, frame_stack=frame_stack, seed=4)
        ref.c = 64
        buf = build(ref, 64, seed=4)
        buf._fused = fused
        ends = [[int(t % 7 == 6), int(t % 11 == 10)] for t in range(90)]
        feed(buf, ref, ends, chunk=chunk, placeholders={(7, 0), (12, 1)})
        buf.update_priorities(buf.sample(4), np.arange(4.0) + 0.5)
        feed(buf, ref, ends[:9], chunk=chunk)
        return buf

    a, b = run(True), run(False)
    assert_same(fingerprint(a), fingerprint(b))
    x, y = a.sample(6), b.sample(6)
    np.testing.assert_array_equal(x.indices, y.indices)
    for n in x:
        assert x[n].tobytes() == y[n].tobytes()


def test_a_snapshot_survives_kill_9_of_its_writer(tmp_path):
    """A process fills a memmap sequence buffer, saves a snapshot, goes on
    adding and is killed with SIGKILL: the snapshot loads, and every item in
    it is exactly what was added up to the save."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {root!r})
        from tests._sequence_reference import Ref
        from tests.core.test_sequences import build, feed
        ref = Ref(0, 2, 3, 2, 2, frame_stack=2, seed=8)
        ref.c = 40
        buf = build(ref, 40, storage="memmap", path={str(tmp_path / 'live')!r}, seed=8)
        feed(buf, ref, [[int(t % 7 == 6), int(t % 5 == 4)] for t in range(30)], chunk=3)
        buf.save({str(tmp_path / 'snap')!r})
        feed(buf, ref, [[0, 0]] * 10)
        print("saved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == -signal.SIGKILL and "saved" in r.stdout, r.stderr[-2000:]
    ref = Ref(0, 2, 3, 2, 2, frame_stack=2, seed=8)
    ref.c = 40
    scratch = build(ref, 40)
    feed(scratch, ref, [[int(t % 7 == 6), int(t % 5 == 4)] for t in range(30)], chunk=3)
    buf = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=tmp_path / "again", continue_episodes=True)
    check_against(buf, ref)
    buf.close()


def test_priorities_given_to_extend_belong_to_the_items_starting_at_those_steps():
    ref = Ref(0, 1, 2, 1, 2)
    ref.c = 30
    buf = build(ref, 30, alpha=1.0, eps=0.0)
    rows = [ref.make_row(g, False, False) for g in range(8)]
    for r in rows:
        ref.add(r)
    data = {n: np.stack([r["data"][n] for r in rows]) for n in rows[0]["data"]}
    buf.extend({**data, "terminated": np.zeros(8, bool)}, priorities=np.arange(8.0) + 1)
    # items start at steps 0, 2, 4, 6 (each with its 2 steps written); odd steps start none
    np.testing.assert_array_equal(buf.leaves(np.arange(8)), [1, 0, 3, 0, 5, 0, 7, 0])
    assert buf.shard.max_leaf == 8.0  # every given priority counts toward the largest seen


def test_mask_has_one_spelling_for_the_batch_and_its_tensors():
    """Issue 35: ``batch["mask"]`` was UnknownFieldError while ``batch.to_torch()["mask"]`` worked."""
    ref = Ref(0, 1, 3, 1, 2)
    ref.c = 50
    buf = build(ref, ref.c)
    feed(buf, ref, [[int(t == 6)] for t in range(20)])
    b = buf.sample(4)
    assert b["mask"] is b.mask and b["mask"].shape == (4, ref.T) and "mask" in b
    plain = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32)})
    plain.add(x=1.0, terminated=False)
    with pytest.raises(bigper.UnknownFieldError, match="mask"):
        plain.sample(1)["mask"]  # transitions have no mask
    assert "mask" not in plain.sample(1)
