"""Issue 34: a compressed batch decodes each distinct frame once.

Two properties, both on the read path of ``FrameStore`` (``stacks``, ``pair``,
``rows_of``, all through ``FrameStore._decode``):

- a compressed buffer returns exactly what its uncompressed twin returns
  (same adds, same seed, same priority updates): ``sample``, ``sample_at``,
  ``sampler``, ``gather``, with batches full of repeats (a small buffer, a
  large batch), frames that repeat inside a stack, stacks that do not
  continue (``pair``'s fallback), n-step and sequences;
- the segment log's ``decode`` sees each distinct frame of a batch once:
  the ids it is asked for, over one ``sample``, are the batch's distinct
  frame ids, each once (counted by wrapping the log's ``decode``).

The kernels behind it (``distinct_ids``, ``spread_rows``) are checked
against numpy's ``unique`` on any ids, negative (zero frames) included.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import bigper
from bigper.frames.store import distinct_ids, spread_rows
from tests import hook

SHAPE = (6, 7)  # 42 bytes a frame: not a multiple of 8 (frames as bytes, not words)
SHAPE8 = (8, 8)  # 64 bytes: frames as 8-byte words


def palette(rng, n_distinct: int, shape) -> np.ndarray:
    """``n_distinct`` frames that compress (a few values in blocks)."""
    base = rng.integers(0, 4, (n_distinct, 1, shape[1]), dtype=np.uint8)
    return np.ascontiguousarray(np.broadcast_to(base, (n_distinct, *shape)) * np.uint8(40))


class Stream:
    """Steps of one env: frames from a small palette (so equal frames follow
    each other and share a reference), episodes ending at random, and with
    ``p_jump`` a next_obs stack that is not the obs stack moved on by one
    (``pair``'s fallback), after which the stream goes on from it."""

    def __init__(self, seed: int, k: int, shape, n_distinct: int, p_end: float, p_jump: float):
        self.rng = np.random.default_rng(seed)
        self.k, self.p_end, self.p_jump = k, p_end, p_jump
        self.frames = palette(self.rng, n_distinct, shape)
        self.stack = None
        self.t = 0

    def step(self) -> dict:
        rng, k = self.rng, self.k
        if self.stack is None:  # a reset: the first frame repeated
            self.stack = np.stack([self.frames[rng.integers(len(self.frames))]] * k)
        if rng.random() < self.p_jump:
            nxt = self.frames[rng.integers(len(self.frames), size=k)]
        else:
            nxt = np.concatenate([self.stack[1:], self.frames[rng.integers(len(self.frames))][None]])
        end = bool(rng.random() < self.p_end)
        row = dict(obs=self.stack, next_obs=nxt, step=self.t, reward=np.float32(self.t % 3),
                   terminated=end, truncated=False)
        self.t += 1
        self.stack = None if end else nxt
        return row


def twins(capacity: int, k: int, shape, seed: int, **kw):
    fields = {"obs": ((k, *shape), np.uint8), "step": ((), np.int64), "reward": ((), np.float32)}
    raw = bigper.PrioritizedReplayBuffer(capacity=capacity, fields=fields, frame_stack=k, seed=seed, **kw)
    z = bigper.PrioritizedReplayBuffer(capacity=capacity, fields=fields, frame_stack=k, seed=seed,
                                       compression="zstd", **kw)
    return raw, z


def same_batch(a, b) -> None:
    assert set(a.data) == set(b.data)
    for name in a.data:
        np.testing.assert_array_equal(a.data[name], b.data[name], err_msg=name)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.generations, b.generations)
    if a.mask is not None or b.mask is not None:
        np.testing.assert_array_equal(a.mask, b.mask)


def fill(bufs, stream: Stream, steps: int) -> None:
    for _ in range(steps):
        row = stream.step()
        for buf in bufs:
            buf.add(**row)


def same_status(raw, z) -> None:
    # (the frames compress: the log keeps every frame the ring keeps, so the same transitions are live)
    np.testing.assert_array_equal(raw.status, z.status)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.integers(1, 40), k=st.integers(1, 4), batch=st.sampled_from([1, 7, 32, 256]),
       shape=st.sampled_from([SHAPE, SHAPE8]), n_distinct=st.integers(1, 6),
       p_end=st.sampled_from([0.0, 0.1, 0.4]), p_jump=st.sampled_from([0.0, 0.2]),
       n_step=st.sampled_from([1, 1, 3]), steps=st.integers(1, 120), seed=st.integers(0, 2**16))
