"""Attacks on the conversion of an older bigper's live storage (issue 43 section 2).

A memmap folder's conversion is journaled in ``meta.json``
(``storage/_relayout.py``); an HDF5 file's is a new file renamed over it
(``storage/_h5relayout.py``). The journal, the folder and the file are read
from disk like anything else: a journal naming absurd numbers of files must
not hang an open, an interrupted conversion met by a refused resume must be
left exactly as it was (its old files are the only copy of the references
when the new ones are gone), a full disk is an ``OSError`` with the old
storage intact, and two writers never convert the same folder at once.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper
from bigper import CorruptSnapshotError, IncompatibleSnapshotError, StorageLockedError
from bigper.errors import BigperError
from bigper.snapshot.live import OK, verify_live

from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.conftest import fill_disk
from tests.storage.test_older_live import FOLDERS, H5, DATA, copy, expected, open_folder, recorded, same_batches

NAME = FOLDERS[0]


def lock_mark(path: Path) -> None:
    """The lock file a writer of this process leaves (so a fingerprint compares like with like)."""
    lock = path / ".lock" if path.is_dir() else path.parent / (path.name + ".lock")
    lock.write_text(f"{os.getpid()}\n")


def write_meta(path: Path, meta: dict) -> None:
    (path / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


class _Stop(BaseException):
    pass


def committed(tmp_path: Path, monkeypatch) -> Path:
    """The older folder as a conversion leaves it when killed just after its
    commit (S2: the new arrays recorded, the old files named in
    ``converted``, still there)."""
    from bigper.storage import _relayout

    path = copy(NAME, tmp_path)
    real = _relayout.write_new

    def stop(*a, **k):
        real(*a, **k)
        raise _Stop  # (a kill: no undo, no close)
    with monkeypatch.context() as m:
        m.setattr(_relayout, "write_new", stop)
        m.setattr(_relayout, "undo", lambda *a, **k: None)
        with pytest.raises(_Stop):
            open_folder(NAME, path, continue_episodes=True)
    meta = recorded(path)
    assert "converted" in meta and "frame_ref" in meta["arrays"]
    return path


def converting(tmp_path: Path, monkeypatch) -> Path:
    """The older folder as a conversion leaves it when killed while it wrote
    its new files (S1: the old arrays recorded, the new ones named in
    ``converting``, one of them half written)."""
    s2 = committed(tmp_path / "s2", monkeypatch)
    path = copy(NAME, tmp_path)
    layout = {n: recorded(s2)["arrays"][n] for n in ("frame_ref", "frame_off")}
    meta = recorded(path)
    meta["converting"] = {"arrays": layout, "state": []}
    write_meta(path, meta)
    shutil.copyfile(s2 / "data" / "frame_ref.bin", path / "data" / "frame_ref.bin")
    with open(path / "data" / "frame_off.bin", "wb") as f:
        f.write((s2 / "data" / "frame_off.bin").read_bytes()[:17])
    lock_mark(path)
    return path


def wrong_config(path: Path, **kw):
    spec = expected(NAME)["spec"]
    fields = {"obs": ((spec["frame_stack"], *spec["frame"]), np.uint8), "reward": ((), np.float32),
              "action": ((), np.int64)}
    return bigper.PrioritizedReplayBuffer(
        spec["capacity"] - 1, fields, path=path, num_envs=spec["num_envs"], frame_stack=spec["frame_stack"],
        seed=11, storage=spec["storage"], n_step=spec["n_step"], alpha=spec["alpha"], beta=spec["beta"],
        mode="resume", **kw)


# -- the journal's numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["converting", "converted"])
@pytest.mark.parametrize("mode", ["resume", "overwrite"])
def test_a_journal_naming_two_to_the_55_chunk_files_does_not_hang_the_open(key, mode, tmp_path):
    """``rows`` / ``chunk_rows`` in the journal are untrusted numbers: a
    journal of 2**55 one-row chunks is answered at once (the files that are
    there looked at, not the names it could mean), by a resume and by an
    overwrite (which proves every entry bigper's)."""
    path = copy(NAME, tmp_path)
    meta = recorded(path)
    name = "frame_ref" if key == "converting" else "obs_ref"
    if key == "converted":  # (as after the commit: the older arrays no longer recorded)
        meta["arrays"].pop("obs_ref")
    meta[key] = {"arrays": {name: {"rows": 1 << 55, "chunk_rows": 1, "dtype": "|u1", "shape": [1]}}, "state": []}
    write_meta(path, meta)
    lock_mark(path)
    before = fingerprint(path)
    with deadline(5):
        try:
            if mode == "resume":
                buf = open_folder(NAME, path, continue_episodes=True)
            else:
                buf = bigper.PrioritizedReplayBuffer(8, {"x": ((), np.float32)}, path=path, mode="overwrite")
        except BigperError:
            assert fingerprint(path) == before
            return
    buf.close()


# -- an interrupted conversion met by a refusal --------------------------------------------------------


def test_a_committed_conversion_whose_new_files_are_gone_keeps_the_old_ones(tmp_path, monkeypatch):
    """S2 (committed) with the new ``frame_ref`` chunk file gone: the old
    references are the only copy left. The resume is refused naming the
    missing file, and the old files (named in ``converted``) are not deleted."""
    path = committed(tmp_path, monkeypatch)
    os.unlink(path / "data" / "frame_ref.bin")
    before = fingerprint(path)
    with deadline():
        with pytest.raises(IncompatibleSnapshotError, match="frame_ref"):
            open_folder(NAME, path, continue_episodes=True)
    assert fingerprint(path) == before
    assert (path / "data" / "obs_ref.bin").is_file() and (path / "state" / "gid.npy").is_file()


@pytest.mark.parametrize("state", ["converting", "committed"])
def test_a_refused_resume_of_an_interrupted_conversion_changes_nothing(state, tmp_path, monkeypatch):
    """A conversion killed half way (S1) or just after its commit (S2), then
    a resume with another config: refused before anything changes (the
    journal is not acted on by an open that goes no further); the right
    config then resumes it as the older bigper would."""
    path = (converting if state == "converting" else committed)(tmp_path, monkeypatch)
    before = fingerprint(path)
    with deadline():
        with pytest.raises(IncompatibleSnapshotError, match="capacity"):
            wrong_config(path, continue_episodes=True)
    assert fingerprint(path) == before
    buf = open_folder(NAME, path, continue_episodes=True)
    same_batches(buf, expected(NAME)["batches"])
    buf.close()
    assert verify_live(path).status == OK


def test_a_journal_may_not_delete_state_the_folder_reads(tmp_path):
    """A meta.json without ``state_files`` (the state is what ``state/``
    holds) whose ``converted`` names ``status``: refused by the journal
    check, ``status.npy`` kept."""
    path = copy(NAME, tmp_path)
    meta = recorded(path)
    meta.pop("state_files")
    meta["converted"] = {"arrays": {}, "state": ["status"]}
    write_meta(path, meta)
    lock_mark(path)
    before = fingerprint(path)
    with deadline():
        with pytest.raises(CorruptSnapshotError, match="converted"):
            open_folder(NAME, path, continue_episodes=True)
    assert fingerprint(path) == before


# -- disks, locks, the working directory --------------------------------------------------------------


def test_a_full_disk_during_a_folders_conversion_leaves_the_old_folder(small_tmpfs):
    path = small_tmpfs / NAME
    shutil.copytree(DATA / NAME, path)
    lock_mark(path)
    fill_disk(small_tmpfs / "filler")
    before = fingerprint(path)
    with deadline():
        with pytest.raises((OSError, BigperError)):
            open_folder(NAME, path, continue_episodes=True)
    assert fingerprint(path) == before
    os.unlink(small_tmpfs / "filler")
    buf = open_folder(NAME, path, continue_episodes=True)
    same_batches(buf, expected(NAME)["batches"])
    buf.close()


def test_a_writer_refused_for_another_config_leaves_an_older_hdf5_file_byte_for_byte(tmp_path):
    """The older HDF5 file (its growth reservations as zeros past HDF5's end of
    allocation) met by a resume with another capacity: refused, and the file is
    what it was to the byte (a writer reads the file until ``allocate``: HDF5
    cuts a file opened for writing back to its end of allocation at close);
    the right config then resumes it as the older bigper would."""
    path = tmp_path / f"{H5}.h5"
    shutil.copyfile(DATA / f"{H5}.h5", path)
    lock_mark(path)
    spec = expected(H5)["spec"]
    fields = {"obs": ((spec["frame_stack"], *spec["frame"]), np.uint8), "reward": ((), np.float32),
              "action": ((), np.int64)}
    before = fingerprint(tmp_path)
    with deadline():
        with pytest.raises(IncompatibleSnapshotError, match="capacity"):
            bigper.PrioritizedReplayBuffer(
                spec["capacity"] - 1, fields, path=path, num_envs=spec["num_envs"],
                frame_stack=spec["frame_stack"], seed=11, storage=spec["storage"],
                compression=spec.get("compression"), n_step=spec["n_step"], alpha=spec["alpha"],
                beta=spec["beta"], mode="resume", continue_episodes=True)
    assert fingerprint(tmp_path) == before
    buf = open_folder(H5, path, continue_episodes=True)
    same_batches(buf, expected(H5)["resume"]["batches"])
    buf.close()


def test_a_full_disk_during_an_hdf5_files_conversion_leaves_the_old_file(small_tmpfs):
    path = small_tmpfs / f"{H5}.h5"
    shutil.copyfile(DATA / f"{H5}.h5", path)
    lock_mark(path)
    fill_disk(small_tmpfs / "filler")
    before = fingerprint(small_tmpfs)
    with deadline():
        with pytest.raises((OSError, BigperError)):
            open_folder(H5, path, continue_episodes=True)
    assert fingerprint(small_tmpfs) == before
    os.unlink(small_tmpfs / "filler")
    buf = open_folder(H5, path, continue_episodes=True)
    same_batches(buf, expected(H5)["resume"]["batches"])
    buf.close()


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="forks a child (Linux)")
@pytest.mark.parametrize("name", [NAME, H5])
def test_a_second_process_resuming_an_older_storage_while_one_converts_it_is_locked_out(name, tmp_path):
    """One process resumed (converted) the older storage and holds it; a
    second one's resume (and read_only open) is ``StorageLockedError`` and
    changes nothing; the first closes, and the storage is the new format."""
    path = copy(name, tmp_path)
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:
            os.close(r)
            buf = open_folder(name, path, continue_episodes=True)
            os.write(w, b"1")
            os.read(r2, 1)
            buf.close()
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(w)
    try:
        with deadline(30):
            assert os.read(r, 1) == b"1"
        before = fingerprint(tmp_path)
        for kw in ({"continue_episodes": True}, {"read_only": True}):
            with deadline():
                with pytest.raises(StorageLockedError):
                    open_folder(name, path, **kw)
            assert fingerprint(tmp_path) == before, kw
    finally:
        os.write(w2, b"1")
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert "frame_off" in recorded(path)["arrays"]
    buf = open_folder(name, path, read_only=True)
    want = expected(name)
    same_batches(buf, (want["resume"] if name == H5 else want)["batches"][:1], update=False)
    buf.close()


