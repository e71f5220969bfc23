"""``tools/bench.py torchrl`` (issue 44, item 4) runs end to end at a tiny size: both
sides filled with the same TorchRL-shaped TensorDicts of real Atari frames (the test
data), sample + ``update_tensordict_priority`` timed, the proxy learner's share, bytes
on disk, and the resume after kill -9. TorchRL's side is pointed at a venv that is not
there, so it takes the documented fallback (``TensorDictReplayBuffer`` with the uniform
sampler in this venv, ``torchrl_error`` in the JSON). Nothing here asserts a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchrl")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # (CI time: 42 s of the suite's CPU, three processes with torch and TorchRL; run with -m slow)
def test_the_torchrl_workload_runs_at_a_tiny_size_with_the_fallback(tmp_path):
    frames = tmp_path / "frames.npy"  # the bench cuts episodes of about 1,000 frames: all six games
    with np.load(ROOT / "tests" / "data" / "atari_frames.npz") as z:
        np.save(frames, np.concatenate([z[k] for k in z.files]))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "torchrl", "--transitions", "1200",
                        "--batches", "8", "--iters", "3", "--repeats", "1", "--proxy-iters", "3",
                        "--proxy-ops", "5", "--resume-transitions", "300", "--frames", str(frames),
                        "--torchrl-python", str(tmp_path / "no-venv" / "python")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bytes on disk a transition" in r.stdout and "TorchRL uniform (fallback)" in r.stdout
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "torchrl" and "no-venv" in out["torchrl_error"]
    ours, theirs = out["sides"]["bigper"], out["sides"]["torchrl"]
    assert "RandomSampler" in theirs["buffer"]
    for side in (ours, theirs):
        assert side["len"] == 1200 and side["round_us"]["8"] > 0 and side["proxy"]["8"]["share"] > 0
        assert side["bytes_per_transition"] > 0
    # the same keys from both, as a TorchRL loss reads them (TorchRL's uniform sampler adds no weights)
    assert set(ours["sample_keys"]) - {"priority_weight"} == set(theirs["sample_keys"])
    assert ours["bytes_per_transition"] * 6 <= theirs["bytes_per_transition"]  # frames once, not a stack twice
    assert out["resume"]["bigper"]["exact"] is True
    assert out["resume"]["bigper"]["killed_with"] == "SIGKILL"
