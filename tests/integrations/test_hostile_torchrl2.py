"""More hostile use of the TorchRL drop-in: a chdir after construction with a
relative path, dumps into a symlink or read-only folder, loads of folders holding
FIFOs, symlinks or sparse files, priorities at dtype limits, and two threads on
pairs of public methods. Refusals are bigper errors and leave the buffer as it was."""

from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")

from bigper.errors import BigperError  # noqa: E402
from bigper.integrations.torchrl import PrioritizedReplayBuffer  # noqa: E402
from tests.integrations._torchrl_data import stream  # noqa: E402
from tests.integrations.test_hostile_torchrl import fingerprint  # noqa: E402


@pytest.fixture
def rb():
    b = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0)
    b.extend(stream(30))
    return b


def refused(rb, fn, *args, **kw):
    before = fingerprint(rb)
    with pytest.raises(BigperError):
        fn(*args, **kw)
    assert fingerprint(rb) == before


@pytest.fixture
def cwd(tmp_path):
    old = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(old)


# -- chdir after construction with a relative path -----------------------------------------
def test_empty_after_chdir_stays_at_the_path_given(cwd):
    (cwd / "a").mkdir()
    (cwd / "b").mkdir()
    os.chdir(cwd / "a")
    rb = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0, path="live")
    rb.extend(stream(30))
    os.chdir(cwd / "b")
    rb.empty()
    rb.extend(stream(5))
    rb.close()
    assert not (cwd / "b" / "live").exists(), "empty() made a new buffer under the new cwd"


def test_loads_after_chdir_stays_at_the_path_given(cwd):
    (cwd / "a").mkdir()
    (cwd / "b").mkdir()
    os.chdir(cwd / "a")
    rb = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0, path="live")
    rb.extend(stream(30))
    snap = rb.dumps(cwd / "snap")
    os.chdir(cwd / "b")
    rb.loads(snap, rewind=True)
    rb.close()
    assert not (cwd / "b" / "live").exists(), "loads() put the live buffer under the new cwd"


def test_dumps_and_close_after_chdir_with_relative_path(cwd):
    (cwd / "a").mkdir()
    (cwd / "b").mkdir()
    os.chdir(cwd / "a")
    rb = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0, path="live")
    rb.extend(stream(30))
    before = fingerprint(rb)
    os.chdir(cwd / "b")
    snap = rb.dumps("snap")
    assert snap.is_absolute() and str(snap).startswith(str(cwd / "b"))
    assert fingerprint(rb) == before
    rb.close()
    os.chdir(cwd / "a")
    again = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0, path="live", mode="resume")
    assert len(again) == 30
    again.close()


# -- dumps targets ---------------------------------------------------------------------------
def test_dumps_into_a_symlink_to_an_empty_folder(rb, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = fingerprint(rb)
    try:
        out = rb.dumps(tmp_path / "link")
    except BigperError:
        assert fingerprint(rb) == before
        assert not any((tmp_path / "real").iterdir())
        return
    # written: then it must be loadable and equal
    other = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0)
    other.loads(out)
    assert fingerprint(other) == before


