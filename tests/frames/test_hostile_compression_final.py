"""Last attack on compression="zstd" (issue 24): threads while dictionaries are
retrained, a full disk right after a retrain, chunk files replaced by a FIFO
or a symlink, and ``train_dictionary`` at the limits of its input."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigper
import bigper.frames.dictionaries
import bigper.frames.segments
from bigper import BigperError, BufferClosedError

from tests.frames.test_compression import ATARI, Feed
from tests import hook

ROOT = Path(__file__).resolve().parents[2]
GAMES = np.load(ATARI)
POOL = np.concatenate([GAMES[g][:120] for g in ["Pong", "Qbert", "MsPacman", "Breakout"]])
K = 4
CAP = 120


def _always_retrain(monkeypatch, every=24):
    monkeypatch.setattr(bigper.frames.segments, "TRAIN_FRAMES", every)
    monkeypatch.setattr(bigper.frames.dictionaries, "PAYS", -100.0)  # every candidate adopted
    monkeypatch.setattr(bigper.frames.dictionaries, "DRIFT", -100.0)


def _make(tmp, storage, name="r"):
    kw = {} if storage == "memory" else {"path": tmp / (name + (".h5" if storage == "hdf5" else ""))}
    return bigper.PrioritizedReplayBuffer(
        CAP, {"obs": ((K, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=K, storage=storage,
        compression="zstd", compression_budget=1500, seed=0, **kw)


class Calls:
    """Public methods on a compressed buffer; each add brings new frames (a retrain every few calls)."""

    def __init__(self, tmp, feed):
        self.tmp, self.feed = tmp, feed
        self.feed_lock = threading.Lock()  # the reference feed is the test's, not the buffer's
        self.saves = itertools.count()
        self.rng = np.random.default_rng(0)
        self.closed_at = None

    def add(self, buf, k):
        with self.feed_lock:
            self.feed.run(buf, 6)

    def sample(self, buf, k):
        b = buf.sample(16)
        self.check(buf, b)

    def sampler(self, buf, k):
        it = buf.sampler(8, prefetch=2)
        try:
            b = next(it)
        finally:
            it.close()
        self.check(buf, b)

    def update(self, buf, k):
        b = buf.sample(8)
        buf.update_priorities(b, self.rng.random(8) + 0.1)

    def state(self, buf, k):
        buf.state_dict()

    def save(self, buf, k):
        buf.save(self.tmp / f"snap-{next(self.saves)}")

    def close(self, buf, k):
        if k == 3:
            with buf._guard.lock:
                if not buf.closed:
                    self.closed_at = len(buf)
                buf.close()

    def check(self, buf, b):
        # exact bytes: every sampled stack is the one added under its step number
        with self.feed_lock:
            for i, s in enumerate(b["step"]):
                obs, nxt = self.feed.added[int(s)]
                assert np.array_equal(b["obs"][i], obs), f"step {int(s)}: other obs bytes"
                assert np.array_equal(b["next_obs"][i], nxt), f"step {int(s)}: other next_obs bytes"


METHODS = [m for m in vars(Calls) if not m.startswith("_") and m != "check"]


def hammer(buf, calls, names, rounds=6):
    errors = []

    def run(name):
        for k in range(rounds):
            try:
                getattr(calls, name)(buf, k)
            except BufferClosedError:
                pass
            except BigperError as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
            except AssertionError as e:
                errors.append(f"{name}: {e}")
            except Exception as e:  # noqa: BLE001
                errors.append(f"{name}: raw {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    return errors


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(pair=st.tuples(st.sampled_from(["add"]), st.sampled_from(METHODS)),
       storage=st.sampled_from(["memory", "memmap", "hdf5"]))
def test_two_threads_on_a_compressed_buffer_while_dictionaries_are_retrained(tmp_path_factory, pair, storage):
    mp = pytest.MonkeyPatch()
    try:
        _always_retrain(mp)
        tmp = tmp_path_factory.mktemp("pair")
        buf = _make(tmp, storage)
        feed = Feed(POOL, K)
        feed.run(buf, 40)
        gen0 = hook.log(buf).dicts.hi
        calls = Calls(tmp, feed)
        errors = hammer(buf, calls, pair)
        assert not errors, errors
        if buf.closed:
            assert len(buf) == calls.closed_at
            return
        assert hook.log(buf).dicts.hi > gen0  # retrains happened during the race
        problems = buf.prioritization.check(buf.status)
        assert not problems, problems
        calls.check(buf, buf.sample(64))
        buf.close()  # (a disk buffer's snapshot resumes onto its own path)
        # every snapshot taken during the race loads exactly; each goes back onto its own path, over the
        # buffer closed there with more transitions than it holds: a rewind, asked for by name
        for i in range(next(calls.saves)):
            with bigper.PrioritizedReplayBuffer.load(tmp / f"snap-{i}", rewind=True) as back:
                calls.check(back, back.sample(32))
    finally:
        mp.undo()


# -- train_dictionary at the limits of its input --------------------------------

def _in_a_small_process(code: str, limit_gb: float = 1.5, timeout: int = 120):
    """Run ``code`` in a fresh interpreter whose address space is capped (a
    whole-array copy of a huge view fails there instead of eating the machine)."""
    prog = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({int(limit_gb * 2**30)},) * 2)\n"
            "import numpy as np, bigper\n" + code)
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("rows", [2**31, 2**32 + 2])
def test_train_dictionary_on_a_view_of_billions_of_rows_copies_only_what_it_trains_on(rows):
    """A broadcast view of 2**31 frames takes no memory; train_dictionary copied
    all of it and a size per row (16 GiB more) before zstd saw it, and zstd counts
    samples in 32 bits (2**32 + 2 rows were 2). It trains on an even thinning."""
    code = (f"pool = np.random.default_rng(0).integers(0, 4, (1, 2, 512), dtype=np.uint8)\n"
            f"x = np.broadcast_to(pool, ({rows}, 2, 512))\n"
            "try:\n"
            "    bigper.train_dictionary(x)\n"
            "    print('TRAINED')\n"
            "except bigper.InvalidArgumentError as e:\n"
            "    assert 'frames' in str(e), e\n"
            "    print('REFUSED', e)\n")
    rc, out = _in_a_small_process(code)
    assert rc == 0 and ("TRAINED" in out or "REFUSED" in out), out[-2000:]



# -- a FIFO, a symlink or a sparse file in place of a compressed storage's files --

def _memmap_folder(tmp):
    buf = _make(tmp, "memmap")
    Feed(POOL, K).run(buf, 80)
    buf.close()
    return tmp / "r"


def _replace(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif how == "symlink":
        other = path.parent.parent / ("moved-" + path.name)
        path.rename(other)
        path.symlink_to(other)
    elif how == "sparse":  # a claimed size far past what is on disk
        os.truncate(path, size + (1 << 30))
    elif how == "truncated":
        os.truncate(path, size // 2)


def _verify(folder: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "bigper", "verify", str(folder)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return r.returncode, r.stdout + r.stderr


@pytest.mark.parametrize("member", ["data/frame_log.bin", "data/frame_index.bin", "state/frames_dict.npy",
                                    "state/frames_seg_first.npy"])
@pytest.mark.parametrize("how", ["fifo", "symlink", "truncated"])
def test_a_fifo_symlink_or_short_file_in_a_compressed_folder_is_refused_naming_it(tmp_path, member, how):
    from tests._hostile_snapshot_cases import fingerprint as files

    folder = _memmap_folder(tmp_path)
    _replace(folder / member, how)
    before = files(tmp_path)
    rc, out = _verify(folder)  # (a FIFO opened for reading would hang: the timeout fails the test)
    assert rc != 0 and "OK " not in out, out
    assert str(folder / member) in out, out  # the user's path, not /proc/self/fd/N
    assert "/proc/self/fd" not in out, out
    with pytest.raises(BigperError) as e:
        bigper.PrioritizedReplayBuffer(
            CAP, {"obs": ((K, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=K, storage="memmap",
            path=folder, mode="resume", compression="zstd", compression_budget=1500)
    assert str(folder / member) in str(e.value) and "/proc/self/fd" not in str(e.value), str(e.value)
    assert files(tmp_path) == before


# -- a full disk right after a retrain -----------------------------------------

@pytest.mark.parametrize("storage", ["memmap", "hdf5"])
def test_a_full_disk_right_after_a_retrain_is_an_oserror_with_nothing_changed(small_tmpfs, storage, monkeypatch):
    """The buffer lives on a 3 MB tmpfs; dictionaries were just retrained (the
    new one is in memory only). The disk fills: a save next to it is an
    OSError naming the path, the buffer and the disk are as before, and once
    space is back the save works and its snapshot holds the retrained
    dictionaries (every sampled stack exact)."""
    from tests._hostile_snapshot_cases import fingerprint as files
    from tests.conftest import fill_disk
    from tests.buffer.test_validation import assert_same, fingerprint

    _always_retrain(monkeypatch)
    buf = bigper.PrioritizedReplayBuffer(
        60, {"obs": ((K, 84, 84), np.uint8), "step": ((), np.int64)}, frame_stack=K, storage=storage,
        compression="zstd", compression_budget=700, seed=0,  # (600 keeps no stack of K + 1 raw frames)
        path=small_tmpfs / ("r.h5" if storage == "hdf5" else "r"))
    feed = Feed(POOL, K)
    feed.run(buf, 70)
    before = fingerprint(buf)  # (its state_dict applies the look in flight: as a save would)
    gens = (hook.log(buf).dicts.lo, hook.log(buf).dicts.hi)
    assert gens[1] >= 2
    filler = small_tmpfs / "filler"
    fill_disk(filler)
    on_disk = files(small_tmpfs)
    snap = small_tmpfs / "snap"
    with pytest.raises(OSError) as e:
        buf.save(snap)
    assert str(snap) in str(e.value), str(e.value)
    assert_same(before, fingerprint(buf))
    assert files(small_tmpfs) == on_disk
    filler.unlink()
    buf.save(snap)
    buf.close()  # (the snapshot resumes onto the buffer's own path)
    with bigper.PrioritizedReplayBuffer.load(snap) as back:
        assert (hook.log(back).dicts.lo, hook.log(back).dicts.hi) == gens
        b = back.sample(32)
        for i, s in enumerate(b["step"]):
            assert np.array_equal(b["obs"][i], feed.added[int(s)][0])
            assert np.array_equal(b["next_obs"][i], feed.added[int(s)][1])


# -- convert at frame_stack 1 and 16; a given dictionary of 1 MiB --------------

def _d4rl(path, obs, nxt):
    import h5py

    n = obs.shape[0]
    with h5py.File(path, "w") as f:
        f["observations"], f["next_observations"] = obs, nxt
        f["actions"], f["rewards"] = np.arange(n), np.arange(n, dtype=np.float32)
        f["terminals"], f["timeouts"] = np.zeros(n, bool), np.zeros(n, bool)


@pytest.mark.parametrize("k", [1, 16])
def test_convert_at_frame_stack_1_and_16_reads_back_byte_for_byte(tmp_path, k):
    """A converted file of 16-frame stacks could not be opened: from_hdf5 bounded
    every recorded state array by 64 bytes a slot, and the last stack of each
    env (num_envs x k frames) is bigger than that on a small dataset."""
    from tests.offline.test_convert import assert_same_transitions, cli

    fr = GAMES["Pong"][:140]
    idx = np.arange(100)[:, None] + np.arange(k)[None]
    src, dst = tmp_path / "src.h5", tmp_path / "dst.h5"
    _d4rl(src, fr[idx], fr[idx + 1])
    r = cli("convert", "--no-progress", "--frame-stack", k, src, dst)
    assert r.returncode == 0, r.stdout + r.stderr
    data = assert_same_transitions(src, dst)
    assert data["obs"].tobytes() == fr[idx].tobytes()

