"""A convert killed between the two renames of its publish, and what the next convert does with it.

``_publish`` moves the new file's sidecar to ``<dst>.priorities`` first, then
links ``<dst>.partial`` to ``dst``: a kill -9 between the two leaves the
sidecar without its file. The next convert to the same ``dst`` recognizes it
(``_killed_publish``: no ``dst``, the complete partial still there, the
sidecar made for that partial under ``dst``'s name), under ``dst``'s lock,
removes it and converts. Anything else at ``<dst>.priorities`` is still
refused (``PathExistsError``), every byte left: a sidecar of another file, one
made under another name, a partial that is a symlink or not an HDF5 file, a
sidecar that is a symlink; and a convert that is alive between its renames
(it holds ``dst``'s lock) is never touched.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import bigper
from bigper.convert import convert
from bigper.errors import PathExistsError, StorageLockedError

from tests._child import Child
from tests._hostile_snapshot_cases import fingerprint
from tests.offline.test_convert import everything, write_d4rl
from tests.offline.test_hostile_convert import KILLED


def _files(path) -> dict:
    """The folder's fingerprint but for lock files (a refusal under dst's lock writes its pid there)."""
    return {k: v for k, v in fingerprint(path).items() if not str(k).endswith(".lock")}


def _source(tmp_path, n=120, seed=1):
    (tmp_path / "src").mkdir(exist_ok=True)
    src = tmp_path / "src" / f"d{seed}.h5"
    write_d4rl(src, n=n)
    with bigper.PrioritizedReplayBuffer.from_hdf5(src) as ds:
        live = np.flatnonzero(ds.status == 1)
        ds.update_priorities(live, np.random.default_rng(seed).random(live.shape[0]) + 0.5)
    return src, everything(src)[1]


def _killed_at_link(src, dst):
    with Child(KILLED, src, dst, "link") as child:
        child.said("at link")
        child.kill()
    side = dst.with_name(dst.name + ".priorities")
    assert side.is_dir() and not os.path.lexists(dst) and dst.with_name(dst.name + ".partial").is_file()
    return side


def test_the_killed_runs_sidecar_is_replaced_and_the_file_opens_with_its_priorities(tmp_path):
    src, want = _source(tmp_path)
    dst = tmp_path / "z.h5"
    _killed_at_link(src, dst)
    convert(src, dst, progress=False)
    assert everything(dst)[1].tobytes() == want.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["src", "z.h5", "z.h5.priorities"]


def test_a_sidecar_made_for_another_file_is_refused_beside_a_killed_partial(tmp_path):
    """The partial is the killed run's, the sidecar is another dataset's (put there by hand)."""
    src, _ = _source(tmp_path)
    other, _ = _source(tmp_path, n=90, seed=2)
    dst = tmp_path / "z.h5"
    side = _killed_at_link(src, dst)
    shutil.rmtree(side)
    convert(other, tmp_path / "o.h5", progress=False)
    os.rename(tmp_path / "o.h5.priorities", side)
    os.unlink(tmp_path / "o.h5")
    before = _files(tmp_path)
    with pytest.raises(PathExistsError, match="move or delete it first"):
        convert(src, dst, progress=False)
    assert _files(tmp_path) == before


def test_a_sidecar_made_for_the_partial_under_another_name_is_refused(tmp_path):
    src, _ = _source(tmp_path)
    dst = tmp_path / "z.h5"
    side = _killed_at_link(src, dst)
    meta = json.loads((side / "meta.json").read_text())
    meta["dataset"]["name"] = "elsewhere.h5"
    (side / "meta.json").write_text(json.dumps(meta))
    before = _files(tmp_path)
    with pytest.raises(PathExistsError, match="move or delete it first"):
        convert(src, dst, progress=False)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("what", ["partial-symlink", "partial-not-hdf5", "partial-gone", "sidecar-symlink",
                                  "dst-appeared"])
def test_anything_else_at_the_sidecar_path_is_refused_and_left(tmp_path, what):
    src, _ = _source(tmp_path)
    dst = tmp_path / "z.h5"
    side = _killed_at_link(src, dst)
    partial = dst.with_name(dst.name + ".partial")
    if what == "partial-symlink":
        os.rename(partial, tmp_path / "real.partial")
        os.symlink(tmp_path / "real.partial", partial)
    elif what == "partial-not-hdf5":
        partial.write_bytes(b"not an HDF5 file" * 100)
    elif what == "partial-gone":
        os.unlink(partial)
    elif what == "sidecar-symlink":
        os.rename(side, tmp_path / "real.priorities")
        os.symlink(tmp_path / "real.priorities", side)
    else:  # someone put a file at dst meanwhile: never replaced without overwrite
        (tmp_path / "z.h5").write_bytes(b"theirs")
    before = _files(tmp_path)
    with pytest.raises(PathExistsError):
        convert(src, dst, progress=False)
    assert _files(tmp_path) == before


def test_a_convert_alive_between_its_renames_is_never_touched(tmp_path):
    """Stopped (not killed) at the link: it holds dst's lock; the second convert is refused
    without removing the sidecar the first moved; once the first is killed, the next completes."""
    src, want = _source(tmp_path)
    dst = tmp_path / "z.h5"
    side = dst.with_name(dst.name + ".priorities")
    with Child(KILLED, src, dst, "link") as child:
        child.said("at link")
        theirs = fingerprint(side)
        with pytest.raises((StorageLockedError, PathExistsError)):
            convert(src, dst, progress=False)
        assert fingerprint(side) == theirs and dst.with_name(dst.name + ".partial").is_file()
        child.kill()
    convert(src, dst, progress=False)
    assert everything(dst)[1].tobytes() == want.tobytes()