def test_a_chdir_between_a_relative_open_and_close_converts_the_folder_opened(tmp_path, monkeypatch):
    """The folder opened by a relative path is converted and its old files
    removed at close even after the process changed directory; a folder of
    the same name in the new working directory is untouched."""
    a, b = tmp_path / "a", tmp_path / "b"
    copy(NAME, a)
    decoy = copy(NAME, b)
    monkeypatch.chdir(a)
    buf = open_folder(NAME, Path(NAME), continue_episodes=True)
    before = fingerprint(decoy)
    monkeypatch.chdir(b)
    same_batches(buf, expected(NAME)["batches"][:1])
    buf.close()
    assert fingerprint(decoy) == before
    meta = recorded(a / NAME)
    assert "frame_off" in meta["arrays"] and not {"converting", "converted"} & set(meta)
    assert sorted(p.name for p in (a / NAME / "data").iterdir()) == sorted(f"{n}.bin" for n in meta["arrays"])


# -- the older references' record and values ----------------------------------------------------------


@pytest.mark.parametrize("dtype,shape", [("<f8", [4]), ("<u8", [4]), (">i8", [4]), ("|i1", [4]), ("<i8", [4, 1]),
                                         ("<i8", [2, 2]), ("<i8", [32]), ("<i8", [1])])
