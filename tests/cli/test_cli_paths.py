"""What a new user points the ``bigper`` command at (issue 45 §3), run as the
real command (``python -m bigper`` in a subprocess): a run folder laid out as
SB3's CheckpointCallback lays it out, an empty folder, a folder of
checkpoints, the SB3 replay-buffer pickle itself; ``--version``; ``bench
--help``; and what ``./run.sh bigper`` installs."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bigper

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bigper", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """``run/replay`` (the live buffer, closed), ``run/ckpt/`` (the model and the replay
    buffer's pickle, as ``save_replay_buffer`` writes them), ``run/snaps`` (a Snapshots root)."""
    pytest.importorskip("torch")
    pytest.importorskip("stable_baselines3")
    from bigper.integrations.sb3 import PrioritizedDQN

    run = tmp_path_factory.mktemp("cli-paths") / "run"
    model = PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=100, learning_starts=10, device="cpu", seed=0,
                           replay_buffer_kwargs={"storage": "memmap", "path": str(run / "replay")})
    rb = model.replay_buffer
    for t in range(20):
        o = np.full((1, *rb.observation_space.shape), t, np.float32)
        rb.add(o, o, np.array([0]), np.array([float(t)]), np.array([t % 7 == 6]), [{}])
    model.save(run / "ckpt" / "model")
    model.save_replay_buffer(run / "ckpt" / "replay_buffer")
    bigper.Snapshots(run / "snaps").save(rb.buffer)
    rb.close()
    return run


def test_verify_of_a_run_folder_is_not_a_snapshot_and_names_what_it_holds(run_folder):
    r = cli("verify", run_folder)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CORRUPT" not in r.stdout + r.stderr
    assert "not a snapshot" in r.stderr, r.stderr
    for below in ("replay", "snaps", "snap-00000001", "replay_buffer.pkl"):
        assert below in r.stderr, (below, r.stderr)


def test_verify_of_an_empty_folder_says_it_is_empty(tmp_path):
    (tmp_path / "empty").mkdir()
    r = cli("verify", tmp_path / "empty")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CORRUPT" not in r.stdout and "empty" in r.stderr, r.stderr


def test_verify_of_a_folder_of_checkpoints_names_the_pickle_and_its_snapshot(run_folder):
    r = cli("verify", run_folder / "ckpt")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "not a snapshot" in r.stderr and "CORRUPT" not in r.stdout
    assert "replay_buffer.pkl" in r.stderr and "snap-00000001" in r.stderr, r.stderr


def test_a_folder_with_a_snapshots_files_but_no_manifest_is_still_corrupt(run_folder, tmp_path):
    snap = tmp_path / "snap"
    shutil.copytree(run_folder / "snaps" / "snap-00000001", snap)
    os.unlink(snap / "manifest.json")
    r = cli("verify", snap)
    assert r.returncode == 1 and r.stdout.startswith("CORRUPT"), r.stdout + r.stderr


def test_verify_of_an_sb3_pickle_verifies_its_snapshot(run_folder, tmp_path):
    r = cli("verify", run_folder / "ckpt" / "replay_buffer.pkl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "replay_buffer.bigper" in r.stdout, r.stdout
    # a moved run folder: its pickle's snapshot is found beside it, as load_replay_buffer finds it
    moved = tmp_path / "moved"
    shutil.copytree(run_folder, moved, symlinks=True)
    r = cli("verify", moved / "ckpt" / "replay_buffer.pkl")
    assert r.returncode == 0 and str(moved / "ckpt" / "replay_buffer.bigper") in r.stdout, r.stdout + r.stderr
    # its snapshot damaged: corrupt, as the snapshot itself is
    chunk = sorted((moved / "ckpt" / "replay_buffer.bigper").glob("snap-*/data/*"))[0]
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    os.unlink(chunk)
    chunk.write_bytes(bytes(raw))
    r = cli("verify", moved / "ckpt" / "replay_buffer.pkl")
    assert r.returncode == 1 and "CORRUPT" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("protocol", [2, 5])
def test_verify_follows_a_pickle_of_any_protocol(tmp_path, protocol):
    """``pickle.dumps(rb, protocol=...)`` of the drop-in (protocols 2-3 name its class with GLOBAL
    and memoize with BINPUT; 4-5 with STACK_GLOBAL and MEMOIZE)."""
    pytest.importorskip("stable_baselines3")
    from gymnasium import spaces

    from bigper.integrations.sb3 import PrioritizedReplayBuffer

    rb = PrioritizedReplayBuffer(32, spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(2), device="cpu",
                                 storage="memmap", path=str(tmp_path / "live"))
    o = np.zeros((1, 3), np.float32)
    for _ in range(5):
        rb.add(o, o, np.array([0]), np.array([1.0]), np.array([False]), [{}])
    (tmp_path / "rb.pkl").write_bytes(pickle.dumps(rb, protocol=protocol))
    rb.close()
    r = cli("verify", tmp_path / "rb.pkl")
    assert r.returncode == 0 and str(tmp_path / "live.snapshots" / "snap-00000001") in r.stdout, r.stdout + r.stderr


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_verify_of_a_pickle_that_is_not_bigpers_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "it-ran"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"snapshot": str(tmp_path), "x": _RunsCode(str(marker))}))
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"format": "bigper.sb3/1", "snapshot": 3}))
    for p in (evil, plain):
        r = cli("verify", p)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "not a bigper SB3 replay-buffer pickle" in r.stderr and str(p) in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not marker.exists()  # nothing in the file was run


