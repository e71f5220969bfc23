"""Kill -9 at random moments of a loop on Snapshots.save (tools/dev/crash_test.py):
every time, the snapshots present verify and load_latest resumes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "dev" / "crash_test.py"
TRIALS = 50


def _tool():
    spec = importlib.util.spec_from_file_location("bigper_crash_test", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def workdir(tmp_path):
    # kill -9 loses no page cache, so a tmpfs tests the same thing as a disk, without
    # paying for its fsyncs; tools/dev/crash_test.py runs 1,000 trials on a real disk.
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="bigper-crash-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="forks a child to kill (Linux)")
def test_kill_9_during_save_loop_never_loses_the_latest_snapshot(workdir):
    res = _tool().run(TRIALS, workdir, seed=7, max_delay=0.15)
    assert res["ok"] == TRIALS
    assert res["killed_while"].get("saving", 0) >= TRIALS // 3, res  # the kills land where they matter
    assert res["leftovers_cleaned"] >= 1, res