def test_older_references_recorded_as_another_dtype_or_shape_are_refused(dtype, shape, tmp_path):
    """``obs_ref`` recorded (and written) as floats of the same size, uint64,
    big-endian, int8, with extra or fewer dims: refused by name by a resume
    and a reader, the folder unchanged."""
    path = copy(NAME, tmp_path)
    meta = recorded(path)
    ids = np.fromfile(path / "data" / "obs_ref.bin", dtype="<i8")
    n = 48 * int(np.prod(shape)) * np.dtype(dtype).itemsize
    (path / "data" / "obs_ref.bin").write_bytes((ids.astype(dtype).tobytes() * 8)[:n])
    meta["arrays"]["obs_ref"].update(dtype=dtype, shape=shape)
    write_meta(path, meta)
    lock_mark(path)
    before = fingerprint(path)
    for kw in ({"continue_episodes": True}, {"read_only": True}):
        with deadline():
            with pytest.raises(IncompatibleSnapshotError, match="obs_ref"):
                open_folder(NAME, path, **kw)
        assert fingerprint(path) == before, kw


def test_int64_extremes_in_slots_no_sample_reads_convert_and_resume_exactly(tmp_path):
    """Empty slots of the older folder holding int64 min / max and negative
    ids: never read, so the conversion takes them (clipped offsets) and the
    resume samples what the older bigper sampled."""
    name = FOLDERS[1]
    path = copy(name, tmp_path)
    empty = np.flatnonzero(np.load(path / "state" / "status.npy") == 0)
    assert empty.size
    for array, v in (("obs_ref", np.iinfo(np.int64).min), ("next_obs_ref", np.iinfo(np.int64).max)):
        a = np.fromfile(path / "data" / f"{array}.bin", dtype="<i8").reshape(-1, 4)
        a[empty] = v
        a[empty[::2], 0] = -7
        a.tofile(path / "data" / f"{array}.bin")
    buf = open_folder(name, path, continue_episodes=True)
    same_batches(buf, expected(name)["batches"])
    buf.close()
    assert recorded(path)["arrays"]["frame_off"]["dtype"] == "<u2"
    assert verify_live(path).status == OK