def test_transitions_equal_the_uncompressed_twin(capacity, k, batch, shape, n_distinct, p_end, p_jump, n_step,
                                                 steps, seed):
    raw, z = twins(capacity, k, shape, seed, n_step=n_step)
    try:
        fill((raw, z), Stream(seed, k, shape, n_distinct, p_end, p_jump), steps)
        same_status(raw, z)
        if not (raw.status == 1).any():
            event("nothing sampleable")
            return
        event("sampled")
        rng = np.random.default_rng(seed)
        for _ in range(3):  # sample, and priorities from updates
            a, b = raw.sample(batch), z.sample(batch)
            same_batch(a, b)
            p = rng.random(batch) * 10 + 0.01
            raw.update_priorities(a, p)
            z.update_priorities(b, p)
        t = rng.random(batch) * raw.total_priority
        t = np.minimum(t, np.nextafter(raw.total_priority, 0))
        same_batch(raw.shard.sample_at(t, beta=0.4), z.shard.sample_at(t, beta=0.4))
        live = np.flatnonzero(raw.status == 1)
        ga, gb = raw.gather(live), z.gather(live)
        for name in ga:
            np.testing.assert_array_equal(ga[name], gb[name], err_msg=name)
        sa, sb = raw.sampler(batch, prefetch=0), z.sampler(batch, prefetch=2)
        for _ in range(2):
            same_batch(next(sa), next(sb))
        sb.close()
    finally:
        raw.close()
        z.close()


