"""Offline datasets: D4RL-layout and bigper HDF5 files opened in place, sidecar priorities,
reprioritize (chi-square, resume after an exception), bad input, the command line."""

import hashlib
import json

import h5py
import numpy as np
import pytest
from scipy import stats

import bigper
from bigper.offline.datasets import OfflineDatasetError, SidecarMismatchError, describe

PRB = bigper.PrioritizedReplayBuffer


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


LAYOUTS = {  # how each array is stored: h5py create_dataset options from the array's shape
    "contiguous": lambda shape: {},
    "chunked": lambda shape: {"chunks": (4, *shape[1:])},
    "gzip": lambda shape: {"chunks": (8, *shape[1:]), "compression": "gzip"},
    "lzf-shuffle": lambda shape: {"chunks": True, "shuffle": True, "compression": "lzf"},
    "split-rows": lambda shape: {"chunks": (5, *(1 for _ in shape[1:]))},  # a chunk holds part of a row
}


def write_d4rl(path, lengths=(7, 5, 9, 4), ends=("terminal", "timeout", "terminal", "timeout"),
               next_obs=True, extras=True, layout="contiguous"):
    """A D4RL-layout file. ``observations[i] = [episode, step, noise]`` so pairs can be checked."""
    opts = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    ep = np.concatenate([np.full(n, e) for e, n in enumerate(lengths)])
    t = np.concatenate([np.arange(n) for n in lengths])
    n = ep.shape[0]
    obs = np.stack([ep, t, rng.normal(size=n)], axis=1).astype(np.float32)
    nxt = np.stack([ep, t + 1, rng.normal(size=n)], axis=1).astype(np.float32)
    last = np.cumsum(lengths) - 1
    term = np.zeros(n, dtype=np.float32)
    tout = np.zeros(n, dtype=bool)
    for i, kind in zip(last, ends):
        (term if kind == "terminal" else tout)[i] = 1
    data = {"observations": obs, "actions": rng.normal(size=(n, 2)).astype(np.float32),
            "rewards": rng.normal(size=n).astype(np.float32), "terminals": term, "timeouts": tout}
    if next_obs:
        data["next_observations"] = nxt
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v, **opts(v.shape))
        if extras:
            f.create_dataset("infos/qpos", data=rng.normal(size=(n, 4)), **opts((n, 4)))
            f.create_dataset("metadata/algorithm", data=np.arange(3))  # not per step: skipped
    return data


@pytest.fixture
def d4rl(tmp_path):
    path = tmp_path / "hopper.hdf5"
    return path, write_d4rl(path)


def check_rows(batch, data):
    i = batch.indices
    assert np.array_equal(batch["obs"], data["observations"][i])
    assert np.array_equal(batch["action"], data["actions"][i])
    assert np.array_equal(batch["reward"], data["rewards"][i])
    assert np.array_equal(batch["terminated"], data["terminals"][i] != 0)
    assert np.array_equal(batch["truncated"], data["timeouts"][i])
    assert np.array_equal(batch["discount"], np.where(data["terminals"][i] != 0, 0.0, 0.99).astype(np.float32))


# -- D4RL layout -----------------------------------------------------------------------
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_d4rl_with_next_observations(tmp_path, layout):
    path = tmp_path / "d.hdf5"
    data = write_d4rl(path, layout=layout)
    mapped = "via h5py" not in describe(path)
    assert mapped == (layout in ("contiguous", "chunked"))
    before = sha256(path)
    with PRB.from_hdf5(path, seed=1) as buf:
        n = data["observations"].shape[0]
        assert len(buf) == buf.capacity == n
        assert buf.total_priority == pytest.approx(n * (1 + 1e-6) ** 0.6)
        for _ in range(20):
            b = buf.sample(16)
            check_rows(b, data)
            assert np.array_equal(b["next_obs"], data["next_observations"][b.indices])
            assert b["infos_qpos"].shape == (16, 4)
        assert "metadata_algorithm" not in b
        # unsorted, repeated and scalar reads of the storage directly
        idx = np.array([5, 1, 5, n - 1, 0])
        assert np.array_equal(buf.storage.read("obs", idx), data["observations"][idx])
        assert np.array_equal(buf.storage.read("obs", np.int64(3)), data["observations"][3])
    assert sha256(path) == before


