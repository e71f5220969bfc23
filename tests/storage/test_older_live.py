"""An older bigper's live memmap folder keeps opening (issue 43 section 2).

The committed fixtures ``tests/data/live-v1-refs64-*memmap`` are run folders
an older bigper (23b6758) wrote and closed: its frame references whole
(``obs_ref``, ``next_obs_ref``, int64 x k), ``gid`` and ``frames_minref``
recorded; ``tests/data/make_live_fixtures.py`` wrote them and recorded what
that bigper sampled after a resume. This bigper converts the folder in place
at a writer's resume (journaled in ``meta.json``: a kill -9 at any point
leaves the old folder or the new one, and either resumes), and reads it
converted in memory where it may not write (``read_only``, ``bigper
verify``); every reader gives what the older bigper gave.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper.snapshot import verify
from bigper.snapshot.live import OK, verify_live

from tests._hostile_snapshot_cases import fingerprint

DATA = Path(__file__).resolve().parents[1] / "data"
FOLDERS = ("live-v1-refs64-memmap", "live-v1-refs64-far-memmap")
H5 = "live-v1-refs64-zstd"  # storage="hdf5": one file (tests/offline/test_older_bigper_h5.py: from_hdf5 of it)


def expected(name: str) -> dict:
    return json.loads((DATA / f"{name}.expected.json").read_text())


def copy(name: str, tmp_path: Path) -> Path:
    if (DATA / name).is_dir():
        path = tmp_path / name
        shutil.copytree(DATA / name, path)
        return path
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}.h5"
    shutil.copyfile(DATA / f"{name}.h5", path)
    return path


def open_folder(name: str, path: Path, **kw) -> bigper.PrioritizedReplayBuffer:
    spec = expected(name)["spec"]
    fields = {"obs": ((spec["frame_stack"], *spec["frame"]), np.uint8), "reward": ((), np.float32),
              "action": ((), np.int64)}
    return bigper.PrioritizedReplayBuffer(
        spec["capacity"], fields, path=path, num_envs=spec["num_envs"], frame_stack=spec["frame_stack"], seed=11,
        storage=spec["storage"], compression=spec.get("compression"), n_step=spec["n_step"], alpha=spec["alpha"],
        beta=spec["beta"], mode="resume", **kw)


def later_steps(name: str, n: int = 20):
    """The steps the older bigper added after its resume (make_live_fixtures.py's
    stream, replayed: the same generator and random calls)."""
    sys.path.insert(0, str(DATA))
    try:
        import make_live_fixtures as maker
    finally:
        sys.path.remove(str(DATA))
    spec = maker.FIXTURES[name]
    rng = np.random.default_rng(43)
    gen = maker.steps(rng, spec["steps"] + n, spec["num_envs"], spec["frame"], spec["static"], spec.get("hi", 256))
    for _ in range(spec["steps"]):
        next(gen)
        if rng.random() < 0.3:
            rng.random(4)
    return [next(gen) for _ in range(n)]


def same_batches(buf, batches, update: bool = True) -> None:
    for want in batches:
        got = buf.sample(want["batch_size"])
        assert got.indices.tolist() == want["indices"]
        assert got.weights.tolist() == want["weights"]
        for field, values in want["data"].items():
            assert got[field].tolist() == values, field
        if update:
            buf.update_priorities(got, np.asarray(want["update"]))


def same_far(buf, far: dict) -> None:
    slots = np.asarray(far["slots"], dtype=np.int64)
    fs = buf._frames
    assert fs.stacks("obs_ref", slots).tolist() == far["obs"]
    assert fs.stacks("next_obs_ref", slots).tolist() == far["next_obs"]


def recorded(path: Path) -> dict:
    """What the storage at ``path`` records (its meta.json, or the HDF5 file's /_bigper meta)."""
    if path.is_dir():
        return json.loads((path / "meta.json").read_text())
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f["_bigper"].attrs["meta"])


