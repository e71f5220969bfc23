"""Hostile DQN Replay runs: checkpoints that disagree with the format, or with each other.

Each case starts from a good run (real ALE play, tests/offline/_dqn_replay_files.py),
breaks one thing, and holds that ``convert_dqn_replay`` raises ``OfflineDatasetError``
naming the file and the value, before anything at the destination changes (the
destination's folder is fingerprinted before and after), without blocking on a
FIFO, following a symlink, or allocating what a header declares.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from bigper.convert_dqn import convert_dqn_replay
from bigper.errors import OfflineDatasetError

from tests._hostile_snapshot_cases import deadline, fingerprint
from tests.offline._dqn_replay_files import load_npy_gz, two_checkpoints, write_npy_gz

C = 300


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return two_checkpoints(tmp_path_factory.mktemp("good") / "run", C)


def name(kind: str, n: int = 1) -> str:
    return f"{'$store$_' if kind in ('observation', 'action', 'reward', 'terminal') else ''}{kind}_ckpt.{n}.gz"


def gz(data: bytes) -> bytes:
    return gzip.compress(data)


def npy_header(descr: str, shape: tuple, version=(1, 0), hlen: int | None = None) -> bytes:
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    size = len(text) if hlen is None else hlen
    pre = b"\x93NUMPY" + bytes(version) + (struct.pack("<H", size) if version[0] == 1 else struct.pack("<I", size))
    return pre + text


def raw_header(text: bytes) -> bytes:
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def resave(path: Path, a) -> None:
    path.unlink()
    write_npy_gz(path, np.asarray(a))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def not_gzip(path: Path) -> None:
    a = load_npy_gz(path)
    path.unlink()
    with open(path, "wb") as f:
        np.save(f, a, allow_pickle=False)


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def symlink(path: Path) -> None:
    real = path.with_name("elsewhere.npy.gz")
    path.rename(real)
    path.symlink_to(real.name)


def missing(path: Path) -> None:
    path.unlink()


def huge_header(path: Path) -> None:
    path.write_bytes(gz(npy_header("<i8", (), version=(2, 0), hlen=1 << 31)))


def huge_shape(path: Path) -> None:
    # a tiny file declaring 2**39 slots: refused before anything of that size is allocated
    path.write_bytes(gz(npy_header("|u1", (1 << 39,)) + bytes(1000)))


def pickled(path: Path) -> None:
    import pickle
    path.write_bytes(gz(pickle.dumps(1999)))  # what Dopamine writes for a non-array attribute


def flip_terminal(path: Path) -> None:
    a = load_npy_gz(path).copy()
    a[5] = 2
    resave(path, a)


CASES = {
    # case: (file kind, change, what the message names)
    "action one short": ("action", lambda p: resave(p, load_npy_gz(p)[:-1]), r"shape \(299,\).*\(300,\)"),
    "reward as float64": ("reward", lambda p: resave(p, load_npy_gz(p).astype(np.float64)), "'<f8'"),
    "action as int64": ("action", lambda p: resave(p, load_npy_gz(p).astype(np.int64)), "'<i8'"),
    "terminal as bool": ("terminal", lambda p: resave(p, load_npy_gz(p).astype(bool)), "'|b1'"),
    "observation big-endian": ("observation", lambda p: resave(p, load_npy_gz(p).astype(">u2")), "'>u2'"),
    "observation 2-d": ("observation", lambda p: resave(p, load_npy_gz(p)[:, 0]), r"shape \(300, 84\)"),
    "frames of another shape": ("observation", lambda p: resave(p, load_npy_gz(p)[:, :80]),
                                r"\(80, 84\).*\(84, 84\)"),
    "truncated gz": ("observation", truncate, "truncated"),
    "truncated small gz": ("terminal", truncate, "truncated"),
    "not gzip": ("reward", not_gzip, "not a gzip file"),
    "a FIFO": ("terminal", fifo, "not a regular file"),
    "a symlink": ("action", symlink, "symlink"),
    "a directory": ("reward", lambda p: (p.unlink(), p.mkdir()), "not a regular file"),
    "missing companion": ("invalid_range", missing, "missing"),
    "add_count negative": ("add_count", lambda p: resave(p, np.array(-1)), "add_count -1 is out of range"),
    "add_count too large": ("add_count", lambda p: resave(p, np.array(1 << 60)), "out of range"),
    "add_count off the invalid range": ("add_count", lambda p: resave(p, load_npy_gz(p) + 7),
                                        "invalid range .* is not the one add_count"),
    "add_count as float": ("add_count", lambda p: resave(p, np.array(650.0)), "'<f8'"),
    "invalid range too short": ("invalid_range", lambda p: resave(p, load_npy_gz(p)[:3]), "holds 3 indices"),
    "huge npy header": ("add_count", huge_header, "npy header of 2,147,483,648 bytes"),
    "huge declared shape": ("terminal", huge_shape, "more than deflate can expand"),
    "a pickle": ("add_count", pickled, "does not hold an npy array"),
    "terminal 2": ("terminal", flip_terminal, "slot 5 holds terminal 2"),
    "npy version 9": ("reward", lambda p: p.write_bytes(gz(b"\x93NUMPY\x09\x00" + bytes(100))), "version 9"),
    "header not a literal": ("reward", lambda p: p.write_bytes(gz(raw_header(b"__import__('os').getpid()")
                                                                   + bytes(1200))), "not a literal dict"),
    "fortran order": ("reward", lambda p: p.write_bytes(gz(npy_header("<f4", (300,)).replace(b"False", b"True ")
                                                           + bytes(1200))), "fortran_order=True"),
    "more data than declared": ("reward", lambda p: p.write_bytes(gz(npy_header("<f4", (300,)) + bytes(1204))),
                                "gzip trailer says"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_that_disagrees_is_refused_naming_file_and_value_and_changes_nothing(case, good, tmp_path):
    kind, change, match = CASES[case]
    run = tmp_path / "run"
    shutil.copytree(good, run, symlinks=True)
    change(run / name(kind))
    out = tmp_path / "out"
    out.mkdir()
    before, src = fingerprint(out), fingerprint(run)
    with deadline(60), pytest.raises(OfflineDatasetError, match=match) as e:
        convert_dqn_replay(run, out / "d.h5", progress=False)
    assert name(kind) in str(e.value) or "elsewhere" in str(e.value) or "ckpt.1" in str(e.value)
    assert fingerprint(out) == before  # no dst, no partial file, no work directory, no lock file
    assert fingerprint(run) == src


def test_frames_corrupt_midway_are_found_when_read_and_publish_nothing(good, tmp_path):
    """A flipped byte inside the deflate stream keeps the trailer's size: found while
    decompressing, after checkpoint 0 was converted. Nothing at dst; the work
    directory keeps checkpoint 0, and once the file is good again the next run
    resumes after it."""
    run = tmp_path / "run"
    shutil.copytree(good, run)
    path = run / name("observation")
    data = bytearray(path.read_bytes())
    good_bytes = bytes(data)
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    mtime = os.stat(path).st_mtime_ns
    dst = tmp_path / "out" / "d.h5"
    with deadline(120), pytest.raises(OfflineDatasetError, match=rf"{re.escape(name('observation'))}.*(gzip|CRC|check|short|more)"):
        convert_dqn_replay(run, dst, progress=False)
    assert not os.path.lexists(dst) and not os.path.lexists(f"{dst}.partial")
    assert os.path.isdir(f"{dst}.partial.d")
    path.write_bytes(good_bytes)  # repaired in place, as the work's record saw it (inode, size, mtime)
    os.utime(path, ns=(mtime, mtime))
    r = convert_dqn_replay(run, dst, progress=False)
    assert r["resumed_after"] == 1 and r["transitions"] > 0


def test_a_file_swapped_after_the_scan_is_refused(good, tmp_path, monkeypatch):
    """Each file is re-opened as the one scanned (device, inode, size, mtime) or refused."""
    import bigper.offline.dqn_replay as d

    run = tmp_path / "run"
    shutil.copytree(good, run)
    scan = d.scan_run

    def then_swap(*a, **k):
        out = scan(*a, **k)
        p = run / name("reward")
        a_ = load_npy_gz(p)
        p.unlink()
        write_npy_gz(p, a_)  # same bytes, another inode
        return out

    import bigper.convert_dqn as c
    monkeypatch.setattr(c, "scan_run", then_swap)
    dst = tmp_path / "out" / "d.h5"
    with pytest.raises(OfflineDatasetError, match=rf"{re.escape(name('reward'))}.*changed since"):
        convert_dqn_replay(run, dst, progress=False)
    assert not os.path.lexists(dst)


def test_a_directory_without_checkpoints_and_a_missing_one(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(OfflineDatasetError, match="no DQN Replay checkpoint"):
        convert_dqn_replay(tmp_path / "empty", tmp_path / "d.h5", progress=False)
    with pytest.raises(Exception, match="does not exist"):
        convert_dqn_replay(tmp_path / "nope", tmp_path / "d.h5", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["empty"]
