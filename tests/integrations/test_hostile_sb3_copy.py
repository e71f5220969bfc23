"""Attack on ``beside_the_pickle`` / ``_nearest_copy`` (commit 40c2bc4): a
plain ``pickle.dumps`` of the SB3 drop-in buffer (its snapshot in
``<live>.snapshots/snap-N``, or ``snapshot_dir``) read with
``model.load_replay_buffer(path)`` from a copied run folder loads the copy's
snapshot (the nearest ``<folder>/<snapshot folder name>/snap-N`` at or above
the pickle holding a manifest) into the copy's live path; a different
snapshot there is refused, never passed over for the original.

Attacked here: the copy's snapshot folder (or ``snap-N``) a symlink to the
ORIGINAL run's; the candidate manifest a FIFO, a symlink, a folder; the
copy's live folder a symlink to the original's; the pickle read from inside
the original (as before), through a symlinked folder, from a run recorded
through a symlink; a copy with its live folder present and newer (refused
without rewind), ``rewind=True`` into the copy; a nearer decoy snapshot of
the same name; a copy whose snapshot folder was renamed; a custom
``snapshot_dir``. Every refusal: full fingerprints of both runs before and
after; the original run never changes.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")
pytest.importorskip("stable_baselines3")

from bigper.errors import BigperError, PathExistsError  # noqa: E402

from tests._hostile_snapshot_cases import deadline, fingerprint  # noqa: E402
from tests._torch_threads import one_torch_thread  # noqa: E402,F401 (autouse)
from tests.integrations.test_hostile_sb3_resume import add, dqn, pickled_run  # noqa: E402


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One original run (pickle written after 10 adds, 15 more since, closed), kept as a
    template: each test copies it (cp -a) so the pickle's recorded paths are the template's."""
    root = tmp_path_factory.mktemp("orig")
    run = root / "run"
    run.mkdir()
    (run / "rb.pkl").write_bytes(pickled_run(run))
    return run


def _fork(made, tmp_path, *, keep_live=True):
    fork = tmp_path / "fork"
    subprocess.run(["cp", "-a", str(made), str(fork)], check=True)
    if not keep_live:
        shutil.rmtree(fork / "replay")
    return fork


def _snap(folder: Path) -> Path:
    return next((folder / "replay.snapshots").glob("snap-*"))


def _model(tmp_path):
    m = dqn(tmp_path / "other")
    m.replay_buffer.close()
    return m