@settings(max_examples=15, deadline=None)
@given(k=st.integers(1, 4), length=st.integers(1, 6), burn_in=st.integers(0, 3), period=st.integers(1, 4),
       capacity=st.integers(8, 40), batch=st.sampled_from([1, 16, 128]), n_distinct=st.integers(1, 6),
       p_end=st.sampled_from([0.0, 0.1, 0.3]), steps=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_sequences_equal_the_uncompressed_twin(k, length, burn_in, period, capacity, batch, n_distinct, p_end,
                                               steps, seed):
    try:
        raw, z = twins(capacity, k, SHAPE8, seed,
                       sequence=bigper.Sequence(length, burn_in=burn_in, period=period))
    except bigper.errors.InvalidArgumentError as e:  # a capacity too small for the sequence: refused
        assert "capacity" in str(e) or "compression_budget" in str(e)
        event("refused")
        return
    try:
        fill((raw, z), Stream(seed, k, SHAPE8, n_distinct, p_end, 0.0), steps)
        same_status(raw, z)
        try:
            a = raw.sample(batch)
        except bigper.errors.InvalidArgumentError:  # no sequence item sampleable yet
            with pytest.raises(bigper.errors.InvalidArgumentError):
                z.sample(batch)
            event("no item sampleable")
            return
        event("sampled")
        same_batch(a, z.sample(batch))
        sa, sb = raw.sampler(batch, prefetch=0), z.sampler(batch, prefetch=0)
        same_batch(next(sa), next(sb))
    finally:
        raw.close()
        z.close()


class Counting:
    """Wraps a SegmentLog instance's ``decode``: every id it is asked for."""

    def __init__(self, log):
        self.log, self.inner, self.ids = log, log.decode, []
        log.decode = self

    def __call__(self, ids, out=None):
        self.ids.append(np.array(ids, copy=True))
        return self.inner(ids, out)

    def take(self) -> np.ndarray:
        out = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        self.ids = []
        return out


def batch_ids(buf, b) -> np.ndarray:
    """The distinct frame ids a batch's stacks show (padded steps left out)."""
    fs = hook.frames(buf)
    idx = b.indices if b.mask is None else None
    if idx is None:  # sequences: the window's real steps
        slots, mask = hook.unit(buf).items.window(b.indices)
        idx = slots[mask]
    ids = [fs.refs("obs_ref", idx).ravel()]
    if b.mask is None and buf.config.n_step == 1:
        ids.append(fs.refs("next_obs_ref", idx).ravel())
    elif b.mask is not None:
        ids.append(fs.refs("next_obs_ref", idx).ravel())
    return np.unique(np.concatenate(ids))


@pytest.mark.parametrize("capacity,batch,p_jump", [(16, 256, 0.0), (16, 256, 0.3), (2000, 64, 0.0),
                                                   (2000, 64, 0.3), (1, 32, 0.0)])
def test_each_distinct_frame_of_a_batch_is_decoded_once(capacity, batch, p_jump):
    k = 4
    _, z = twins(capacity, k, SHAPE8, 0)
    try:
        fill((z,), Stream(1, k, SHAPE8, 50, 0.02, p_jump), capacity + 50)
        count = Counting(hook.log(z))
        fallbacks = 0
        for _ in range(20):
            b = z.sample(batch)
            got = count.take()
            want = batch_ids(z, b)
            assert got.size == np.unique(got).size, "a frame was decoded twice in one batch"
            np.testing.assert_array_equal(np.sort(got), want)
            ro, rn = hook.frames(z).refs("obs_ref", b.indices), hook.frames(z).refs("next_obs_ref", b.indices)
            shifted = (rn[:, :-1] == ro[:, 1:]).all()
            fallbacks += not shifted
            assert got.size <= batch * (k + 1) if shifted else got.size <= 2 * batch * k
        if p_jump and capacity > 1:
            assert fallbacks  # pair's fallback (stacks that do not continue) was taken
    finally:
        z.close()


@pytest.mark.parametrize("n_step", [2, 3])
def test_each_distinct_frame_of_an_n_step_batch_is_decoded_once(n_step):
    # obs at the drawn slots, next_obs at each window's last slot: one decode for both
    k = 4
    raw, z = twins(500, k, SHAPE8, 0, n_step=n_step)
    try:
        fill((raw, z), Stream(1, k, SHAPE8, 50, 0.02, 0.0), 700)
        count = Counting(hook.log(z))
        for _ in range(10):
            b = z.sample(64)
            got = count.take()
            assert got.size == np.unique(got).size, "a frame was decoded twice in one batch"
            same_batch(raw.sample(64), b)
    finally:
        raw.close()
        z.close()


def test_each_distinct_frame_of_a_sequence_batch_is_decoded_once():
    k = 4
    _, z = twins(64, k, SHAPE8, 0, sequence=bigper.Sequence(8, burn_in=4, period=2))
    try:
        fill((z,), Stream(2, k, SHAPE8, 50, 0.05, 0.0), 200)
        count = Counting(hook.log(z))
        for _ in range(10):
            b = z.sample(64)  # 64 rows of 12 steps from ~30 items: rows repeat and overlap
            got = count.take()
            assert got.size == np.unique(got).size, "a frame was decoded twice in one batch"
            np.testing.assert_array_equal(np.sort(got), batch_ids(z, b))
    finally:
        z.close()


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(-3, 40) | st.integers(0, 2**62), min_size=0, max_size=300),
       words=st.integers(1, 3))
def test_distinct_ids_and_spread_rows_against_numpy(ids, words):
    ids = np.array(ids, dtype=np.int64)
    n = ids.shape[0]
    uniq, src = np.empty(n, np.int64), np.empty(n, np.int64)
    u = distinct_ids(ids, uniq, src)
    real = ids[ids >= 0]
    assert u == np.unique(real).shape[0]
    np.testing.assert_array_equal(np.sort(uniq[:u]), np.unique(real))
    assert ((src < u) & (src >= -1)).all() if n else True
    # "decode": row j of the distinct rows holds its id (and the id + 1 in the next words)
    rows = np.full((n, words), -7, dtype=np.int64)
    rows[:u] = uniq[:u, None] + np.arange(words)
    spread_rows(rows.view(np.uint64), src, u)
    want = np.where(ids[:, None] >= 0, ids[:, None] + np.arange(words), 0)
    np.testing.assert_array_equal(rows, want)
    if u == n:
        np.testing.assert_array_equal(uniq, ids)  # all distinct: decoded where they lie
