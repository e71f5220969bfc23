"""One writer per storage path: a second writer, in this process or another,
gets StorageLockedError; readers share; a killed process's lock does not
block the next writer, but a writer that died leaves the storage unclean."""

import shutil

import numpy as np
import pytest

import bigper
from bigper import StorageLockedError
from bigper.storage.state import UncleanStorageError
from tests._storage_cases import AGENT_FIELDS, DISK, AgentPool, open_buffer, where


def opener(kind, path):
    def open_(read_only=False):
        return open_buffer(kind, path, 16, AGENT_FIELDS, read_only=read_only)
    return open_


def add(buf, n):
    for i in range(n):
        buf.add(obs=np.full(3, i, np.float32), reward=np.float32(i),
                next_obs=np.full(3, i + 1, np.float32))


@pytest.fixture(scope="module")
def agents():
    pool = AgentPool()
    yield pool
    pool.stop()


@pytest.fixture
def agent(agents):
    """A child process that opens buffers when told to (see ``_storage_cases.Agent``)."""
    a = agents.take()
    yield a
    a.stop()


@pytest.mark.parametrize("kind", DISK)
def test_second_writer_in_this_process_is_refused(kind, tmp_path):
    open_ = opener(kind, where(kind, tmp_path))
    buf = open_()
    add(buf, 3)
    with pytest.raises(StorageLockedError, match="one writer per storage path") as e:
        open_()
    assert isinstance(e.value, bigper.BigperError)
    with pytest.raises(StorageLockedError):  # nor may a reader look at a half-written buffer
        open_(read_only=True)
    add(buf, 2)  # the refused opens did not disturb the writer
    buf.close()
    with open_() as again:
        assert len(again) == 5


@pytest.mark.parametrize("kind", DISK)
def test_readers_share_writers_exclude(kind, tmp_path, agent):
    path = where(kind, tmp_path)
    open_ = opener(kind, path)
    buf = open_()
    add(buf, 4)
    assert agent.ask(f"open {kind} {path} writer").startswith("err StorageLockedError")
    assert agent.ask(f"open {kind} {path} reader").startswith("err StorageLockedError")
    buf.close()

    r1, r2 = open_(read_only=True), open_(read_only=True)
    assert agent.ask(f"open {kind} {path} reader") == "ok"
    assert len(r1) == len(r2) == 4
    r1.sample(4), r2.sample(4)
    with pytest.raises(StorageLockedError):
        open_()
    assert agent.ask(f"open {kind} {path} writer").startswith("err StorageLockedError")
    r1.close(), r2.close()
    with pytest.raises(StorageLockedError):  # the agent still reads
        open_()
    # A killed reader's lock goes with it, and a reader never marks the
    # storage unclean: the next writer just opens.
    agent.kill()
    with open_() as buf:
        assert len(buf) == 4
        add(buf, 1)


@pytest.mark.parametrize("kind", DISK)
def test_writer_killed_leaves_storage_unclean_not_locked(kind, tmp_path, agent):
    path = where(kind, tmp_path)
    open_ = opener(kind, path)
    assert agent.ask(f"open {kind} {path} writer") == "ok"
    assert agent.ask("add 5") == "ok"
    with pytest.raises(StorageLockedError):
        open_()
    agent.kill()
    # The lock went with the process: what stops the next writer now is the
    # unknown state of the data, and the error says so.
    with pytest.raises(UncleanStorageError) as e:
        open_()
    assert isinstance(e.value, bigper.BigperError)
    assert not isinstance(e.value, StorageLockedError)
    msg = str(e.value)
    assert str(path) in msg and "not closed" in msg and "snapshot" in msg.lower(), msg


@pytest.mark.parametrize("kind", DISK)
def test_refused_open_releases_the_lock(kind, tmp_path):
    """After an UncleanStorageError the same process may try again (and get
    the same answer, not StorageLockedError from its own leaked lock)."""
    live, copy = where(kind, tmp_path, "live"), where(kind, tmp_path, "copy")
    buf = opener(kind, live)()
    add(buf, 3)
    buf.storage.flush()
    # a copy of a storage whose writer is still open: unclean, and nobody holds its lock
    if kind == "hdf5":
        shutil.copyfile(live, copy)
    else:
        shutil.copytree(live, copy)
    buf.close()
    for read_only in (False, True, False):
        with pytest.raises(UncleanStorageError):
            opener(kind, copy)(read_only=read_only)


MODES = ("new", "resume", "overwrite")