def test_a_load_takes_over_a_live_folder_whose_writer_was_killed_before_it_made_data(tmp_path):
    """A kill -9 can leave a live folder with its meta.json and no data/ yet
    (found by tools/dev/crash_test.py): a snapshot's load into that path takes
    it over (the journal's and the record's files are looked up in a data/
    that is not there) instead of raising FileNotFoundError."""
    fields = {"obs": ((2,), np.float32)}
    live = tmp_path / "live"
    with bigper.PrioritizedReplayBuffer(8, fields, storage="memmap", path=live) as buf:
        for i in range(5):
            buf.add(obs=np.full(2, i, np.float32), next_obs=np.full(2, i + 1, np.float32))
        buf.save(tmp_path / "snap")
        want = buf.sample(4)
    shutil.rmtree(live / "data")
    with deadline():
        back = bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=live)
    assert len(back) == 5
    got = back.sample(4)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got["obs"], want["obs"])
    back.close()


def test_a_live_record_naming_two_to_the_55_chunk_files_does_not_hang_a_loads_takeover(tmp_path):
    """The live folder's meta.json records an array of 2**55 one-row chunks: a
    snapshot's load into that path looks its files up in what data/ holds
    (not chunk name by chunk name) and answers at once."""
    fields = {"obs": ((2,), np.float32)}
    live = tmp_path / "live"
    with bigper.PrioritizedReplayBuffer(8, fields, storage="memmap", path=live) as buf:
        for i in range(5):
            buf.add(obs=np.full(2, i, np.float32), next_obs=np.full(2, i + 1, np.float32))
        buf.save(tmp_path / "snap")
    meta = recorded(live)
    meta["arrays"]["obs"] = {**meta["arrays"]["obs"], "rows": 2**55, "chunk_rows": 1}
    write_meta(live, meta)
    with deadline(20):
        try:
            bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=live).close()
        except BigperError:
            pass  # refused (the folder's record is not the snapshot's) is an answer too


def test_a_live_record_naming_two_to_the_55_chunk_files_does_not_hang_a_resume(tmp_path):
    """The same record met by ``mode="resume"``: its copy-on-write leftovers
    are looked up in what data/ holds too, and the resume answers at once
    (refused: the record is not the config's), the folder unchanged."""
    fields = {"obs": ((2,), np.float32)}
    live = tmp_path / "live"
    with bigper.PrioritizedReplayBuffer(8, fields, storage="memmap", path=live) as buf:
        buf.add(obs=np.zeros(2, np.float32), next_obs=np.ones(2, np.float32))
    meta = recorded(live)
    meta["arrays"]["obs"] = {**meta["arrays"]["obs"], "rows": 2**55, "chunk_rows": 1}
    write_meta(live, meta)
    lock_mark(live)
    before = fingerprint(live)
    with deadline(20):
        with pytest.raises(BigperError):
            bigper.PrioritizedReplayBuffer(8, fields, storage="memmap", path=live, mode="resume")
    assert fingerprint(live) == before
