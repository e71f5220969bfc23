"""A full disk is an OSError when the buffer is created, never a SIGBUS (or a
failed write) later: files are preallocated. Checked on a real 1 MiB tmpfs,
which needs root; elsewhere the test skips and says why."""

import contextlib
import errno
import os
import subprocess

import numpy as np
import pytest

from tests._storage_cases import DISK, Stream, open_buffer, where

FRAME = {"obs": ((84, 84), np.uint8), "reward": ((), np.float32)}  # 14 KB a transition with next_obs


@contextlib.contextmanager
def tiny_tmpfs(where_, size="1m"):
    """A ``size`` tmpfs mounted at ``where_`` for the block, or a skip saying why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; run as root to check a full disk")
    where_.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where_)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN in this container?): "
                    f"{(r.stderr or r.stdout).strip()}")
    try:
        yield where_
    finally:
        subprocess.run(["umount", "-l", str(where_)], check=False)


@pytest.mark.parametrize("kind", DISK)
def test_full_disk_is_an_oserror_at_creation_and_leaves_nothing(kind, tmp_path):
    with tiny_tmpfs(tmp_path / "mnt") as mnt:
        path = where(kind, mnt)
        # 200 transitions of two 84x84 frames: 2.8 MB, on a 1 MiB disk
        with pytest.raises(OSError) as e:
            open_buffer(kind, path, 200, FRAME)
        assert e.value.errno == errno.ENOSPC
        assert os.listdir(mnt) == []  # no partial directory, file or lock left behind
        # the disk is not broken: a buffer that fits is created, filled past
        # its capacity, closed and read back
        stream = Stream(FRAME, next_of=("obs",), seed=0)
        with open_buffer(kind, path, 30, FRAME) as buf:
            stream.extend([buf], 45)
        with open_buffer(kind, path, 30, FRAME, read_only=True) as buf:
            batch = buf.sample(16)
            want = stream.expected(batch.indices, 30)
            for name in want:
                np.testing.assert_array_equal(batch[name], want[name])


def test_no_import_circle_among_the_storage_modules():
    """The modules of ``bigper/storage`` import one way: no circle, counting
    imports inside functions (``_h5layouts`` <-> ``_h5map`` was one)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "bigper" / "storage"
    mods = {p.stem for p in root.glob("*.py")}
    edges = {}
    for p in root.glob("*.py"):
        out = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        edges[p.stem] = out & mods

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in edges[a])

    circles = sorted(m for m in mods if reaches(m, m))
    assert circles == [], f"storage modules on an import circle: {circles}"


# -- durability order: bytes on disk before the name points at them ---------------------------
def _spy_durability(monkeypatch) -> list:
    """Wrap the real ``os.fsync``/``os.replace``/``os.rename`` and record, in order,
    ``("fsync", path)`` and ``("rename", src, dst)`` (real paths: an fd is named by
    /proc/self/fd, a path relative to a directory fd is joined to it)."""
    events = []
    real = {"fsync": os.fsync, "replace": os.replace, "rename": os.rename}

    def name_of(fd) -> str:
        return os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))

    def full(p, dir_fd) -> str:
        p = os.fsdecode(p)
        return os.path.realpath(os.path.join(name_of(dir_fd), p) if dir_fd is not None else p)

    def fsync(fd):
        fd = fd if isinstance(fd, int) else fd.fileno()
        events.append(("fsync", name_of(fd)))
        return real["fsync"](fd)

    def moving(kind):
        def move(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            s, d = full(src, src_dir_fd), full(dst, dst_dir_fd)
            real[kind](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            events.append(("rename", s, d))
        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", moving("replace"))
    monkeypatch.setattr(os, "rename", moving("rename"))
    return events


def _assert_durable(events, dst) -> int:
    """Every rename onto ``dst`` came after an fsync of its source (since that
    source was last renamed away) and before an fsync of ``dst``'s directory.
    Returns how many renames onto ``dst`` there were."""
    dst = os.path.realpath(dst)
    seen = 0
    for i, e in enumerate(events):
        if e[0] != "rename" or e[2] != dst:
            continue
        seen += 1
        src = e[1]
        start = max((j for j in range(i) if events[j][0] == "rename" and events[j][1] == src), default=-1)
        assert ("fsync", src) in events[start + 1:i], f"{src} renamed onto {dst} before its bytes were fsynced"
        assert ("fsync", os.path.dirname(dst)) in events[i + 1:], f"{dst}'s directory not fsynced after the rename"
    return seen


def test_write_durable_fsyncs_the_bytes_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    from bigper.common.files import write_durable

    events = _spy_durability(monkeypatch)
    write_durable(tmp_path / "x.json", b"first")
    write_durable(tmp_path / "x.json", b"second")  # the same temporary name again
    assert _assert_durable(events, tmp_path / "x.json") == 2
    assert (tmp_path / "x.json").read_bytes() == b"second"


def test_memmap_meta_json_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    fields = {"obs": ((3,), np.float32), "reward": ((), np.float32)}
    stream = Stream(fields, next_of=("obs",), seed=5)
    buf = open_buffer("memmap", where("memmap", tmp_path), 16, fields, seed=0)
    events = _spy_durability(monkeypatch)
    stream.add([buf], 5)
    buf.save(tmp_path / "snap")
    buf.close()
    assert _assert_durable(events, where("memmap", tmp_path) / "meta.json") >= 1
    assert _assert_durable(events, tmp_path / "snap") == 1  # the snapshot's commit too


def test_the_sharded_manifest_is_on_disk_before_the_snapshot_is_renamed_into_place(tmp_path, monkeypatch):
    from bigper.distributed._manifest import commit, temp_dir_for

    snap = tmp_path / "sharded"
    tmp = temp_dir_for(snap)
    (tmp / "shard-0").mkdir()
    events = _spy_durability(monkeypatch)
    commit(tmp, snap, {"format": "x", "shards": []})
    assert _assert_durable(events, tmp / "manifest.json") == 1
    i = events.index(("rename", os.path.realpath(tmp), os.path.realpath(snap)))
    assert ("fsync", os.path.realpath(tmp)) in events[:i], "the snapshot directory was not fsynced before its rename"
    assert _assert_durable(events, snap) == 1