def test_d4rl_without_next_observations(tmp_path):
    path = tmp_path / "d.hdf5"
    lengths = (7, 5, 9, 4, 6)
    data = write_d4rl(path, lengths=lengths, ends=("terminal", "timeout", "terminal", "timeout", "none"),
                      next_obs=False)
    obs = data["observations"]
    n = obs.shape[0]
    last = np.cumsum(lengths) - 1
    unknown = {int(last[1]), int(last[3]), n - 1}  # ended by timeout, and the file's unfinished end
    with PRB.from_hdf5(path, seed=0) as buf:
        assert len(buf) == n
        assert set(np.flatnonzero(buf.prioritization.tree.leaves == 0).tolist()) == unknown
        seen = set()
        for _ in range(200):
            b = buf.sample(32)
            check_rows(b, data)
            seen.update(b.indices.tolist())
            term = data["terminals"][b.indices] != 0
            # a consecutive pair of one episode, or a terminal's placeholder (its own row)
            want = np.where(term[:, None], obs[b.indices], obs[np.minimum(b.indices + 1, n - 1)])
            assert np.array_equal(b["next_obs"], want)
            assert np.all(b["next_obs"][~term, 0] == b["obs"][~term, 0])
            assert np.all(b["next_obs"][~term, 1] == b["obs"][~term, 1] + 1)
        assert not seen & unknown
        assert len(seen) == n - len(unknown)
    text = describe(path)
    assert "d4rl layout" in text and f"transitions: {n}" in text and "timeout" in text


def test_d4rl_timeouts_keep_bootstrap(d4rl):
    path, data = d4rl
    with PRB.from_hdf5(path, gamma=0.9) as buf:
        idx = np.flatnonzero(data["timeouts"])
        b = buf.shard.sample_at(np.cumsum(buf.prioritization.tree.leaves)[idx] - 0.5, beta=0.4)
        assert np.array_equal(b.indices, idx)
        assert b["truncated"].all() and not b["terminated"].any()
        assert np.allclose(b["discount"], 0.9)