def test_dumps_into_a_dangling_symlink(rb, tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    refused(rb, rb.dumps, tmp_path / "dangling")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_dumps_into_a_read_only_folder(rb, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        refused(rb, rb.dumps, ro)
        refused(rb, rb.dumps, ro / "sub")
    finally:
        ro.chmod(0o700)
    assert list(ro.iterdir()) == []


# -- loads of folders with FIFOs, symlinks, sparse files -------------------------------------
def _files(snap):
    return sorted(p for p in snap.rglob("*") if p.is_file())


@pytest.mark.parametrize("how", ["fifo", "symlink", "sparse"])
def test_loads_with_a_special_file_at_each_path(rb, tmp_path, how):
    good = rb.dumps(tmp_path / "good")
    other = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0)
    other.extend(stream(12))
    for i, victim in enumerate(_files(good)):
        case = tmp_path / f"case{i}"
        import shutil
        shutil.copytree(good, case, symlinks=True)
        target = case / victim.relative_to(good)
        size = target.stat().st_size
        target.unlink()
        if how == "fifo":
            os.mkfifo(target)
        elif how == "symlink":
            (tmp_path / f"outside{i}").write_bytes(victim.read_bytes())
            target.symlink_to(tmp_path / f"outside{i}")
        else:
            with open(target, "wb") as f:
                f.truncate(max(size, 1) + (1 << 30))  # a 1 GiB hole
        refused(other, other.loads, case)


# -- priorities at dtype limits -----------------------------------------------------------------
@pytest.mark.parametrize("value,dtype", [
    (65504.0, torch.float16),
    # (was a strict xfail: a finite priority of 1.8e308 made the batch's float32 IS weights exactly 0;
    # a weight is now at least float32's smallest normal number, _tree_kernels.W_MIN)
    (float(np.finfo(np.float64).max), torch.float64),
    (float(np.finfo(np.float32).max), torch.float32),
    (5e-324, torch.float64), (1e-45, torch.float32), (6e-8, torch.float16),
    (2**63 - 1, torch.int64), (-(2**63), torch.int64), (float("inf"), torch.float64)])
def test_priorities_at_dtype_limits(rb, value, dtype):
    s = rb.sample()
    p = torch.full((8,), value, dtype=dtype)
    before = fingerprint(rb)
    try:
        rb.update_priority(s["index"], p)
    except BigperError:
        assert fingerprint(rb) == before
        return
    tot = rb.buffer.total_priority
    assert np.isfinite(tot) and tot > 0, tot
    w = rb.sample()["priority_weight"]
    assert torch.isfinite(w).all() and (w > 0).all(), w
    # and the same through extend's priority_key
    td = stream(4, start=30).set("td_error", torch.full((4,), value, dtype=dtype))
    before = fingerprint(rb)
    try:
        rb.extend(td)
    except BigperError:
        assert fingerprint(rb) == before
        return
    assert np.isfinite(rb.buffer.total_priority)
    w = rb.sample()["priority_weight"]
    assert torch.isfinite(w).all() and (w > 0).all(), w


# -- two threads on pairs of public methods --------------------------------------------------
def _run(*fns):
    errors = []

    def wrap(f):
        def g():
            try:
                f()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        return g
    ts = [threading.Thread(target=wrap(f)) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "deadlock"
    return errors


def test_two_threads_empty_and_sample(rb):
    def emptier():
        for i in range(15):
            rb.empty()
            rb.extend(stream(12, start=100 * i))

    def sampler():
        for _ in range(60):
            try:
                s = rb.sample()
            except BigperError:
                continue
            assert s.batch_size == torch.Size([8])
            assert (s["next", "step_count"] == s["step_count"] + 1).all()
            try:
                rb.update_priority(s["index"], torch.rand(8))
            except BigperError:
                pass
    errors = _run(emptier, sampler)
    assert not errors, errors


def test_two_threads_update_tensordict_priority_and_dumps_loads(rb, tmp_path):
    snaps = []

    def saver():
        for i in range(6):
            snaps.append(rb.dumps(tmp_path / f"s{i}"))
            rb.loads(snaps[-1])

    def learner():
        for _ in range(60):
            s = rb.sample()
            rb.update_tensordict_priority(s.set("td_error", torch.rand(8) + 0.1))
    errors = _run(saver, learner)
    assert not errors, errors
    for snap in snaps:
        other = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0)
        other.loads(snap)
        assert len(other) == 30
        assert np.isfinite(other.buffer.total_priority)


def test_two_threads_extend_and_empty_on_disk(tmp_path):
    rb = PrioritizedReplayBuffer(capacity=40, frame_stack=4, batch_size=8, seed=0, path=tmp_path / "live")
    rb.extend(stream(10))

    def writer():
        for i in range(20):
            rb.extend(stream(5, start=10 + 5 * i))

    def emptier():
        for _ in range(8):
            rb.empty()
    errors = _run(writer, emptier)
    assert not errors, errors
    s = rb.sample(len(rb)) if len(rb) else None
    if s is not None:
        assert (s["next", "step_count"] == s["step_count"] + 1).all()
    rb.close()
