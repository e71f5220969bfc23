"""Two threads on one ShardedPrioritizedBuffer (issue 23, rule 1): every public
method runs under the buffer's one lock and checks "open" inside it. Hypothesis
picks pairs of public methods; both run at once (a barrier lines them up), then
the buffer must hold exactly what was added, its totals must agree with its
shards', a sample must be sound; a pair with ``close`` may only raise
``BufferClosedError`` and leaves every method raising it.

One local 2-CPU Ray instance for the module (shared with test_ray and
test_ray_laptop); a buffer is reused across examples until one closes it.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ray = pytest.importorskip("ray")

import bigper  # noqa: E402
from bigper.distributed import ShardedPrioritizedBuffer  # noqa: E402

from tests._ray_local import local_ray  # noqa: E402

FIELDS = {"x": ((2,), np.float32)}
CAP = 4000
BURST = 30  # steps an adding call sends: long enough for the other thread to land inside it


@pytest.fixture(scope="module")
def cluster():
    yield local_ray(__name__)


def _steps(m):
    return {"x": np.ones((m, 2), np.float32)}


class Live:
    """The module's buffer and what it must hold."""

    buf = None
    added = 0


def _buffer():
    if Live.buf is None or Live.buf._closed:
        Live.buf = ShardedPrioritizedBuffer(2, CAP, FIELDS, chunk_size=16, seed=0, shard_timeout_s=60.0)
        Live.buf.extend(_steps(64))
        Live.buf.flush()
        Live.added = 64
    return Live.buf


def _add(b, tmp):
    for _ in range(BURST):
        b.add(x=np.ones(2, np.float32))
    return BURST


def _extend(b, tmp):
    for _ in range(3):
        b.extend(_steps(BURST // 3))
    return BURST


def _writer(b, tmp):
    w = b.writer(chunk_size=8)
    for _ in range(BURST // 3):
        w.extend(_steps(3))
    w.flush()
    return BURST // 3 * 3


def _sample_update(b, tmp):
    batch = b.sample(32)
    assert np.all(batch.weights <= 1.0 + 1e-6) and np.all(batch.weights > 0)
    b.update_priorities(batch, np.abs(np.random.default_rng(0).standard_normal(32)) + 0.1)
    return 0


def _reads(b, tmp):
    n = len(b)
    assert 64 <= n <= CAP
    assert b.total_priority > 0
    assert all(i is not None for i in b.shard_info())
    b.beta, b.shard_actors, b.shard_timeout_s, repr(b)
    return 0


def _flush(b, tmp):
    b.flush()
    return 0


def _save(b, tmp):
    b.save(tmp / f"snap-{threading.get_ident()}-{np.random.default_rng().integers(1 << 40)}")
    return 0


def _close(b, tmp):
    b.close()
    return 0


OPS = {"add": _add, "extend": _extend, "writer": _writer, "sample+update": _sample_update,
       "reads": _reads, "flush": _flush, "save": _save, "close": _close}


def _run_pair(b, first, second, tmp):
    """Both calls at once; returns (rows each added, exception each raised)."""
    barrier = threading.Barrier(2)
    rows, errors = [0, 0], [None, None]

    def go(i, name):
        barrier.wait()
        try:
            rows[i] = OPS[name](b, tmp)
        except BaseException as e:  # noqa: BLE001 - every outcome is checked below
            errors[i] = e

    threads = [threading.Thread(target=go, args=(i, n)) for i, n in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
        assert not t.is_alive(), "a call hung"
    return rows, errors


def _assert_closed_everywhere(b):
    for call in (lambda: len(b), lambda: b.add(x=np.ones(2, np.float32)), lambda: b.extend(_steps(2)),
                 lambda: b.sample(4), lambda: b.update_priorities(np.array([0]), np.array([1.0])),
                 lambda: b.flush(), lambda: b.total_priority, lambda: b.shard_info(), lambda: b.writer(),
                 lambda: b.save("/nonexistent/never"), lambda: b.beta):
        with pytest.raises(bigper.BufferClosedError, match="closed"):
            call()
    b.close()  # closing twice is fine
    assert "closed" in repr(b)


@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck))
@given(pair=st.tuples(st.sampled_from(sorted(OPS)), st.sampled_from(sorted(OPS))))
def test_any_two_public_methods_at_once_keep_the_buffer_whole(cluster, tmp_path_factory, pair):
    tmp = tmp_path_factory.mktemp("pair")
    b = _buffer()
    rows, errors = _run_pair(b, *pair, tmp)
    if "close" in pair:
        for name, e in zip(pair, errors):
            # A writer handle (made for other processes) cannot know that the buffer closed: its
            # shards are gone, which it says as ShardUnavailableError, never Ray's raw error.
            closed = (bigper.BufferClosedError, bigper.ShardUnavailableError) if name == "writer" \
                else bigper.BufferClosedError
            assert e is None or isinstance(e, closed), (name, repr(e))
        _assert_closed_everywhere(b)
        return
    try:
        _check_whole(b, errors, rows)
    except BaseException:
        b.close()  # the next example starts from a fresh buffer, not from this one's damage
        raise


def _check_whole(b, errors, rows):
    assert errors == [None, None], errors
    Live.added += sum(rows)
    assert len(b) == Live.added  # nothing lost, nothing twice (far below capacity)
    infos = b.shard_info()
    assert sum(i["len"] for i in infos) == Live.added
    assert b.total_priority == pytest.approx(sum(i["total_priority"] for i in infos), rel=1e-9)
    batch = b.sample(64)
    assert np.all((batch.indices >= 0) & (batch.indices < CAP))
    assert np.all(batch.weights <= 1.0 + 1e-6)


def test_close_racing_adds_loses_nothing_it_accepted(cluster):
    """An add that the lock let in before close is flushed by close; one after
    it raises BufferClosedError: every row is accounted for."""
    b = ShardedPrioritizedBuffer(2, CAP, FIELDS, chunk_size=64, seed=0, shard_timeout_s=60.0)
    accepted = [0]
    stop = threading.Event()

    def adder():
        while not stop.is_set():
            try:
                b.add(x=np.ones(2, np.float32))
            except bigper.BufferClosedError:
                return
            accepted[0] += 1

    t = threading.Thread(target=adder)
    t.start()
    while accepted[0] < 100:
        threading.Event().wait(0.005)
    # Count what the shards hold just before they stop: close flushes under the lock.
    held = []
    real_kill = b._kill

    def kill():
        held.append(sum(int(ray.get(s.info.remote())["len"]) for s in b._shards))
        real_kill()

    b._kill = kill
    b.close()
    stop.set()
    t.join(60)
    assert held == [accepted[0]]
    _assert_closed_everywhere(b)


def test_a_writer_of_a_closed_buffer_says_its_shards_are_gone(cluster):
    """A writer handle outlives the buffer it writes to (it is meant for other
    processes): its sends after close() end in bigper's ShardUnavailableError,
    never in Ray's raw ActorDiedError."""
    b = _buffer()
    w = b.writer(chunk_size=8)
    b.close()
    with pytest.raises(bigper.ShardUnavailableError, match="closed"):
        for _ in range(5):
            w.extend(_steps(9))
        w.flush()