@pytest.mark.parametrize("chunk, runs", [(3, True), (1, False)], ids=["few-runs", "per-row-gather"])
def test_chunks_out_of_row_order_are_mapped(tmp_path, chunk, runs):
    """Chunks written last-first sit in the file in reverse: a few runs are read as views,
    many through the per-chunk address table."""
    path = tmp_path / "rev.hdf5"
    data = write_d4rl(path, lengths=(50, 40, 30), ends=("terminal", "timeout", "terminal"), next_obs=False)
    with h5py.File(path, "a") as f:
        obs = f["observations"][()]
        del f["observations"]
        d = f.create_dataset("observations", shape=obs.shape, dtype=obs.dtype, chunks=(chunk, 3))
        for a in reversed(range(0, obs.shape[0], chunk)):
            d[a:a + chunk] = obs[a:a + chunk]
    with PRB.from_hdf5(path) as buf:
        col = buf.storage.columns["obs"]
        assert col.mapped_all and (col.runs is not None) == runs
        assert col.runs is None or len(col.runs) == -(-obs.shape[0] // chunk)
        for _ in range(20):
            b = buf.sample(16)
            check_rows(b, data)
            term = data["terminals"][b.indices] != 0
            nxt = np.where(term[:, None], obs[b.indices], obs[np.minimum(b.indices + 1, obs.shape[0] - 1)])
            assert np.array_equal(b["next_obs"], nxt)
        idx = np.arange(10, 40)  # a run across chunks and runs
        assert np.array_equal(buf.storage.read("obs", idx), obs[idx])


def test_long_runs_of_rows_in_every_run_are_read_with_pread(tmp_path):
    """Rows of 8 KiB in chunks laid out in two runs (the second half of the rows written
    first): a run of consecutive rows past 64 KiB is read with pread at its run's offset,
    a short one copied from the map; both equal h5py's rows."""
    path = tmp_path / "two-runs.hdf5"
    write_d4rl(path, lengths=(30, 34), ends=("terminal", "timeout"), next_obs=False, extras=False)
    n = 64
    obs = np.random.default_rng(1).normal(size=(n, 2048)).astype(np.float32)
    with h5py.File(path, "a") as f:
        del f["observations"]
        d = f.create_dataset("observations", shape=obs.shape, dtype=obs.dtype, chunks=(4, 2048))
        d[32:] = obs[32:]
        d[:32] = obs[:32]
    with PRB.from_hdf5(path) as buf:
        src = buf.storage
        col = src.columns["obs"]
        assert col.runs is not None and len(col.runs) == 2 and col.runs_offset[1] < col.runs_offset[0]
        calls = []
        real = src._pread
        src._pread = lambda off, out: (calls.append((off, out.shape[0])), real(off, out))[1]
        for idx in (np.arange(5, 29), np.arange(36, 60), np.arange(3, 6), np.arange(33, 36)):
            assert np.array_equal(src.read("obs", idx), obs[idx]), idx
        assert [c[1] for c in calls] == [24, 24]  # only the long runs, one pread each
        assert np.array_equal(src.read("obs", np.arange(20, 50)), obs[20:50])  # across both runs


@pytest.mark.parametrize("fill", [0, 7])
def test_unwritten_chunks_read_as_the_fill_value(tmp_path, fill):
    """Chunks never written: the map serves zeros for fill 0, h5py the fill value otherwise."""
    path = tmp_path / "sparse.hdf5"
    data = write_d4rl(path, extras=False, next_obs=False)
    with h5py.File(path, "a") as f:
        del f["observations"]
        d = f.create_dataset("observations", shape=(25, 3), dtype="f4", chunks=(4, 3), fillvalue=fill)
        d[0:4] = data["observations"][0:4]  # the first and last rows written (the map's own
        d[20:25] = data["observations"][20:25]  # check reads those), chunks between never
        want = d[()]
    assert (want[4:20] == fill).all() and np.array_equal(want[:4], data["observations"][:4])
    with PRB.from_hdf5(path) as buf:
        assert buf.storage.columns["obs"].mapped_all == (fill == 0)
        assert np.array_equal(buf.storage.read("obs", np.arange(25)), want)
        rows = np.array([0, 1, 5, 9, 13, 21, 24, 24])
        assert np.array_equal(buf.storage.read("obs", rows), want[rows])


def test_big_endian_and_bool_datasets(tmp_path):
    path = tmp_path / "be.hdf5"
    n = 12
    with h5py.File(path, "w") as f:
        f["observations"] = np.arange(n * 2, dtype=">f8").reshape(n, 2)
        f["actions"] = np.arange(n, dtype=">i4")
        f["rewards"] = np.ones(n, dtype=np.float32)
        f["terminals"] = np.zeros(n, dtype=bool)
        f["timeouts"] = np.arange(n) % 4 == 3
        f["next_observations"] = np.arange(n * 2, dtype=">f8").reshape(n, 2) + 2
    with PRB.from_hdf5(path) as buf:
        b = buf.sample(8)
        assert b["obs"].dtype == np.float64 and b["obs"].dtype.isnative
        assert np.array_equal(b["obs"][:, 0], 2.0 * b.indices)
        assert np.array_equal(b["action"], b.indices)
        assert np.array_equal(b["truncated"], b.indices % 4 == 3)


# -- read-only data, priorities ----------------------------------------------------------
def test_data_is_read_only_but_priorities_update(d4rl):
    path, data = d4rl
    before = sha256(path)
    with PRB.from_hdf5(path) as buf:
        row = {"obs": data["observations"][0], "action": data["actions"][0], "reward": data["rewards"][0],
               "infos_qpos": np.zeros(4), "next_obs": data["observations"][1]}
        with pytest.raises(ValueError, match="read-only|read_only"):
            buf.add(**row)
        with pytest.raises(ValueError, match="read-only|read_only"):
            buf.extend({k: np.asarray(v)[None] for k, v in row.items()})
        assert len(buf) == data["observations"].shape[0]
        b = buf.sample(4)
        buf.update_priorities(b, np.full(4, 3.0))
        assert np.allclose(buf.prioritization.tree.leaves[b.indices], (3.0 + 1e-6) ** 0.6)
    assert sha256(path) == before
    # the changed leaves went to the sidecar at close; reopening resumes them
    with PRB.from_hdf5(path) as again:
        assert np.allclose(again.prioritization.tree.leaves[b.indices], (3.0 + 1e-6) ** 0.6)
        assert again.total_priority == pytest.approx(buf.total_priority)


def test_saved_leaves_need_the_same_transform(d4rl, tmp_path):
    path, _ = d4rl
    with PRB.from_hdf5(path) as buf:
        buf.update_priorities(np.array([0, 1]), np.array([5.0, 7.0]))
    with pytest.warns(UserWarning, match="alpha=0.6.*not used with alpha=0.9"):
        other = PRB.from_hdf5(path, alpha=0.9)
    with other:  # neither scores nor usable leaves: uniform
        assert np.array_equal(other.prioritization.tree.leaves, (other.status == 1).astype(float))
    (tmp_path / "afile").write_text("")
    with pytest.raises(SidecarMismatchError, match="is a file"):
        PRB.from_hdf5(path, priorities=tmp_path / "afile")


def scores_of(batch):
    return np.abs(batch["reward"]).astype(np.float64) + 0.1 * (batch.indices % 3)


def test_reprioritize_chi_square_and_source_unchanged(d4rl):
    path, data = d4rl
    before = sha256(path)
    n = data["observations"].shape[0]
    with PRB.from_hdf5(path, seed=7, alpha=0.7) as buf:
        buf.reprioritize(scores_of, batch_size=6, progress=False)
        want = (np.abs(data["rewards"]).astype(np.float64) + 0.1 * (np.arange(n) % 3) + 1e-6) ** 0.7
        assert np.allclose(buf.prioritization.tree.leaves, want)
        draws = 60_000
        counts = np.zeros(n)
        for _ in range(draws // 500):
            np.add.at(counts, buf.sample(500, stratified=False).indices, 1)
        p = stats.chisquare(counts, want / want.sum() * draws).pvalue
        assert p > 1e-4, p
    assert sha256(path) == before
    with PRB.from_hdf5(path, alpha=0.7) as again:  # the sidecar's scores come back
        assert np.allclose(again.prioritization.tree.leaves, want)
    with PRB.from_hdf5(path, alpha=1.0) as other:  # raw scores: another alpha transforms them anew
        assert np.allclose(other.prioritization.tree.leaves, want ** (1 / 0.7), rtol=1e-6)


@pytest.mark.parametrize("batch_size", [7, 8192])
def test_reprioritize_batches_are_the_file_rows(tmp_path, batch_size):
    """Runs of rows are copied from the map, or read with pread when long (8192 rows of 12 bytes)."""
    path = tmp_path / "long.hdf5"
    data = write_d4rl(path, lengths=(12_000, 9_000, 3), ends=("timeout", "terminal", "timeout"), next_obs=False)
    obs = data["observations"]
    seen = []

    def check(batch):
        i = batch.indices
        seen.append(i)
        check_rows(batch, data)
        term = data["terminals"][i] != 0
        assert np.array_equal(batch["next_obs"], np.where(term[:, None], obs[i], obs[np.minimum(i + 1, len(obs) - 1)]))
        return np.ones(batch.size)

    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(check, batch_size=batch_size, progress=False)
        assert np.array_equal(np.concatenate(seen), np.flatnonzero(buf.status == 1))


def test_reprioritize_torch_scores(d4rl):
    torch = pytest.importorskip("torch")
    path, data = d4rl
    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(lambda b: torch.as_tensor(b.to_torch()["reward"]).abs()[:, None], batch_size=8,
                         progress=False)
        assert np.allclose(buf.prioritization.tree.leaves, (np.abs(data["rewards"]).astype(np.float64) + 1e-6) ** 0.6,
                           rtol=1e-6)


def test_interrupted_reprioritize_resumes(tmp_path):
    path = tmp_path / "d.hdf5"
    write_d4rl(path, lengths=(40, 33, 27), ends=("terminal", "timeout", "terminal"), next_obs=False)
    with PRB.from_hdf5(path, priorities=tmp_path / "ref.priorities") as ref:
        ref.reprioritize(scores_of, batch_size=8, progress=False)
        want = ref.prioritization.tree.leaves.copy()
    seen, crash_at = [], [5]

    def flaky(batch):
        seen.append(batch.indices.copy())
        if len(seen) == crash_at[0]:
            raise RuntimeError("model crashed")
        return scores_of(batch)

    buf = PRB.from_hdf5(path)
    before = buf.prioritization.tree.leaves.copy()
    with pytest.raises(RuntimeError, match="model crashed"):
        buf.reprioritize(flaky, batch_size=8, progress=False)
    assert np.array_equal(buf.prioritization.tree.leaves, before)  # priorities unchanged until the end
    buf.close()
    meta = json.loads((tmp_path / "d.hdf5.priorities" / "meta.json").read_text())
    assert meta["partial"]["done"] == 4 * 8 and meta.get("scores") is None
    assert "reprioritize in progress" in describe(path)
    # a new process: reopen, and the next call starts after the last scored chunk
    with PRB.from_hdf5(path) as buf:
        seen.clear()
        crash_at[0] = None
        buf.reprioritize(flaky, batch_size=8, progress=False)
        live = np.flatnonzero(want > 0)
        assert np.array_equal(np.concatenate(seen), live[32:])
        assert np.array_equal(buf.prioritization.tree.leaves, want)
    meta = json.loads((tmp_path / "d.hdf5.priorities" / "meta.json").read_text())
    assert meta["partial"] is None and meta["scores"]["total"] == live.shape[0]
    assert sorted(p.name for p in (tmp_path / "d.hdf5.priorities").iterdir()) == sorted(
        [".lock", "meta.json", meta["scores"]["file"]])
    # restart=True starts over
    with PRB.from_hdf5(path) as buf:
        seen.clear()
        buf.reprioritize(lambda b: seen.append(1) or scores_of(b), batch_size=50,
                                    progress=False, restart=True)
        assert len(seen) == 2


@pytest.mark.parametrize("bad, err, match", [
    (lambda b: np.full(b.size, np.nan), ValueError, r"nan for transition 0 \(slot 0, position 0"),
    (lambda b: np.where(b.indices == 3, -1.0, 1.0), ValueError, r"-1.0 for transition 3 .*>= 0"),
    (lambda b: np.where(b.indices == 2, np.inf, 1.0), ValueError, "inf for transition 2"),
    (lambda b: np.ones(b.size + 1), ValueError, r"shape \(9,\) for a batch of 8"),
    (lambda b: None, TypeError, "returned None"),
    (lambda b: np.array(["a"] * b.size), TypeError, "numbers"),
])
def test_bad_scores_write_nothing(d4rl, bad, err, match):
    path, _ = d4rl
    with PRB.from_hdf5(path) as buf:
        before = buf.prioritization.tree.leaves.copy()
        with pytest.raises(err, match=match):
            buf.reprioritize(bad, batch_size=8, progress=False)
        assert np.array_equal(buf.prioritization.tree.leaves, before)
    assert not (path.parent / "hopper.hdf5.priorities").exists()


def test_bad_arguments(d4rl):
    path, _ = d4rl
    with PRB.from_hdf5(path) as buf:
        with pytest.raises(ValueError, match="batch_size"):
            buf.reprioritize(scores_of, batch_size=0)
        with pytest.raises(TypeError, match="callable"):
            buf.reprioritize(None)
    with pytest.raises(ValueError, match="layout"):
        PRB.from_hdf5(path, layout="rlds")
    with pytest.raises(TypeError, match="from_hdf5"):
        PRB(8, {"x": ((), np.float32)}).reprioritize(scores_of)


def test_bad_datasets(tmp_path):
    with pytest.raises(FileNotFoundError, match="no dataset at"):
        PRB.from_hdf5(tmp_path / "missing.hdf5")
    (tmp_path / "text.hdf5").write_text("not hdf5")
    with pytest.raises(OfflineDatasetError, match="text.hdf5.*cannot be opened as an HDF5 file"):
        PRB.from_hdf5(tmp_path / "text.hdf5")
    p = tmp_path / "norewards.hdf5"
    write_d4rl(p)
    with h5py.File(p, "a") as f:
        del f["rewards"]
    with pytest.raises(OfflineDatasetError, match="'rewards', which is missing"):
        PRB.from_hdf5(p)
    p = tmp_path / "short.hdf5"
    write_d4rl(p)
    with h5py.File(p, "a") as f:
        v = f["actions"][:-1]
        del f["actions"]
        f["actions"] = v
    with pytest.raises(OfflineDatasetError, match="'actions' has 24 rows but 'observations' has 25"):
        PRB.from_hdf5(p)
    p = tmp_path / "other.hdf5"
    with h5py.File(p, "w") as f:
        f["pixels"] = np.zeros(3)
    with pytest.raises(OfflineDatasetError, match="not a D4RL, Minari or bigper"):
        PRB.from_hdf5(p)
    for p in tmp_path.iterdir():
        assert not p.name.endswith(".priorities")


def test_sidecar_of_another_dataset_is_refused(tmp_path):
    a, b = tmp_path / "a.hdf5", tmp_path / "b.hdf5"
    write_d4rl(a)
    write_d4rl(b, lengths=(7, 5, 9, 5))
    with PRB.from_hdf5(a) as buf:
        buf.reprioritize(scores_of, progress=False)
    with pytest.raises(SidecarMismatchError, match="transitions: sidecar 25 != dataset 26"):
        PRB.from_hdf5(b, priorities=tmp_path / "a.hdf5.priorities")
    c = tmp_path / "c.hdf5"  # same length, other episode ends
    write_d4rl(c, ends=("terminal", "terminal", "terminal", "timeout"))
    with pytest.raises(SidecarMismatchError, match="episodes"):
        PRB.from_hdf5(c, priorities=tmp_path / "a.hdf5.priorities")
    assert "does not match" in describe(c, priorities=tmp_path / "a.hdf5.priorities") or \
        "another dataset" in describe(c, priorities=tmp_path / "a.hdf5.priorities")
    (tmp_path / "a.hdf5.priorities" / "meta.json").write_text("{")
    with pytest.raises(bigper.CorruptSnapshotError, match="meta.json"):
        PRB.from_hdf5(a)


def test_corrupt_scores_detected(d4rl):
    path, _ = d4rl
    with PRB.from_hdf5(path) as buf:
        buf.reprioritize(scores_of, progress=False)
    side = path.parent / "hopper.hdf5.priorities"
    f = side / json.loads((side / "meta.json").read_text())["scores"]["file"]
    raw = bytearray(f.read_bytes())
    raw[9] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(bigper.CorruptSnapshotError, match="checksum"):
        PRB.from_hdf5(path)


# -- bigper's own HDF5 layout ------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"n_step": 3}, {"frame_stack": 2}], ids=["plain", "nstep", "frames"])
def test_bigper_layout(tmp_path, kw):
    shape = (2, 6, 6) if "frame_stack" in kw else (6, 6)
    fields = {"obs": (shape, np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
    path = tmp_path / "replay.h5"
    rng = np.random.default_rng(0)
    twin = PRB(50, fields, **kw)
    live = PRB(50, fields, storage="hdf5", path=path, **kw)
    o = rng.integers(0, 255, size=shape, dtype=np.uint8)
    for i in range(70):  # wraps around
        o2 = rng.integers(0, 255, size=shape, dtype=np.uint8)
        if "frame_stack" in kw:
            o2[:-1] = o[1:]
        step = dict(obs=o, action=i, reward=float(i), next_obs=o2, terminated=i % 13 == 12)
        live.add(**step)
        twin.add(**step)
        o = rng.integers(0, 255, size=shape, dtype=np.uint8) if i % 13 == 12 else o2
    live.close()
    before = sha256(path)
    with PRB.from_hdf5(path, seed=3) as buf:
        assert buf.capacity == 50 and len(buf) == len(twin)
        assert np.array_equal(buf.prioritization.tree.leaves > 0, twin.prioritization.tree.leaves > 0)
        for _ in range(10):
            b = buf.sample(32)
            want = twin._gather(b.indices)
            for k in want:
                assert np.array_equal(b[k], want[k]), k
        buf.reprioritize(lambda b: b["reward"].astype(np.float64), batch_size=7, progress=False)
        ok = twin.status == 1
        assert np.allclose(buf.prioritization.tree.leaves[ok], (twin._gather(np.flatnonzero(ok))["reward"] + 1e-6) ** 0.6)
    assert sha256(path) == before
    assert "bigper layout" in describe(path)


def test_bigper_layout_refused_while_a_writer_has_it(tmp_path):
    path = tmp_path / "replay.h5"
    w = PRB(8, {"x": ((), np.float32)}, storage="hdf5", path=path)
    w.add(x=1.0, terminated=False)
    try:
        with pytest.raises(bigper.StorageLockedError, match="open in a writer"):
            PRB.from_hdf5(path)
    finally:
        w.close()


def test_file_open_for_writing_elsewhere_is_refused(d4rl):
    import subprocess
    import sys

    path, _ = d4rl
    with h5py.File(path, "r+"):
        code = f"import bigper; bigper.PrioritizedReplayBuffer.from_hdf5({str(path)!r})"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "StorageLockedError" in r.stderr and "open for writing in another process" in r.stderr


# -- command line ---------------------------------------------------------------------------------
def test_cli_reprioritize(d4rl, tmp_path, monkeypatch, capsys):
    from bigper.cli import main

    path, data = d4rl
    (tmp_path / "myscores.py").write_text(
        "import numpy as np\n\ndef score(batch):\n    return np.abs(batch['reward'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    side = tmp_path / "side"
    assert main(["reprioritize", str(path), "--score", "myscores:score", "--batch-size", "7",
                 "--priorities", str(side), "--no-progress"]) == 0
    assert "25" in capsys.readouterr().out
    with PRB.from_hdf5(path, priorities=side) as buf:
        assert np.allclose(buf.prioritization.tree.leaves, (np.abs(data["rewards"]).astype(np.float64) + 1e-6) ** 0.6)
    assert main(["reprioritize", str(path), "--score", "nocolon"]) == 2
    assert "package.module:function" in capsys.readouterr().err
    assert main(["reprioritize", str(path), "--score", "myscores:nothere", "--no-progress"]) == 2
    assert "nothere" in capsys.readouterr().err
    assert main(["reprioritize", str(tmp_path / "nope.hdf5"), "--score", "myscores:score"]) == 2
    assert "nope.hdf5" in capsys.readouterr().err