def _load(m, path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with deadline(60):
            m.load_replay_buffer(path, **kw)
    return m.replay_buffer


def _refused(made, tmp_path, pkl, *others, rewind=False, err=BigperError):
    before = fingerprint(made, *others)
    m = _model(tmp_path)
    with pytest.raises(err):
        _load(m, pkl, rewind=rewind)
    assert fingerprint(made, *others) == before


def test_rewind_into_the_copy_loads_the_copy_and_leaves_the_original(made, tmp_path):
    fork = _fork(made, tmp_path)
    before = fingerprint(made)
    _refused(made, tmp_path, fork / "rb.pkl", fork, err=PathExistsError)  # the copy's live folder is newer
    rb = _load(_model(tmp_path), fork / "rb.pkl", rewind=True)
    try:
        assert rb.size() == 10 and Path(rb.buffer.storage.path) == fork / "replay"
    finally:
        rb.close()
    assert fingerprint(made) == before


@pytest.mark.parametrize("level", ["snapshot-folder", "snap-n"])
def test_a_copy_whose_snapshots_link_to_the_originals_never_touches_the_original(made, tmp_path, level):
    """``<fork>/replay.snapshots`` (or its snap-N) a symlink to the ORIGINAL's: the manifest
    hash matches (it is the same file); whatever is loaded goes into the fork, the
    original's live folder and snapshots are never changed, with rewind or without."""
    fork = _fork(made, tmp_path, keep_live=False)
    if level == "snapshot-folder":
        shutil.rmtree(fork / "replay.snapshots")
        os.symlink(made / "replay.snapshots", fork / "replay.snapshots")
    else:
        s = _snap(fork)
        shutil.rmtree(s)
        os.symlink(_snap(made), s)
    before = fingerprint(made)
    for rewind in (False, True):
        try:
            rb = _load(_model(tmp_path), fork / "rb.pkl", rewind=rewind)
        except BigperError:
            pass
        else:
            at = Path(rb.buffer.storage.path)
            rb.close()
            assert fork in at.parents or at == fork / "replay", at
        assert fingerprint(made) == before


@pytest.mark.parametrize("what", ["fifo", "symlink-to-original", "dir", "empty-file"])
def test_a_crafted_candidate_manifest_is_refused_and_nothing_changes(made, tmp_path, what):
    fork = _fork(made, tmp_path, keep_live=False)
    mp = _snap(fork) / "manifest.json"
    os.unlink(mp)
    if what == "fifo":
        os.mkfifo(mp)
    elif what == "symlink-to-original":
        os.symlink(_snap(made) / "manifest.json", mp)
    elif what == "dir":
        mp.mkdir()
    else:
        mp.write_bytes(b"")
    for rewind in (False, True):
        _refused(made, tmp_path, fork / "rb.pkl", fork, rewind=rewind)


def test_a_copy_whose_live_folder_links_to_the_originals_is_refused_even_with_rewind(made, tmp_path):
    fork = _fork(made, tmp_path, keep_live=False)
    os.symlink(made / "replay", fork / "replay")
    for rewind in (False, True):
        _refused(made, tmp_path, fork / "rb.pkl", fork, rewind=rewind)


def test_the_pickle_read_inside_the_original_behaves_as_before(made, tmp_path):
    run = tmp_path / "run"
    os.symlink(made, run)  # (read through a link to the original: still the original)
    for pkl in (made / "rb.pkl", run / "rb.pkl"):
        _refused(made, tmp_path, pkl, err=PathExistsError)


def test_the_original_rewound_in_place_when_asked(made, tmp_path):
    """(Read where it was written, rewind=True: the original's live path, as before; on a copy
    of the template so the module's template stays.)"""
    orig = tmp_path / "orig"
    subprocess.run(["cp", "-a", str(made), str(orig)], check=True)
    # the copy IS an original for its own pickle only if pickled there: pickle a fresh run
    (orig / "rb.pkl").unlink()
    shutil.rmtree(orig / "replay")
    shutil.rmtree(orig / "replay.snapshots")
    (orig / "rb.pkl").write_bytes(pickled_run(orig))
    rb = _load(_model(tmp_path), orig / "rb.pkl", rewind=True)
    try:
        assert rb.size() == 10 and Path(rb.buffer.storage.path) == orig / "replay"
    finally:
        rb.close()


@pytest.mark.parametrize("where", ["a/rb.pkl", "a/b/c/rb.pkl"])
def test_a_nearer_decoy_of_the_same_name_is_refused_never_passed_over(made, tmp_path, where):
    """A folder between the pickle and the copy's root holds another snapshot of the same
    name (another run's): refused (its manifest is not the pickle's), the fork's own copy
    and the original never loaded, nothing changed."""
    fork = _fork(made, tmp_path, keep_live=False)
    (fork / where).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(fork / "rb.pkl", fork / where)
    other = tmp_path / "otherrun"
    other.mkdir()
    pickled_run(other)
    decoy = fork / "a" / "replay.snapshots"
    decoy.mkdir()
    shutil.copytree(_snap(other), decoy / _snap(fork).name)
    _refused(made, tmp_path, fork / where, fork, rewind=True)


def test_a_pickle_copied_alone_refuses_without_rewind(made, tmp_path):
    """Nothing of the run beside it: the snapshot it recorded (the original's), into the
    recorded live path, which is newer: refused without rewind, nothing changed."""
    (tmp_path / "alone").mkdir()
    shutil.copy(made / "rb.pkl", tmp_path / "alone" / "rb.pkl")
    _refused(made, tmp_path, tmp_path / "alone" / "rb.pkl", err=PathExistsError)


def test_a_copy_whose_snapshot_folder_was_renamed_never_rewinds_the_original(made, tmp_path):
    """The copy's ``replay.snapshots`` renamed ``snaps``: no copy is found, so the pickle
    names the original's snapshot and live path. Without rewind: refused, nothing changed."""
    fork = _fork(made, tmp_path)
    os.rename(fork / "replay.snapshots", fork / "snaps")
    _refused(made, tmp_path, fork / "rb.pkl", fork, err=PathExistsError)


def test_the_copy_read_through_a_symlinked_folder(made, tmp_path):
    fork = _fork(made, tmp_path, keep_live=False)
    os.symlink(fork, tmp_path / "via")
    before = fingerprint(made)
    rb = _load(_model(tmp_path), tmp_path / "via" / "rb.pkl", rewind=True)
    try:
        assert rb.size() == 10 and Path(os.path.realpath(rb.buffer.storage.path)) == fork / "replay"
    finally:
        rb.close()
    assert fingerprint(made) == before


def test_a_run_recorded_through_a_symlink_and_copied(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    (real / "rb.pkl").write_bytes(pickled_run(tmp_path / "link"))  # recorded as .../link/replay
    subprocess.run(["cp", "-a", str(real), str(tmp_path / "fork")], check=True)
    before = fingerprint(real)
    rb = _load(_model(tmp_path), tmp_path / "fork" / "rb.pkl", rewind=True)
    try:
        assert rb.size() == 10 and Path(rb.buffer.storage.path) == tmp_path / "fork" / "replay"
    finally:
        rb.close()
    assert fingerprint(real) == before


def _pickled_with_snapshot_dir(run: Path, live: Path, snaps: Path) -> None:
    """``run/rb.pkl``: a plain pickle of a buffer at ``live`` with ``snapshot_dir=snaps`` after
    10 adds, then 15 more adds and a close (the live folder newer than the pickle)."""
    m = dqn(run, replay_buffer_kwargs={"storage": "memmap", "path": str(live), "snapshot_dir": str(snaps)})
    for t in range(10):
        add(m, t, 1.0)
    (run / "rb.pkl").write_bytes(pickle.dumps(m.replay_buffer))
    for t in range(10, 25):
        add(m, t, 2.0)
    m.replay_buffer.close()


# ("ckpt/series" was a strict xfail: _nearest_copy looked for <ancestor>/<folder name>/snap-N only, so a
# nested snapshot_dir was never found in the copy and rewind=True REWOUND THE ORIGINAL run's live folder)
@pytest.mark.parametrize("series", ["series", "ckpt/series"])
def test_a_custom_snapshot_dir_copied_loads_the_copy(tmp_path, series):
    run = tmp_path / "run"
    run.mkdir()
    _pickled_with_snapshot_dir(run, run / "replay", run / series)
    assert any((run / series).glob("snap-*"))
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "fork")], check=True)
    before = fingerprint(run)
    _refused(run, tmp_path, tmp_path / "fork" / "rb.pkl", tmp_path / "fork", err=PathExistsError)
    rb = _load(_model(tmp_path), tmp_path / "fork" / "rb.pkl", rewind=True)
    at = Path(rb.buffer.storage.path)
    rb.close()
    assert fingerprint(run) == before, f"the ORIGINAL run was rewound (loaded into {at})"
    assert at == tmp_path / "fork" / "replay"


