"""One writer per storage path: a second writer, in this process or another,
gets StorageLockedError; readers share; a killed process's lock does not
block the next writer, but a writer that died leaves the storage unclean."""

import shutil

import numpy as np
import pytest

import bigper
from bigper import StorageLockedError
from bigper.storage._state import UncleanStorageError
from ._storage_cases import AGENT_FIELDS, DISK, AgentPool, open_buffer, where


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
    buf._store.flush()
    # a copy of a storage whose writer is still open: unclean, and nobody holds its lock
    if kind == "hdf5":
        shutil.copyfile(live, copy)
    else:
        shutil.copytree(live, copy)
    buf.close()
    for read_only in (False, True, False):
        with pytest.raises(UncleanStorageError):
            opener(kind, copy)(read_only=read_only)