@pytest.mark.parametrize("name", FOLDERS)
def test_an_older_live_folder_resumes_converted_in_place(name, tmp_path):
    want = expected(name)
    path = copy(name, tmp_path)
    buf = open_folder(name, path, continue_episodes=True)
    assert len(buf) == want["len"] and buf.total_priority == want["total_priority"]
    same_far(buf, want["far"])
    same_batches(buf, want["batches"])
    for step in later_steps(name):  # the writer goes on over the converted references
        buf.add(**step)
    assert len(buf) == want["after_adds"]["len"]
    assert buf.total_priority == want["after_adds"]["total_priority"]
    same_batches(buf, want["after_adds"]["batches"])
    buf.close()
    # the folder is the new format now: no older array or derived state file is left
    meta = recorded(path)
    assert {"frame_ref", "frame_off"} <= set(meta["arrays"]) and not {"obs_ref", "next_obs_ref"} & set(meta["arrays"])
    assert not {"converting", "converted"} & set(meta)
    wide = bool(want["far"]["slots"])  # references further apart than uint8 offsets hold: uint16
    assert meta["arrays"]["frame_off"]["dtype"] == ("<u2" if wide else "|u1")
    assert sorted(p.name for p in (path / "data").iterdir()) == sorted(f"{n}.bin" for n in meta["arrays"])
    assert not {"gid.npy", "frames_minref.npy"} & {p.name for p in (path / "state").iterdir()}
    assert verify_live(path).status == OK
    again = open_folder(name, path, continue_episodes=True)  # and it resumes as the new format
    assert len(again) == want["after_adds"]["len"]
    same_far(again, want["far"])
    snap = again.save(tmp_path / "snap")  # a snapshot of the converted folder keeps its offsets
    again.close()
    assert verify(snap)["problems"] == []
    loaded = bigper.PrioritizedReplayBuffer.load(snap, path=tmp_path / "loaded", continue_episodes=True)
    assert loaded._store.arrays["frame_off"].dtype == meta["arrays"]["frame_off"]["dtype"]
    same_far(loaded, want["far"])
    loaded.close()


