"""Each example's ``--smoke`` run, as a user would start it (``python -m bigper.examples.NAME``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

ROOT = Path(__file__).resolve().parent.parent
# Generous: CI machines are shared; a smoke run takes seconds on an idle 2-core machine.
TIMEOUT = 600


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_dqn_atari_smoke(tmp_path):
    pytest.importorskip("ale_py")
    out = _run(tmp_path, "bigper.examples.dqn_atari", "--smoke")
    assert "Double DQN + PER on ALE/Pong-v5" in out
    assert "snapshot snap-00000001" in out
    assert "beta 1.000" in out  # annealed to 1 by the last learner step
    assert "done:" in out
    assert not list(tmp_path.iterdir())  # --smoke works in a temporary directory it removes


@pytest.mark.parametrize("per", [True, False], ids=["per", "uniform"])
def test_sac_smoke(tmp_path, per):
    out = _run(tmp_path, "bigper.examples.sac", "--smoke", *([] if per else ["--no-per"]))
    assert "final eval return" in out
    assert ("prioritized replay" if per else "uniform replay") in out


def test_resume_smoke(tmp_path):
    out = _run(tmp_path, "bigper.examples.resume", "--smoke", "--path", str(tmp_path / "run"))
    assert "killed by SIGKILL (exit code -9)" in out
    assert "resumed at step" in out
    assert "the continuation matches the run that was never killed, bit for bit" in out
    assert list((tmp_path / "run" / "victim" / "snaps").glob("snap-*"))
