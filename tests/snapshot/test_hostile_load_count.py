"""Hostile tests of ``_check_newer``'s rule for a clean live record whose
transition count does not read as a non-negative int (bigper/snapshot/_load.py):
refused naming ``rewind=True``, nothing changed; ``rewind=True`` loads.

Attacked: counts past the capacity, at 2**62, 2**63, 2**64; a state without
a count key; a legit buffer closed empty at the path (count 0, loads); a
crafted count 0 over a buffer holding 15; the same through
``Snapshots.load_latest`` (newest intact or corrupt: its fallback must not
replace the folder), the SB3 drop-in's ``load_replay_buffer``, TorchRL's
``loads``; memmap and HDF5; two threads loading into one path; a loader
killed (SIGKILL) at each step of a load.

Three cases found bugs when written, all fixed: a crafted count 0 over a
buffer whose status holds 15 live transitions was loaded over; a record
without 'state' was a raw KeyError through SB3; TorchRL's reopen replaced
the load's refusal.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings

import numpy as np
import pytest

import bigper
from bigper.errors import BigperError, PathExistsError, StorageLockedError
from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.snapshot.test_hostile_resume import live_of, run_folder
from tests.snapshot.test_hostile_resume_newer import F, _set, edit_meta, raised_run

load = bigper.PrioritizedReplayBuffer.load
SNAP = "ckpt/snap-00000001"
STORAGES = ["memmap", "hdf5"]


def _refused_untouched(root, call, *, exclude_lock=False):
    before = _fp(root, exclude_lock)
    with deadline(20), pytest.raises(PathExistsError, match="rewind=True"):
        call()
    assert _fp(root, exclude_lock) == before


def _fp(root, exclude_lock=False):
    fp = fingerprint(root)
    return {k: v for k, v in fp.items() if not (exclude_lock and k.endswith(".lock"))}


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("count", [51, 10 ** 6, 2 ** 62, 2 ** 63, 2 ** 64, 10 ** 30])
def test_a_count_past_the_capacity_or_int64_is_refused_untouched_and_rewind_loads(tmp_path, storage, count):
    live = raised_run(tmp_path, storage)
    edit_meta(live, storage, _set(("state", "count"), count))
    _refused_untouched(tmp_path, lambda: load(tmp_path / SNAP))
    b = load(tmp_path / SNAP, rewind=True)
    assert len(b) == 10 and b.state_dict()[0]["count"] == 10
    b.close()


@pytest.mark.parametrize("storage", STORAGES)
def test_a_state_without_a_count_key_is_refused_untouched_and_rewind_loads(tmp_path, storage):
    live = raised_run(tmp_path, storage)
    edit_meta(live, storage, lambda m: m["state"].pop("count"))
    _refused_untouched(tmp_path, lambda: load(tmp_path / SNAP))
    b = load(tmp_path / SNAP, rewind=True)
    assert len(b) == 10
    b.close()


@pytest.mark.parametrize("storage", STORAGES)
def test_a_buffer_closed_empty_at_the_path_is_loaded_over_without_rewind(tmp_path, storage):
    run_folder(tmp_path, storage=storage, live_rel=live_of(storage, tmp_path / "x").name, more=0)
    target = tmp_path / ("empty.h5" if storage == "hdf5" else "empty")
    bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=target, seed=0).close()
    with deadline(20):
        b = load(tmp_path / SNAP, path=target)
    assert len(b) == 10 and b.state_dict()[0]["count"] == 10
    b.close()


@pytest.mark.parametrize("storage", STORAGES)
def test_a_crafted_count_zero_over_a_buffer_holding_more_is_not_silently_loaded_over(tmp_path, storage):
    """(A clean record whose count said 0 while its status held 15 live transitions was taken over.)"""
    live = run_folder(tmp_path, storage=storage, live_rel=live_of(storage, tmp_path).name, more=5).storage.path
    edit_meta(live, storage, _set(("state", "count"), 0))
    before = fingerprint(tmp_path)
    with deadline(20):
        try:
            load(tmp_path / SNAP).close()
        except BigperError:
            assert fingerprint(tmp_path) == before
            return
    raise AssertionError("loaded over a folder holding 15 transitions whose record said 0")


# -- Snapshots.load_latest -----------------------------------------------------------------------

def _series(root, storage, corrupt_newest):
    live = live_of(storage, root)
    snaps = bigper.Snapshots(root / "ckpt")
    b = bigper.PrioritizedReplayBuffer(50, F, storage=storage, path=live, seed=0)
    for t in range(20):
        b.add(obs=[t], reward=1.0, next_obs=[t + 1], terminated=False)
        if t in (9, 13):
            newest = snaps.save(b)
    b.close()
    if corrupt_newest:
        newest = getattr(newest, "path", newest)
        f = max((p for p in newest.rglob("*") if p.is_file() and p.name != "manifest.json"),
                key=lambda p: p.stat().st_size)
        f.write_bytes(b"\xff" * f.stat().st_size)
    return live, snaps


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("corrupt_newest", [False, True])
@pytest.mark.parametrize("count", ["20", None, -1, KeyError])
def test_load_latest_never_replaces_a_folder_whose_count_it_cannot_read(tmp_path, storage, corrupt_newest, count):
    """Newest intact: refused. Newest corrupt: the fallback to the older
    snapshot is refused the same way, the folder byte for byte."""
    live, snaps = _series(tmp_path, storage, corrupt_newest)
    edit_meta(live, storage, _set(("state", "count"), count))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the corrupt newest's fallback warning)
        _refused_untouched(tmp_path, lambda: snaps.load_latest(path=live))
        b = snaps.load_latest(path=live, rewind=True)
    assert len(b) == (10 if corrupt_newest else 14)
    b.close()


# -- the SB3 drop-in and TorchRL ---------------------------------------------------------------------

def _sb3_run(tmp_path):
    pytest.importorskip("stable_baselines3")
    from tests.integrations.test_hostile_sb3_resume import add, dqn
    m = dqn(tmp_path)
    for t in range(8):
        add(m, t, 1.0)
    m.save_replay_buffer(tmp_path / "ckpt" / "rb")
    for t in range(8, 12):
        add(m, t, 1.0)
    m.replay_buffer.close()
    return m



@pytest.mark.parametrize("change", [
    "count-null", "count-str", "count-missing",
    "state-missing",
])
def test_sb3_load_replay_buffer_refuses_an_unreadable_count_and_keeps_the_models_buffer(tmp_path, change):
    m = _sb3_run(tmp_path)
    live = tmp_path / "replay"
    edit_meta(live, "memmap", {"count-null": _set(("state", "count"), None),
                               "count-str": _set(("state", "count"), "12"),
                               "count-missing": lambda mm: mm["state"].pop("count"),
                               "state-missing": lambda mm: mm.pop("state")}[change])
    from tests.integrations.test_hostile_sb3_resume import dqn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m2 = dqn(tmp_path, name="other")
    kept = m2.replay_buffer
    before = fingerprint(live)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl")
        except PathExistsError as e:
            assert "rewind=True" in str(e)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"not a PathExistsError: {type(e).__name__}: {e}") from None
        else:
            raise AssertionError("loaded over a clean folder whose count it could not read")
    assert fingerprint(live) == before
    assert m2.replay_buffer is kept
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m2.load_replay_buffer(tmp_path / "ckpt" / "rb.pkl", rewind=True)
    assert m2.replay_buffer.size() == 8
    m2.replay_buffer.close()


def _torchrl_run(tmp_path):
    pytest.importorskip("torchrl")
    import torch
    from tensordict import TensorDict

    from bigper.integrations.torchrl import PrioritizedReplayBuffer as TRB

    def td(n, s):
        obs = torch.arange(s, s + n, dtype=torch.float32)[:, None].repeat(1, 3)
        nxt = TensorDict({"obs": obs + 1, "reward": torch.ones(n), "done": torch.zeros(n, dtype=torch.bool),
                          "terminated": torch.zeros(n, dtype=torch.bool)}, [n])
        return TensorDict({"obs": obs, "action": torch.zeros(n, dtype=torch.int64), "next": nxt}, [n])
    rb = TRB(capacity=40, batch_size=4, seed=0, path=tmp_path / "tlive")
    rb.extend(td(10, 0))
    (tmp_path / "tsnap").mkdir()
    rb.dumps(tmp_path / "tsnap")
    rb.extend(td(5, 10))
    rb.close()
    return rb


@pytest.mark.parametrize("count", [None, "15", -3])
def test_torchrl_loads_over_an_unreadable_count_is_refused_untouched_and_rewind_loads(tmp_path, count):
    rb = _torchrl_run(tmp_path)
    edit_meta(tmp_path / "tlive", "memmap", _set(("state", "count"), count))
    before = fingerprint(tmp_path / "tlive")
    with deadline(20), pytest.raises(BigperError):
        rb.loads(tmp_path / "tsnap")
    assert fingerprint(tmp_path / "tlive") == before
    rb.loads(tmp_path / "tsnap", rewind=True)
    assert len(rb) == 10
    rb.close()


def test_torchrl_loads_refusal_names_rewind(tmp_path):
    """(Its reopen of the crafted record failing too used to replace the load's refusal.)"""
    rb = _torchrl_run(tmp_path)
    edit_meta(tmp_path / "tlive", "memmap", _set(("state", "count"), None))
    try:
        rb.loads(tmp_path / "tsnap")
    except BigperError as e:
        assert isinstance(e, PathExistsError) and "rewind=True" in str(e), f"{type(e).__name__}: {e}"
    else:
        raise AssertionError("loaded")


# -- two threads, and a loader killed mid-way ----------------------------------------------------------

@pytest.mark.parametrize("storage", STORAGES)
def test_two_threads_loading_into_one_path_whose_count_is_unreadable(tmp_path, storage):
    live = raised_run(tmp_path, storage)
    edit_meta(live, storage, _set(("state", "count"), "x"))
    before = fingerprint(tmp_path)
    errors, loaded = [], []
    go = threading.Barrier(2)

    def one():
        go.wait()
        try:
            loaded.append(load(tmp_path / SNAP))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=one) for _ in range(2)]
    with deadline(30):
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for b in loaded:
        b.close()
    assert not loaded, "a thread loaded over a clean folder whose count it could not read"
    assert all(isinstance(e, (PathExistsError, StorageLockedError)) for e in errors), errors
    assert any(isinstance(e, PathExistsError) for e in errors), errors
    assert fingerprint(tmp_path) == before


