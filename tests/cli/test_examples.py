"""Each example's ``--smoke`` run, as a user would start it (``python -m bigper.examples.NAME``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

ROOT = Path(__file__).resolve().parents[2]
# Generous: CI machines are shared; a smoke run takes seconds on an idle 2-core machine.
TIMEOUT = 600


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _fails(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


def test_dqn_atari_smoke(tmp_path):
    pytest.importorskip("ale_py")
    out = _run(tmp_path, "bigper.examples.dqn_atari", "--smoke")
    assert "Double DQN + PER (proportional) on ALE/Pong-v5" in out
    assert "snapshot snap-00000001" in out
    assert "beta 1.000" in out  # annealed to 1 by the last learner step
    assert "done:" in out
    assert not list(tmp_path.iterdir())  # --smoke works in a temporary directory it removes


def test_dqn_atari_jax_smoke_learns_on_breakout(tmp_path):
    """CleanRL's DQN in JAX (CPU) with PER on real ALE Breakout: what the torch recipe's smoke checks
    (it runs, beta reaches 1, every loss finite), and the loss of its last updates is below its first."""
    pytest.importorskip("jax")
    pytest.importorskip("ale_py")
    out = _run(tmp_path, "bigper.examples.dqn_atari_jax", "--smoke")
    assert "DQN + PER (JAX" in out and "on ALE/Breakout-v5" in out
    assert "beta 1.000" in out  # annealed to 1 by the last learner step
    m = re.search(r"done: (\d+) learner steps, loss first 10 ([\d.]+), last 10 ([\d.]+)", out)
    assert m, out
    assert int(m[1]) >= 50
    assert float(m[3]) < float(m[2]), out
    assert not list(tmp_path.iterdir())  # in memory: nothing written


def test_dqn_atari_runs_twice_in_one_directory(tmp_path):
    """Rank prioritization; the same --path again: refused without --resume (nothing
    changes), continued from the latest snapshot with it."""
    pytest.importorskip("ale_py")
    run = tmp_path / "run"
    args = ("bigper.examples.dqn_atari", "--smoke", "--path", str(run), "--prioritization", "rank")
    out = _run(tmp_path, *args)
    assert "Double DQN + PER (rank)" in out and "snapshot snap-00000001" in out and "done:" in out
    # (the refused writer takes the storage's lock before it looks, and records its pid in
    # the lock file, which holds nothing else: every other file is left as it was)
    files = lambda: sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")  # noqa: E731
                           if p.name != ".lock")
    before = files()
    again = _fails(tmp_path, *args)
    assert again.returncode == 2 and "already holds a bigper buffer" in again.stderr
    assert "--resume" in again.stderr
    assert files() == before
    out = _run(tmp_path, *args, "--resume")
    assert "resumed from snap-00000001 at step 300" in out
    assert "step       400" in out and "beta 1.000" in out and "done:" in out


@pytest.mark.parametrize("flags, kind", [(["--prioritization", "rank"], "prioritized (rank) replay"),
                                         (["--no-per"], "uniform replay")], ids=["rank", "uniform"])
def test_sac_smoke(tmp_path, flags, kind):
    out = _run(tmp_path, "bigper.examples.sac", "--smoke", *flags)
    assert "final eval return" in out and kind in out
    if "--no-per" not in flags:
        assert "beta 1.000" in out  # annealed to 1 by the last sample call


@pytest.mark.parametrize("kind", ["proportional", pytest.param("rank", marks=pytest.mark.slow)])
def test_resume_smoke(tmp_path, kind):
    out = _run(tmp_path, "bigper.examples.resume", "--smoke", "--path", str(tmp_path / "run"),
               "--prioritization", kind)
    assert f"{kind} prioritization" in out
    assert "killed by SIGKILL (exit code -9)" in out
    assert "resumed at step" in out
    assert "the continuation matches the run that was never killed, bit for bit" in out
    assert list((tmp_path / "run" / "victim" / "snaps").glob("snap-*"))


def _tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.is_dir(), None if p.is_dir() else p.read_bytes())
                  for p in root.rglob("*"))


def test_resume_run_directory_reuse(tmp_path):
    """What a second run with the same --path finds: its own earlier run is
    replaced (only the entries it writes), anything else is refused untouched."""
    from bigper.examples.resume import MARKER, _prepare

    run = tmp_path / "run"
    assert _prepare(run) is None and (run / MARKER).is_file()
    for d in ("reference/replay", "victim/snaps/snap-00000001"):
        (run / d).mkdir(parents=True)
        (run / d / "f.bin").write_bytes(b"x")
    (run / "victim.jsonl").write_text("{}\n")
    assert _prepare(run) is None
    assert sorted(p.name for p in run.iterdir()) == [MARKER]
    (run / "notes.txt").write_text("mine")
    (run / "victim").mkdir()
    before = _tree(run)
    assert "notes.txt" in _prepare(run) and _tree(run) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("x")
    r = _fails(tmp_path, "bigper.examples.resume", "--smoke", "--path", str(other))
    assert r.returncode == 2 and "not written by this script" in r.stderr
    assert _tree(other) == [("data.csv", False, b"x")]


@pytest.mark.slow
def test_resume_runs_twice_in_one_directory(tmp_path):
    run = tmp_path / "run"
    _run(tmp_path, "bigper.examples.resume", "--smoke", "--path", str(run))
    out = _run(tmp_path, "bigper.examples.resume", "--smoke", "--path", str(run))
    assert "replaced the previous run" in out and "bit for bit" in out


def test_r2d2_smoke(tmp_path):
    """The recurrent example on prioritized sequences: CartPole with the
    velocities hidden, then Pong frames on memmap (stored once)."""
    out = _run(tmp_path, "bigper.examples.r2d2", "--smoke")
    assert "cartpole smoke:" in out and "sequences of 4 burn-in + 8" in out
    assert "atari smoke: 300 Pong steps on memmap" in out or "atari smoke skipped" in out
    assert not list(tmp_path.iterdir())


def test_r2d2_prints_its_progress_and_returns(tmp_path):
    """``python -m bigper.examples.r2d2``: what it is doing shows as it goes (step, elapsed seconds,
    episodes, mean return, loss), not after minutes of silence, and it ends with the returns."""
    out = _run(tmp_path, "bigper.examples.r2d2", "--steps", "700", "--log-every", "200")
    lines = [line for line in out.splitlines() if re.match(r"step +\d+ +\(\d+ s\): \d+ episodes", line)]
    assert [int(line.split()[1]) for line in lines] == [200, 400, 600], out
    assert all("mean return of the last 10" in line and "loss" in line for line in lines[1:]), out
    assert re.search(r"^done: 700 steps in \d+ s, \d+ episodes; mean return of the last 10 [\d.]+", out, re.M), out


def _sequences_page_blocks() -> list[str]:
    text = (ROOT / "docs/guide/sequences.md").read_text()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def _allocated(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_sequences_walkthrough_runs_as_written_twice(tmp_path):
    """The R2D2 page, as a user copies it: the first block's buffer is sized for a laptop and
    runs again in the same folder; the walkthrough, at its full length, finishes in about a
    minute (five here, for a shared machine) and prints its progress and returns."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    first, walkthrough = _sequences_page_blocks()[:2]
    (tmp_path / "first.py").write_text(first)
    (tmp_path / "walkthrough.py").write_text(walkthrough)
    for _ in range(2):
        r = subprocess.run([sys.executable, "first.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _allocated(tmp_path / "runs") < 50e6  # not 1.1 GB of slots for 300 steps
    r = subprocess.run([sys.executable, "walkthrough.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"^step +(\d+): \d+ episodes, mean return of the last 10 [\d.]+", r.stdout, re.M)
    assert len(steps) >= 4, r.stdout
    assert re.search(r"^done: \d+ steps, \d+ episodes", r.stdout, re.M), r.stdout
