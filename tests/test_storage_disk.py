"""A full disk is an OSError when the buffer is created, never a SIGBUS (or a
failed write) later: files are preallocated. Checked on a real 1 MiB tmpfs,
which needs root; elsewhere the test skips and says why."""

import contextlib
import errno
import os
import subprocess

import numpy as np
import pytest

from ._storage_cases import DISK, Stream, open_buffer, where

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

    root = Path(__file__).resolve().parents[1] / "bigper" / "storage"
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
