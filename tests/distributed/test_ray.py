"""The sharded buffer on a local Ray cluster that this module starts and stops.

One shard against a local buffer (same batches, bit for bit); three very
uneven shards against the exact global law (chi-square, IS weights); two
writer actors and a sampling learner at once (every id exactly once); a
killed shard that comes back from its snapshot; save and load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
scipy_stats = pytest.importorskip("scipy.stats")

import bigper  # noqa: E402
from bigper.distributed import ShardedPrioritizedBuffer  # noqa: E402

from tests._ray_local import local_ray  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"x": ((3,), np.float32), "id": ((), np.int64)}
SMALL = dict(num_cpus_per_shard=0.2, shard_timeout_s=20.0)


@pytest.fixture(scope="module")
def cluster():
    # Shared with test_ray_laptop (one start); test_ray_nodes stops it.
    yield local_ray(__name__)


def _data(ids, seed=0, end_every=0):
    rng = np.random.default_rng(seed)
    n = len(ids)
    d = {"x": rng.random((n, 3)).astype(np.float32), "id": np.asarray(ids, dtype=np.int64)}
    if end_every:
        d["terminated"] = (np.arange(n) % end_every) == end_every - 1
    return d


def test_import_without_ray_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"
            "try:\n    import bigper.distributed\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert "pip install 'bigper[ray]'" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("weight_norm,stratified", [("global", True), ("batch", False)])
def test_one_shard_matches_a_local_buffer(cluster, weight_norm, stratified):
    kw = dict(seed=7, alpha=0.7, weight_norm=weight_norm, beta=bigper.LinearSchedule(0.4, 1.0, 6))
    local = bigper.PrioritizedReplayBuffer(500, FIELDS, **kw)
    rng = np.random.default_rng(1)
    with ShardedPrioritizedBuffer(1, 500, FIELDS, chunk_size=128, **kw, **SMALL) as sharded:
        for buf in (sharded, local):  # empty: an error, and no uniform drawn
            with pytest.raises(ValueError, match="cannot sample"):
                buf.sample(4)
        for lo, hi in ((0, 300), (300, 700)):  # the second wraps around: slots are overwritten
            d, p = _data(range(lo, hi), seed=lo, end_every=37), rng.random(hi - lo) * 3
            local.extend(d, p)
            sharded.extend(d, p)
        for step in range(8):
            a, b = sharded.sample(64, stratified=stratified), local.sample(64, stratified=stratified)
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a.generations, b.generations)
            np.testing.assert_array_equal(a.probabilities, b.probabilities)
            np.testing.assert_allclose(a.weights, b.weights, rtol=1e-6)
            assert sorted(a) == sorted(b)
            for name in b:
                np.testing.assert_array_equal(a[name], b[name])
            td = rng.random(64) * 2
            sharded.update_priorities(a, td)
            local.update_priorities(b, td)
            if step == 4:  # overwrite some sampled slots: their updates must be skipped in both
                d = _data(range(1000, 1050), seed=step)
                local.extend(d)
                sharded.extend(d)
        assert len(sharded) == len(local)
        assert sharded.total_priority == pytest.approx(local.total_priority, rel=1e-12)
        if weight_norm == "batch":
            _bad_input_raises_before_anything_is_sent(sharded)


def _bad_input_raises_before_anything_is_sent(buf):
    n = len(buf)
    with pytest.raises(ValueError, match="shape"):
        buf.add(x=np.zeros(4, np.float32), id=1)
    b = buf.sample(4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        buf.update_priorities(b, [1.0, np.nan, 1.0, 1.0])
    with pytest.raises(IndexError, match="out of range"):
        buf.update_priorities(np.array([buf.capacity]), [1.0])
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(0)
    with pytest.raises(TypeError, match="writer"):
        import pickle

        pickle.dumps(buf)
    assert len(buf) == n
    with pytest.raises(ValueError, match="num_shards"):
        ShardedPrioritizedBuffer(0, 100, FIELDS)


def test_uneven_shards_sample_the_global_law(cluster):
    per, scales, alpha = 40, (1.0, 10.0, 100.0), 1.0
    rng = np.random.default_rng(3)
    prios = np.concatenate([rng.uniform(0.5, 1.5, per) * s for s in scales])
    with ShardedPrioritizedBuffer(3, 3 * per, FIELDS, alpha=alpha, eps=0.0, beta=0.6, seed=5,
                                  chunk_size=per, **SMALL) as buf:
        buf.extend(_data(range(3 * per)), prios)  # chunk k -> shard k, round robin
        info = buf.shard_info()
        totals = [i["total_priority"] for i in info]
        assert totals[2] > 50 * totals[0]
        leaves = prios ** alpha
        exact = leaves / leaves.sum()
        counts = np.zeros(3 * per)
        for _ in range(12):
            batch = buf.sample(4096)
            ids = batch["id"]
            np.add.at(counts, ids, 1)
            np.testing.assert_allclose(batch.probabilities, exact[ids], rtol=1e-12)
            want = (exact[ids] / exact.min()) ** -0.6  # (N P)^-b over the largest (N P_min)^-b
            np.testing.assert_allclose(batch.weights, want, rtol=1e-5)
            # Indices name the shard and slot the id lives at.
            shard = np.searchsorted(buf.shard_offsets, batch.indices, side="right") - 1
            np.testing.assert_array_equal(shard, ids // per)
        n = counts.sum()
        assert counts[:per].sum() / n == pytest.approx(exact[:per].sum(), rel=0.1)
        chi = scipy_stats.chisquare(counts, exact * n)
        assert chi.pvalue > 1e-4, chi
        # Pipelined totals (one round trip): the same law while nothing changes.
        buf.fresh_totals = False
        for _ in range(3):
            batch = buf.sample(1024)
            np.testing.assert_allclose(batch.probabilities, exact[batch["id"]], rtol=1e-12)
        # After an update the split between shards lags one call behind; the
        # probabilities reported are still those the draw followed: they match
        # the leaves within each shard.
        buf.update_priorities(np.arange(per), np.full(per, 50.0))  # shard 0 becomes heavy
        batch = buf.sample(1024)
        shard = np.searchsorted(buf.shard_offsets, batch.indices, side="right") - 1
        for k in range(3):
            ids = batch["id"][shard == k]
            if ids.shape[0] > 1:
                new = np.where(ids < per, 50.0, prios[np.minimum(ids, 3 * per - 1)])
                ratio = batch.probabilities[shard == k] / new
                np.testing.assert_allclose(ratio, ratio[0], rtol=1e-9)
        buf.fresh_totals = True
        batch = buf.sample(1024)
        now = np.where(np.arange(3 * per) < per, 50.0, prios)
        np.testing.assert_allclose(batch.probabilities, (now / now.sum())[batch["id"]], rtol=1e-12)


@ray.remote(num_cpus=0.1)
class _Writer:
    def run(self, writer, base: int, n: int) -> int:
        rng = np.random.default_rng(base)
        i = 0
        while i < n:
            if rng.random() < 0.2:  # a slab through extend
                m = min(int(rng.integers(1, 60)), n - i)
                writer.extend(_data(range(base + i, base + i + m), seed=i))
                i += m
            else:
                writer.add(x=rng.random(3).astype(np.float32), id=base + i)
                i += 1
        writer.flush()
        return writer.sent


def test_two_writers_and_a_learner_lose_and_duplicate_nothing(cluster):
    n = 1500
    with ShardedPrioritizedBuffer(2, 4 * n, FIELDS, alpha=1.0, eps=0.0, seed=1, chunk_size=64,
                                  **SMALL) as buf:
        writers = [_Writer.remote() for _ in range(2)]
        runs = [w.run.remote(buf.writer(chunk_size=50 + 20 * k), k * 1_000_000, n)
                for k, w in enumerate(writers)]
        rng = np.random.default_rng(0)
        samples = 0
        while len(ray.wait(runs, num_returns=2, timeout=0)[0]) < 2:
            try:
                batch = buf.sample(32)
            except ValueError:  # nothing written yet
                time.sleep(0.01)
                continue
            buf.update_priorities(batch, rng.uniform(0.1, 2.0, 32))
            samples += 1
        assert ray.get(runs) == [n, n]
        assert samples > 0
        assert len(buf) == 2 * n
        # Equal leaves of exactly 1.0 (alpha=1, eps=0): a stratified batch of
        # len(buf) draws then visits every slot once.
        idx = np.concatenate([buf.shard_offsets[k] + np.arange(i["len"])
                              for k, i in enumerate(buf.shard_info())])
        buf.update_priorities(idx, np.ones(idx.shape[0]))
        ids = np.sort(buf.sample(2 * n)["id"])
        want = np.sort(np.concatenate([np.arange(n), 1_000_000 + np.arange(n)]))
        np.testing.assert_array_equal(ids, want)
        for w in writers:
            ray.kill(w)


def _wait_for(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_save_load_and_a_killed_shard(cluster, tmp_path):
    """Save, load (exact resume), then kill shards of the loaded buffer: one
    restarts from the snapshot it was loaded from, one stays dead."""
    kw = dict(seed=11, beta=bigper.LinearSchedule(0.4, 1.0, 10), chunk_size=90)
    rng = np.random.default_rng(4)
    with ShardedPrioritizedBuffer(2, 900, FIELDS, **kw, **SMALL) as buf:
        buf.extend(_data(range(700)), rng.random(700))
        for _ in range(3):
            buf.update_priorities(buf.sample(32), rng.random(32))
        buf.save(tmp_path / "snap")
        with pytest.raises(FileExistsError):
            buf.save(tmp_path / "snap")
        snap_lens = [i["len"] for i in buf.shard_info()]
        td = rng.random((4, 32))
        want = []
        for k in range(4):
            b = buf.sample(32)
            want.append(b)
            buf.update_priorities(b, td[k])

    with ShardedPrioritizedBuffer.load(tmp_path / "snap", **SMALL) as buf:
        assert buf.num_shards == 2 and buf.capacity == 900
        for k in range(4):
            b = buf.sample(32)
            np.testing.assert_array_equal(b.indices, want[k].indices)
            np.testing.assert_array_equal(b.weights, want[k].weights)
            np.testing.assert_array_equal(b["id"], want[k]["id"])
            buf.update_priorities(b, td[k])

        buf.extend(_data(range(700, 800)))  # after the snapshot: lost with the shard
        before = buf.sample(64)
        victim = 1
        lo, hi = buf.shard_offsets[victim], buf.shard_offsets[victim + 1]
        ray.kill(buf.shard_actors[victim], no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # sampling goes on through the restart
            buf.sample(64)
            info = buf.shard_info()[victim]
            if info and info["epoch"]:
                break
        assert info["len"] == snap_lens[victim]
        assert info["restored_from"].endswith("shard-1")
        restored_total = info["total_priority"]
        assert ((before.indices >= lo) & (before.indices < hi)).any()  # the update below reaches it
        buf.update_priorities(before, np.full(64, 5.0))  # rows of the dead incarnation are skipped

        def drawn_from_victim():
            b = buf.sample(256)
            return ((b.indices >= lo) & (b.indices < hi)).any()

        _wait_for(drawn_from_victim, timeout=30)  # the update rode on these calls
        # Rows sampled from the dead incarnation carried its epoch: the restarted
        # shard applied none of them, even where its slots hold the same rows again.
        assert buf.shard_info()[victim]["total_priority"] == restored_total

        # A shard that stays down: sampling goes on over the live one, with
        # probabilities correct over it.
        ray.kill(buf.shard_actors[0], no_restart=True)
        time.sleep(0.5)
        for _ in range(3):
            b = buf.sample(128)
            assert ((b.indices >= lo) & (b.indices < hi)).all()
        assert len(buf) == snap_lens[victim]
        assert buf.total_priority == pytest.approx(buf.shard_info()[victim]["total_priority"])
        buf.update_priorities(lo + np.arange(snap_lens[victim]), np.ones(snap_lens[victim]))
        b = buf.sample(128)
        np.testing.assert_allclose(b.probabilities, 1.0 / snap_lens[victim], rtol=1e-9)
        np.testing.assert_allclose(b.weights, 1.0, rtol=1e-6)

        # Every shard gone: sampling says so (not "nothing written"), within the timeout.
        for bad in (0, -1.0, "soon", True):
            with pytest.raises(ValueError, match="shard_timeout_s"):
                buf.shard_timeout_s = bad
        buf.shard_timeout_s = 1.0
        ray.kill(buf.shard_actors[victim], no_restart=True)
        _wait_for(lambda: buf.shard_info()[victim] is None, timeout=30)  # ray.kill is asynchronous
        t = time.monotonic()
        with pytest.raises(bigper.ShardUnavailableError, match="none of the 2 shard"):
            buf.sample(8)
        assert time.monotonic() - t < 10


def test_a_sharded_buffer_takes_the_one_beta_rule_and_refuses_own_names(cluster):
    """Issue 40 causes 1 and 6: a field named like one of bigper's arrays is refused
    before any shard starts; ``sample(beta=)`` takes what ``schedules.as_beta``
    takes (it had a rule of its own: any float >= 0, a raw OverflowError for 10**400)."""
    from fractions import Fraction

    from bigper.errors import InvalidArgumentError, InvalidTypeError

    with pytest.raises(InvalidArgumentError, match="'status'.*names taken are"):
        ShardedPrioritizedBuffer(2, 40, {**FIELDS, "status": ((), np.int64)}, **SMALL)
    with ShardedPrioritizedBuffer(2, 40, FIELDS, seed=3, chunk_size=10, **SMALL) as buf:
        buf.extend(_data(range(40)), np.linspace(0.5, 2.0, 40))
        for bad, error in ((10**400, InvalidArgumentError), (1.5, InvalidArgumentError),
                           (float("nan"), InvalidArgumentError), (True, InvalidTypeError), ("0.5", InvalidTypeError)):
            step = buf.beta
            with pytest.raises(error, match="beta"):
                buf.sample(8, beta=bad)
            assert buf.beta == step
        for good in (np.float32(0.5), Fraction(1, 2), np.array(0.5)):
            assert buf.sample(8, beta=good).weights.shape == (8,)
