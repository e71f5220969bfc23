"""Attacks on the HDF5 writer that reads an existing file until ``allocate`` (``storage/hdf5.py``):
a resume refused for each kind of config mismatch, a read-only file (also as an unprivileged user),
an overwrite then a refusal, a user's file at bigper's ``.trash-`` name, two threads right after
a resume: the file and its folder byte for byte where nothing was to change."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import bigper
from bigper.errors import BigperError

from tests._hostile_snapshot_cases import deadline, fingerprint

pytest.importorskip("h5py")

CAP = 16


def _fields(k=1):
    return {"obs": ((k, 4, 4) if k > 1 else (4, 4), np.uint8), "reward": ((), np.float32)}


def _open(path, cap=CAP, k=1, compression=None, fields=None, mode="resume"):
    return bigper.PrioritizedReplayBuffer(cap, fields or _fields(k), storage="hdf5", path=path, seed=0,
                                          frame_stack=k if k > 1 else None, compression=compression, mode=mode)


def _made(tmp_path, k=1, compression=None):
    path = tmp_path / "r.h5"
    with _open(path, k=k, compression=compression, mode="new") as buf:
        for i in range(10):
            obs = np.full((4, 4), i, np.uint8)
            buf.add(obs=obs, reward=float(i), next_obs=obs + 1)
    return path


MISMATCH = {
    "capacity": dict(cap=CAP + 1),
    "fields": dict(fields={**_fields(), "extra": ((), np.int32)}),
    "frame_stack": dict(k=4),
    "compression": dict(compression="zstd"),
}


@pytest.mark.parametrize("what", sorted(MISMATCH))
def test_a_resume_refused_for_its_config_leaves_the_file_and_folder_byte_for_byte(what, tmp_path):
    path = _made(tmp_path)
    planted = tmp_path / ".r.h5.trash-0123456789ab"
    planted.write_bytes(b"a user's file at bigper's name")
    before = fingerprint(tmp_path)
    with deadline(), pytest.raises(BigperError):
        _open(path, **MISMATCH[what])
    assert fingerprint(tmp_path) == before
    with _open(path) as buf:  # the right config still resumes it
        assert len(buf) == 10


def test_a_read_only_file_resumed_as_a_writer_is_refused_and_unchanged(tmp_path):
    path = _made(tmp_path)
    os.chmod(path, 0o444)
    before = fingerprint(tmp_path)
    try:
        with deadline():
            buf = _open(path)  # root may write anyway
            buf.close()
    except (BigperError, OSError):
        assert fingerprint(tmp_path) == before
    finally:
        os.chmod(path, 0o644)


@pytest.mark.skipif(not hasattr(os, "fork") or os.geteuid() != 0, reason="root, to drop to another user")
def test_a_read_only_file_resumed_by_an_unprivileged_writer_is_refused_and_unchanged(tmp_path):
    path = _made(tmp_path)
    os.chmod(path, 0o444)
    os.chmod(tmp_path, 0o777)
    before = fingerprint(tmp_path)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            signal_ok = deadline(10)
            with signal_ok:
                try:
                    _open(path).close()
                    code = 1  # written through a 0444 file
                except BigperError:
                    code = 0
                except OSError:
                    code = 2
        except BaseException:  # noqa: BLE001
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os.chmod(path, 0o644)
    assert code in (0, 2), code
    after = fingerprint(tmp_path)
    assert after == before or set(after) - set(before) <= {str(tmp_path / ".r.h5.lock")}, set(after) ^ set(before)


def test_an_overwrite_then_a_refused_resume(tmp_path):
    path = _made(tmp_path)
    with _open(path, mode="overwrite") as buf:
        obs = np.zeros((4, 4), np.uint8)
        buf.add(obs=obs, reward=1.0, next_obs=obs)
    leftovers = [p.name for p in tmp_path.iterdir() if ".trash-" in p.name or ".convert-" in p.name]
    assert leftovers == []
    before = fingerprint(tmp_path)
    with pytest.raises(BigperError):
        _open(path, cap=CAP * 2)
    assert fingerprint(tmp_path) == before
    with _open(path) as buf:
        assert len(buf) == 1


def test_two_threads_right_after_a_resume(tmp_path):
    path = _made(tmp_path)
    buf = _open(path)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for i in range(30):
                s = buf.sample(4)
                buf.update_priorities(s, rng.random(4) + 0.1)
                obs = np.full((4, 4), i, np.uint8)
                buf.add(obs=obs, reward=1.0, next_obs=obs)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(s,)) for s in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert not errors, errors
    assert len(buf) == CAP
    lv = buf.leaves(np.arange(CAP))
    assert np.isclose(buf.total_priority, lv.sum(), rtol=1e-6)
    buf.close()
    with _open(path) as back:
        assert len(back) == CAP