def test_an_older_live_folder_converts_into_several_chunk_files(tmp_path):
    """Opened with small chunks, the converted arrays are laid out in several
    chunk files each, named before they exist; the folder resumes again."""
    name = FOLDERS[1]
    want = expected(name)
    path = copy(name, tmp_path)
    buf = open_folder(name, path, continue_episodes=True, storage_options={"chunk_bytes": 4096})
    same_far(buf, want["far"])
    same_batches(buf, want["batches"])
    buf.close()
    meta = recorded(path)
    for array in ("frame_ref", "frame_off"):
        rec = meta["arrays"][array]
        assert rec["chunk_rows"] < rec["rows"] and (path / "data" / f"{array}.000001.bin").is_file(), rec
    assert sorted(p.name for p in (path / "data").iterdir()) == sorted(
        f"{n}.bin" if k == 0 else f"{n}.{k:06d}.bin" for n, r in meta["arrays"].items()
        for k in range(-(-r["rows"] // r["chunk_rows"])))
    again = open_folder(name, path, continue_episodes=True)
    same_far(again, want["far"])
    again.close()


@pytest.mark.parametrize("name", FOLDERS)
def test_an_older_live_folder_is_read_converted_in_memory_where_nothing_may_change(name, tmp_path):
    """``read_only`` and ``bigper verify``: the folder converted in memory, its files untouched."""
    want = expected(name)
    path = copy(name, tmp_path)
    (path / ".lock").write_text(f"{os.getpid()}\n")  # (the lock file a writer of this process made)
    before = fingerprint(path)
    buf = open_folder(name, path, read_only=True)
    assert len(buf) == want["len"] and buf.total_priority == want["total_priority"]
    same_far(buf, want["far"])
    same_batches(buf, want["batches"][:1], update=False)
    buf.close()
    verdict = verify_live(path)
    assert verdict.status == OK, verdict
    assert fingerprint(path) == before


def test_bigper_info_names_an_older_folders_arrays(tmp_path, capsys):
    from bigper.cli import main

    path = copy(FOLDERS[0], tmp_path)
    (path / ".lock").write_text(f"{os.getpid()}\n")  # (the lock file a writer of this process made)
    before = fingerprint(path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "obs_ref" in out and "converted" in out
    assert main(["verify", str(path)]) == 0
    assert fingerprint(path) == before


# -- kill -9 at every file operation of the conversion ----------------------------------------------

# the operations that change what is on disk (a kill before a read is a kill before the next of these)
_OPS = ("write", "pwrite", "fsync", "replace", "rename", "unlink", "link", "posix_fallocate", "mkdir", "ftruncate")


def _child(name: str, path: Path, shm: np.ndarray, step: tuple) -> None:
    """Resume ``path``, SIGKILL-ing this process just before its file
    operation number ``shm[0]`` counted from the start of the conversion's
    step ``step`` (``(module, first function, last function)``: the
    conversion written, ``_relayout.write_new``; the next open clearing what
    an interrupted one left, ``recover``; an HDF5 file's new file written and
    renamed over it, ``_h5relayout.rewrite`` to ``swap``); ``shm[2]``: the
    ops made when the last function returned. The ops are counted, never
    changed."""
    module, first, last = step

    def wrap(mod, op, role=None):
        real = getattr(mod, op)

        def call(*a, **k):
            if role is not None:
                shm[3] |= role == "first"
                out = real(*a, **k)
                if role == "last":
                    shm[2] = shm[2] or shm[1]
                return out
            if shm[3]:
                shm[1] += 1
                if shm[1] == shm[0]:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        setattr(mod, op, call)
    for op in _OPS:
        wrap(os, op)
    if first == last:
        wrap(module, first, "first")
        real = getattr(module, first)

        def both(*a, **k):
            out = real(*a, **k)
            shm[2] = shm[2] or shm[1]
            return out
        setattr(module, first, both)
    else:
        wrap(module, first, "first")
        wrap(module, last, "last")
    buf = open_folder(name, path, continue_episodes=True)
    buf.close()


def _kill_at_each_op(name: str, src: Path, work: Path, step: tuple, shm: np.ndarray) -> list[Path]:
    """A child resumes a copy of ``src`` and is killed at op 1, 2, ... up to
    the op after ``step`` ended; returns the storages left, in order."""
    out, n, last = [], 0, None
    while last is None or n <= last:
        n += 1
        path = work / f"t{n}" / src.name
        path.parent.mkdir(parents=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, path)
        shm[:] = (n, 0, 0, 0)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(name, path, shm, step)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
            f"the child ended by itself at op {n} (status {status}); see its traceback"
        if shm[2]:
            last = int(shm[2]) + 1  # (the op after the step: its result is on disk, the resume goes on)
        out.append(path)
    return out


def _resumes_as_before(name: str, path: Path, want: dict) -> str:
    """The storage left is the older bigper's or this one's, never a mix, and
    a resume gives what the older bigper gave; which one it was."""
    arrays = set(recorded(path)["arrays"])
    old = set(recorded(DATA / name if (DATA / name).is_dir() else DATA / f"{name}.h5")["arrays"])
    assert arrays == old or arrays == (old - {"obs_ref", "next_obs_ref"}) | {"frame_ref", "frame_off"}, arrays
    buf = open_folder(name, path, continue_episodes=True)
    assert len(buf) == want["len"] and buf.total_priority == want["total_priority"]
    same_batches(buf, want["batches"][:1])
    buf.close()
    meta = recorded(path)
    assert "frame_off" in meta["arrays"] and not {"converting", "converted"} & set(meta)
    if path.is_dir():
        assert sorted(p.name for p in (path / "data").iterdir()) == sorted(f"{a}.bin" for a in meta["arrays"])
        assert not {"gid.npy", "frames_minref.npy"} & {p.name for p in (path / "state").iterdir()}
    else:  # nothing beside the file but its lock
        assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.name + ".lock"])
    return "old" if "obs_ref" in arrays else "new"


def _warm(name: str, tmp_path: Path) -> None:
    warm = open_folder(name, copy(name, tmp_path / "warm"), continue_episodes=True)  # kernels compiled before forks
    warm.sample(4)
    warm.close()


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="forks a child to kill (Linux)")
def test_kill_9_at_any_point_of_the_conversion_leaves_the_old_folder_or_the_new_one(tmp_path):
    """A real SIGKILL before each file operation of the conversion (then of
    the next open's clearing of the old files it left), one trial each."""
    from bigper.storage import _relayout

    name = FOLDERS[0]
    want = expected(name)
    _warm(name, tmp_path)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    shm = np.frombuffer(page, dtype=np.int64, count=4)
    try:
        left = _kill_at_each_op(name, DATA / name, tmp_path / "convert", (_relayout, "write_new", "write_new"), shm)
        committed = left[-1]  # killed just after the commit: the new folder, the old files still named
        assert "converted" in recorded(committed)
        shutil.copytree(committed, tmp_path / "committed" / name)
        # the next open clears what the conversion left (the old files), killed at each step of that too
        left += _kill_at_each_op(name, tmp_path / "committed" / name, tmp_path / "recover",
                                 (_relayout, "recover", "recover"), shm)
    finally:
        del shm
        page.close()
    kinds = [_resumes_as_before(name, path, want) for path in left]
    assert set(kinds) == {"old", "new"} and len(left) > 15, (kinds, len(left))


# -- the HDF5 storage's file ------------------------------------------------------------------------


def test_an_older_hdf5_storage_resumes_converted_into_a_new_file(tmp_path):
    want = expected(H5)
    path = copy(H5, tmp_path)
    buf = open_folder(H5, path, continue_episodes=True)
    assert len(buf) == want["resume"]["len"] and buf.total_priority == want["resume"]["total_priority"]
    same_far(buf, want["far"])
    same_batches(buf, want["resume"]["batches"])
    buf.close()
    meta = recorded(path)
    assert {"frame_ref", "frame_off"} <= set(meta["arrays"]) and not {"obs_ref", "next_obs_ref"} & set(meta["arrays"])
    assert meta["arrays"]["frame_off"]["dtype"] == "<u2"  # (its references lie further apart than uint8 holds)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.name + ".lock"])
    import h5py

    with h5py.File(path, "r") as f:
        assert not {"gid", "frames_minref"} & set(f["_bigper/state"])
    assert verify_live(path).status == OK
    again = open_folder(H5, path, continue_episodes=True)
    same_far(again, want["far"])
    again.close()


def test_an_older_hdf5_storage_is_read_converted_in_memory_where_nothing_may_change(tmp_path):
    want = expected(H5)
    path = copy(H5, tmp_path)
    before = fingerprint(tmp_path)
    buf = open_folder(H5, path, read_only=True)
    assert len(buf) == want["resume"]["len"]
    same_far(buf, want["far"])
    same_batches(buf, want["resume"]["batches"][:1], update=False)
    buf.close()
    assert verify_live(path).status == OK
    after = fingerprint(tmp_path)
    assert {k: v for k, v in after.items() if not k.endswith(".lock")} == before


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="forks a child to kill (Linux)")
def test_kill_9_at_any_point_of_an_hdf5_files_conversion_leaves_the_old_file_or_the_new_one(tmp_path):
    from bigper.storage import _h5relayout

    want = dict(expected(H5)["resume"], len=expected(H5)["resume"]["len"])
    _warm(H5, tmp_path)
    page = mmap.mmap(-1, mmap.PAGESIZE)
    shm = np.frombuffer(page, dtype=np.int64, count=4)
    try:
        left = _kill_at_each_op(H5, DATA / f"{H5}.h5", tmp_path / "convert", (_h5relayout, "rewrite", "swap"), shm)
    finally:
        del shm
        page.close()
    kinds = [_resumes_as_before(H5, path, want) for path in left]
    assert set(kinds) == {"old", "new"}, kinds