def test_info_of_a_run_folder_says_what_it_holds_not_minari(run_folder):
    r = cli("info", run_folder)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Minari" not in out and "main_data" not in out, out
    assert "not a snapshot" in out and "replay" in out and "snap-00000001" in out, out


def test_info_of_an_empty_folder_is_not_minari(tmp_path):
    r = cli("info", tmp_path)
    assert r.returncode == 2 and "Minari" not in r.stderr and "empty" in r.stderr, r.stdout + r.stderr


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"bigper {bigper.__version__}", r.stdout + r.stderr


def test_bench_help_lists_the_workloads():
    r = cli("bench", "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    for workload in ("tree", "storage", "atari", "snapshot", "learner", "sequences"):
        assert workload in r.stdout, (workload, r.stdout)


@pytest.mark.parametrize("workload", ["tree", "storage"])
def test_bench_plots_only_where_asked(workload):
    """A benchmark run must not overwrite the committed figures in tools/results/ by default."""
    r = cli("bench", workload, "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    plot = " ".join(r.stdout.split("\n  --plot", 1)[1].split("\n  --", 1)[0].split())  # its help, unwrapped
    assert "default tools/results" not in plot and "default: none" in plot, plot


# The extras run.sh leaves out for the core commands: each import of them fails in this child.
WITHOUT_EXTRAS = """
import sys
for name in ("torch", "gymnasium", "ale_py", "cv2", "matplotlib", "stable_baselines3", "sb3_contrib", "ray",
             "minari", "cpprb", "tianshou", "hypothesis", "pytest"):
    sys.modules[name] = None
from bigper.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_core_commands_run_with_the_core_alone(run_folder):
    """What ``./run.sh bigper`` installs for them is enough: --help, --version, info and verify of a
    run folder, a snapshot and an SB3 pickle (read without SB3) import no extra."""
    for args, rc in ((["--help"], 0), (["--version"], 0), (["verify", run_folder], 2), (["info", run_folder], 0),
                     (["verify", run_folder / "snaps"], 0), (["info", run_folder / "snaps"], 0),
                     (["verify", run_folder / "replay"], 0),
                     (["verify", run_folder / "ckpt" / "replay_buffer.pkl"], 0)):
        r = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *map(str, args)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == rc and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)


def test_run_sh_bigper_installs_only_what_the_command_needs(tmp_path):
    """``./run.sh bigper ...`` with a venv whose python and bigper record their arguments (what
    run.sh would install, without installing it): --help, info and verify need the core (and zstd
    for compressed snapshots); bench needs its peers; demo what the demo needs."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    for name in ("python", "bigper"):
        exe = venv / "bin" / name
        # (torch is not there: run.sh would install it, and says so in the log)
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\ncase "$*" in *"import torch"*) exit 1;; esac\n')
        exe.chmod(0o755)

    def asked(*args) -> str:
        if log.exists():
            log.unlink()
        (venv / ".bigper-installed").unlink(missing_ok=True)
        r = subprocess.run(["bash", str(ROOT / "run.sh"), "bigper", *args], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "BIGPER_VENV": str(venv)})
        assert r.returncode == 0, r.stdout + r.stderr
        lines = log.read_text().splitlines()
        assert lines[-1] == "bigper " + " ".join(args), lines
        installs = [ln for ln in lines if " -e " in ln]
        assert len(installs) == 1, lines
        extras = installs[0].rsplit("[", 1)[1].rstrip("]")
        assert any("torch==" in ln for ln in lines) == ("torch" in extras.split(",")), lines
        return extras

    for args in (["--help"], ["verify", "x"], ["info", "x"]):
        assert asked(*args) == "compression", args
    assert set(asked("bench", "tree").split(",")) >= {"dev"}
    assert set(asked("demo").split(",")) >= {"torch", "atari"}