@pytest.mark.parametrize("kind", DISK)
@pytest.mark.parametrize("holder", ["writer", "reader"])
@pytest.mark.parametrize("place", ["this process", "another process"])
def test_every_mode_against_a_live_holder_is_refused_before_any_change(kind, holder, place, tmp_path,
                                                                       agents):
    """The lock comes before anything at the path is read, moved or deleted
    (promise 11): ``mode="overwrite"`` against a live reader used to delete the
    HDF5 file and only then find the lock held. Each mode, against a writer or
    a reader in this process or in another, is ``StorageLockedError`` with the
    files exactly as they were, and the holder reads on undisturbed."""
    from tests._hostile_snapshot_cases import fingerprint

    path = where(kind, tmp_path)
    with opener(kind, path)() as buf:
        add(buf, 7)
    agent = None
    if place == "this process":
        held = opener(kind, path)(read_only=holder == "reader")
    else:
        agent = agents.take()
        assert agent.ask(f"open {kind} {path} {holder}") == "ok"
    try:
        before = fingerprint(tmp_path)
        for mode in MODES:
            with pytest.raises(StorageLockedError, match="in use by"):
                open_buffer(kind, path, 16, AGENT_FIELDS, mode=mode)
            assert fingerprint(tmp_path) == before, mode
        if holder == "writer":
            with pytest.raises(StorageLockedError):
                open_buffer(kind, path, 16, AGENT_FIELDS, read_only=True)
            assert fingerprint(tmp_path) == before
        if place == "this process":
            assert len(held) == 7
            held.sample(4)
    finally:
        if agent is None:
            held.close()
        else:
            assert agent.ask("close") == "ok"
            agent.stop()
    with opener(kind, path)() as buf:  # the holder gone, the buffer is all there
        assert len(buf) == 7


@pytest.mark.parametrize("kind", DISK)
def test_overwrite_replaces_under_one_lock(kind, tmp_path):
    """``mode="overwrite"`` of a closed buffer: a new, empty one, and a second
    writer that comes meanwhile is refused (the lock is held from the look at
    the old buffer to the new one's close)."""
    path = where(kind, tmp_path)
    with opener(kind, path)() as buf:
        add(buf, 5)
    with open_buffer(kind, path, 16, AGENT_FIELDS, mode="overwrite") as buf:
        assert len(buf) == 0 and buf.resumed is None
        with pytest.raises(StorageLockedError):
            opener(kind, path)()
        add(buf, 2)
    with opener(kind, path)() as buf:
        assert len(buf) == 2


@pytest.mark.parametrize("kind", DISK)
@pytest.mark.parametrize("holder", ["writer", "reader"])
@pytest.mark.parametrize("place", ["this process", "another process"])
def test_a_snapshot_load_onto_a_held_path_names_the_holder(kind, holder, place, tmp_path, agents):
    """``load(snap, path=P)`` where a live writer or reader holds ``P``:
    ``StorageLockedError`` naming who holds it (for HDF5 it used to be a
    ``PathExistsError`` "cannot be read as a bigper storage ([Errno 11] unable
    to lock file)"), with the path and the snapshot exactly as they were."""
    from tests._hostile_snapshot_cases import fingerprint

    src, live = where(kind, tmp_path, "src"), where(kind, tmp_path, "live")
    with opener(kind, src)() as buf:
        add(buf, 6)
        buf.save(tmp_path / "snap")
    with opener(kind, live)() as buf:
        add(buf, 3)
    agent = None
    if place == "this process":
        held = opener(kind, live)(read_only=holder == "reader")
    else:
        agent = agents.take()
        assert agent.ask(f"open {kind} {live} {holder}") == "ok"
    try:
        before = fingerprint(tmp_path)
        with pytest.raises(StorageLockedError) as e:
            bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=live)
        assert fingerprint(tmp_path) == before
        # (A reader records no PID: the lock file still names the last writer, here this
        # process; FileLock's wording of that case is not this test's subject.)
        who = {"this process": "this process", "another process": f"process {agent and agent.proc.pid}"}
        assert str(live) in str(e.value) and "in use by" in str(e.value), str(e.value)
        if holder == "writer":
            assert who[place] in str(e.value), str(e.value)
    finally:
        if agent is None:
            held.close()
        else:
            assert agent.ask("close") == "ok"
            agent.stop()
    with bigper.PrioritizedReplayBuffer.load(tmp_path / "snap", path=live) as back:  # now it takes over
        assert len(back) == 6


@pytest.mark.parametrize("kind", ["memmap", "hdf5"])
def test_an_overwrite_that_fails_puts_the_old_buffer_back(small_tmpfs, kind):
    """``mode="overwrite"`` whose new storage cannot be made (here: it needs
    more than the 3 MB filesystem holds) fails with ``OSError`` and leaves the
    old buffer exactly as it was: its files are moved aside, not deleted, until
    their successor exists."""
    from tests._hostile_snapshot_cases import fingerprint

    path = where(kind, small_tmpfs)
    with opener(kind, path)() as buf:
        add(buf, 5)
    before = fingerprint(small_tmpfs)
    big = {"obs": ((4096,), np.uint8), "reward": ((), np.float32)}  # 4 KiB a row, 8 MiB in all
    with pytest.raises(OSError):
        open_buffer(kind, path, 2048, big, mode="overwrite")
    assert fingerprint(small_tmpfs) == before
    with opener(kind, path)() as buf:
        assert len(buf) == 5