def _killed_at(root, point, rewind, storage):
    """Fork; in the child, ``load(SNAP, rewind=rewind)`` with a SIGKILL at
    ``point`` of bigper/snapshot/_load.py (after ``_check_newer`` returned, or
    when ``_allocate``/the storage's ``adopt`` is called). Whether it died."""
    import bigper.snapshot._load as L

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            def die(*a, **k):
                os.kill(os.getpid(), signal.SIGKILL)
            if point == "adopt":
                setattr(L.storage_class(storage), "adopt", die)
            else:
                orig = getattr(L, point)

                def hit(*a, **k):
                    if point == "_check_newer":
                        orig(*a, **k)
                    die()
                setattr(L, point, hit)
            load(root / SNAP, rewind=rewind)
        except BaseException:  # noqa: BLE001
            os._exit(3)
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    return os.WIFSIGNALED(st)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("point", ["_check_newer", "_allocate", "adopt"])
def test_a_loader_killed_mid_way_leaves_the_old_folder_or_one_that_loads(tmp_path, storage, point):
    """rewind=True, killed after the check, at the allocation or at the
    adoption of the snapshot's files: the folder is the old one (only its
    .lock's PID differs: refused again without rewind) or one the next load
    takes over (an unclean record) and that verifies; never a clean record
    claiming what it does not hold."""
    live = raised_run(tmp_path, storage)
    edit_meta(live, storage, _set(("state", "count"), None))
    before = _fp(tmp_path, exclude_lock=True)
    died = _killed_at(tmp_path, point, True, storage)
    if _fp(tmp_path, exclude_lock=True) == before:
        _refused_untouched(tmp_path, lambda: load(tmp_path / SNAP), exclude_lock=True)
    else:
        assert died or point == "adopt", "the load changed the folder but was never killed"
        with deadline(20):
            b = load(tmp_path / SNAP)
        assert len(b) == 10
        b.close()
        from bigper.cli import main
        import contextlib
        import io
        with contextlib.redirect_stdout(io.StringIO()) as out:
            rc = main(["verify", str(live)])
        assert rc == 0, out.getvalue()


@pytest.mark.parametrize("storage", STORAGES)
def test_a_refusal_from_another_process_changes_nothing_but_the_locks_pid(tmp_path, storage):
    """A loader killed right after its refusal was decided (without rewind):
    every byte as it was but ``.lock``, which each opener writes its PID into
    (the in-process tests above compare all of it only because the writer's
    PID is theirs)."""
    live = raised_run(tmp_path, storage)
    edit_meta(live, storage, _set(("state", "count"), None))
    before = _fp(tmp_path, exclude_lock=True)
    _killed_at(tmp_path, "_check_newer", False, storage)  # (refuses: exits 3, never reaches the kill)
    assert _fp(tmp_path, exclude_lock=True) == before
