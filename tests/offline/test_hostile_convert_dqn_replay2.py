"""More hostile use of `bigper convert` of a DQN Replay run: a RUN_DIR reached
through a symlinked parent, a chdir during the convert (a Python call with
relative paths), DST in a read-only directory."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from bigper.convert_dqn import convert_dqn_replay
from bigper.errors import BigperError, InvalidArgumentError
from tests.offline.test_hostile_convert_dqn_replay import good  # noqa: F401 (fixture)


def tree(p: Path) -> dict:
    return {str(q.relative_to(p)): (q.stat().st_size, q.stat().st_mtime_ns) for q in sorted(p.rglob("*"))}


def test_run_dir_through_a_symlinked_parent_converts(good, tmp_path):  # noqa: F811
    (tmp_path / "via").symlink_to(good.parent)
    before = tree(good)
    out = convert_dqn_replay(tmp_path / "via" / good.name, tmp_path / "out.h5", progress=False, workers=1)
    assert out["transitions"] > 0 and Path(out["dst"]).is_file()
    assert tree(good) == before


@pytest.mark.parametrize("side", ["run via link", "dst via link"])
def test_dst_inside_run_dir_through_a_symlink_is_refused(good, tmp_path, side):  # noqa: F811
    import shutil
    real = tmp_path / "real"
    real.mkdir()
    run = real / "run"
    shutil.copytree(good, run)
    (tmp_path / "link").symlink_to(real)
    via = tmp_path / "link" / "run"
    src, dst = (via, run / "out.h5") if side == "run via link" else (run, via / "out.h5")
    before = tree(run)
    try:
        convert_dqn_replay(src, dst, progress=False, workers=1)
    except InvalidArgumentError:
        pass
    assert tree(run) == before, "convert wrote inside its RUN_DIR"


def test_chdir_during_a_convert_with_relative_paths(good, tmp_path):  # noqa: F811
    old = os.getcwd()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "run").symlink_to(good)
    os.chdir(tmp_path / "a")
    stop = threading.Event()

    def hopper():
        while not stop.is_set():
            os.chdir(tmp_path / "b")
            time.sleep(0.001)
            os.chdir(tmp_path / "a")
            time.sleep(0.001)
    t = threading.Thread(target=hopper)
    try:
        t.start()
        time.sleep(0.01)
        os.chdir(tmp_path / "a")  # (the call below reads its relative paths here, the hopper goes on)
        try:
            out = convert_dqn_replay("run", "out.h5", progress=False, workers=1)
        except BigperError:
            out = None  # a refusal is fine; a file in the wrong place is not
    finally:
        stop.set()
        t.join()
        os.chdir(old)
    leftovers = [p.name for p in (tmp_path / "b").iterdir()]
    assert leftovers == [], f"convert wrote under the other cwd: {leftovers}"
    if out is not None:
        assert Path(out["dst"]).parent == tmp_path / "a" or Path(out["dst"]).parent == tmp_path / "b"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_dst_in_a_read_only_dir(good, tmp_path):  # noqa: F811
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(BigperError):
            convert_dqn_replay(good, ro / "out.h5", progress=False, workers=1)
    finally:
        ro.chmod(0o700)
    assert list(ro.iterdir()) == []


def test_dst_is_a_symlink_to_a_file_in_run_dir(good, tmp_path):  # noqa: F811
    victim = next(p for p in sorted(good.iterdir()) if p.is_file())
    before = tree(good)
    (tmp_path / "out.h5").symlink_to(victim)
    with pytest.raises(BigperError):
        convert_dqn_replay(good, tmp_path / "out.h5", overwrite=True, progress=False, workers=1)
    assert tree(good) == before
