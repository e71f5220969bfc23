"""``tools/bench.py learner --learner proxy`` runs on a machine without a GPU
(issue 41, item 4): the launch-bound proxy learner's share of its ceiling for
each feed, and the Python calls a batch in the sampler's thread, in its JSON
line. A smoke run at a tiny size (real Atari frames from the test data); the
figures themselves are the benchmark's, never asserted here beyond sanity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


def test_the_proxy_learner_runs_on_the_cpu_and_reports_shares_and_calls(tmp_path):
    frames = tmp_path / "frames.npy"  # the bench cuts episodes of about 1,000 frames: all six games
    with np.load(ROOT / "tests" / "data" / "atari_frames.npz") as z:
        np.save(frames, np.concatenate([z[k] for k in z.files]))
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "learner", "--learner", "proxy",
                        "--device", "cpu", "--transitions", "250", "--iters", "4", "--batches", "8",
                        "--proxy-ops", "20", "--no-compression", "--frames", str(frames),
                        "--only", "ceiling,numpy SB3,sample,sampler,tier"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "proxy share (20 ops)" in r.stdout and "py calls/batch" in r.stdout
    out = json.loads(r.stdout.strip().splitlines()[-1])
    proxy = out["proxy"]["8"]
    assert set(proxy) == {"ceiling", "numpy SB3", "sample", "sampler", "tier"}
    assert all(v > 0 for v in proxy.values())
    calls = out["py_calls"]["8"]
    assert set(calls) == {"sampler", "tier"}
    assert all(c["thread"] >= 0 and c["next"] > 0 for c in calls.values())
    assert out["feeds"]["8"] == {}  # no CNN asked for