# (Was a strict xfail: the search started at p.parent.resolve(), inside the ORIGINAL run, and
# rewind=True rewound the original's live folder.)
def test_a_fork_whose_pickle_folder_links_to_the_originals_never_rewinds_the_original(tmp_path):
    """The fork is a copy of the run (its own live folder and snapshots) whose ``ckpt/``
    (where the pickle is) is a symlink to the original's ``ckpt/`` (big checkpoints shared,
    not copied). Read as ``fork/ckpt/rb.pkl`` with rewind=True: the fork's own snapshot copy
    is beside the path the user gave; the ORIGINAL run's live folder must never be rewound."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "rb.pkl").write_bytes(pickled_run(run))
    fork = tmp_path / "fork"
    subprocess.run(["cp", "-a", str(run), str(fork)], check=True)
    shutil.rmtree(fork / "ckpt")
    os.symlink(run / "ckpt", fork / "ckpt")
    before = fingerprint(run)
    try:
        rb = _load(_model(tmp_path), fork / "ckpt" / "rb.pkl", rewind=True)
    except BigperError:
        pass
    else:
        at = Path(rb.buffer.storage.path)
        rb.close()
        assert fingerprint(run) == before, f"the ORIGINAL run's live folder was rewound (loaded into {at})"
        assert at == fork / "replay", f"loaded into {at}"
    assert fingerprint(run) == before


def test_a_live_folder_outside_the_copied_run_is_refused_without_rewind(tmp_path):
    """The live folder lives outside the run folder (scratch), the snapshots inside it
    (snapshot_dir): a copy of the run folder has no counterpart for the live path, so its
    load goes to the recorded live path, which is newer: refused, nothing changed."""
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    run.mkdir()
    scratch.mkdir()
    _pickled_with_snapshot_dir(run, scratch / "replay", run / "snaps")
    subprocess.run(["cp", "-a", str(run), str(tmp_path / "fork")], check=True)
    _refused(scratch, tmp_path, tmp_path / "fork" / "rb.pkl", run, tmp_path / "fork", err=PathExistsError)
