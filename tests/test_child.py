"""The helper every test that kills a child uses (tests/_child.py): a failure
always shows the child's stderr, read after its exit, and a kill lands only
after the point the child reported, however slow the child is to get there."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests._child import Child

ROOT = Path(__file__).resolve().parents[1]

# A child that reports "ready" and then dies of an error before the point the test waits for,
# the way a child that finds an unclean folder does.
DIES = """
import sys, time
print("ready", flush=True)
time.sleep(0.2)
raise RuntimeError("the reason it died: " + sys.argv[1])
"""

# A child slow to reach its point (a busy machine), then working until killed.
SLOW_START = """
import sys, time
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
open(sys.argv[2], "w").close()
print("saved", flush=True)
while True:
    time.sleep(0.01)
"""


def test_a_child_that_dies_before_its_point_fails_with_its_stderr():
    with Child(DIES, "unclean folder") as child:
        child.said("ready")
        with pytest.raises(pytest.fail.Exception) as e:
            child.said("saved")
    assert "the reason it died: unclean folder" in str(e.value)
    assert "exit status 1" in str(e.value)


def test_a_kill_of_a_child_that_had_ended_by_itself_fails_with_its_stderr():
    with Child(DIES, "its loop failed") as child:
        child.said("ready")
        time.sleep(2)  # it has died meanwhile
        with pytest.raises(pytest.fail.Exception, match="its loop failed"):
            child.kill()


def test_a_kill_lands_after_the_point_however_slow_the_child(tmp_path):
    mark = tmp_path / "snapshot"
    with Child(SLOW_START, 1.5, mark) as child:
        child.said("ready")
        child.said("saved")
        child.kill()
        assert mark.exists()
        assert child.proc.returncode == -9


def test_a_child_silent_past_the_timeout_fails_and_is_killed():
    with Child(SLOW_START, 60, "/nonexistent/never") as child:
        child.said("ready")
        with pytest.raises(pytest.fail.Exception, match="printed nothing for 0.5 s"):
            child.said("saved", timeout=0.5)
        assert child.proc.returncode is not None  # not left running


# -- tests/_child_batch.py: many cases in one child, each as if in a fresh interpreter --------------

LEAVE_OPEN = r"""
import sys, numpy as np, bigper
path, what = sys.argv[1], sys.argv[2]
fields = {"obs": ((2,), np.float32)}
if what == "leave":  # opened, written, never closed: the interpreter's exit closes it
    buf = bigper.PrioritizedReplayBuffer(8, fields, storage="memmap", path=path, mode="new")
    buf.add(obs=np.zeros(2, np.float32), next_obs=np.ones(2, np.float32))
    import builtins
    builtins.kept_by_the_case = buf  # alive past the case's globals, as a module's would be till exit
else:  # the next case resumes it: its lock released and its state recorded by that exit
    with bigper.PrioritizedReplayBuffer(8, fields, storage="memmap", path=path, mode="resume") as back:
        print("len", len(back))
"""


def test_a_batch_case_ends_as_an_interpreter_exit_would(tmp_path):
    """A buffer a case leaves open is closed by bigper's own exit handler before the next case
    runs (its lock released, its state on disk), as a fresh interpreter's exit would."""
    from tests._child_batch import run_batch

    path = tmp_path / "run"
    got = run_batch(LEAVE_OPEN, {"leave": [path, "leave"], "resume": [path, "resume"]},
                    env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert got["leave"].returncode == 0, got["leave"].stderr
    assert got["resume"].returncode == 0, got["resume"].stderr
    assert "len 1" in got["resume"].stdout
