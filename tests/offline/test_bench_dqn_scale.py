"""``tools/bench.py offline --dqn-replay --scale`` (issue 43 §4) runs end to end at a tiny size:
a synthetic run from real ALE play (two distinct checkpoints, two hard links), the convert
and ``reprioritize`` each killed with SIGKILL in a child in the middle and resumed, every
transition of the killed checkpoint and of the last held to the format's rules, every
priority to its score, and the sample + update rounds. Nothing here asserts a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ale_py")
pytest.importorskip("cv2")
ROOT = Path(__file__).resolve().parents[2]


def test_the_scale_run_runs_tiny_with_both_kills_and_resumes(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "offline", "--dqn-replay", "--scale",
                        "--slots", "1500", "--checkpoints", "4", "--pool", "2400", "--check-all", "--games", "Pong,Seaquest", "--warm-rounds", "20",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "resume after kill -9" in r.stdout and "bytes on disk a transition" in r.stdout
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "offline-dqn-replay-scale"
    rep = out["results"]
    n = rep["convert"]["transitions"]
    assert n > 4 * 1400 and rep["check"]["transitions"] == n
    assert rep["check"]["checked"] >= 2 * 1400  # every transition of checkpoints 2 and 3
    assert 0 < rep["reprioritize"]["resumed_at"] < n
    assert rep["round_us"]["32"] > 0 and rep["round_us_one_checkpoint"]["256"] > 0 and rep["round_us"]["32 first"] > 0
    assert rep["one_checkpoint_transitions"] < n and rep["dst_bytes_per_tr"] > 0
    assert all(v > 0 for v in rep["rss_mb"].values())
    assert rep["games"] == ["Pong", "Seaquest"] and "Pong, Seaquest" in r.stdout
    assert 0 <= rep["cached"] <= 1 and 0 <= rep["cached_one_checkpoint"] <= 1
    assert rep["cached_read"] > 0.9 and "after it was read once" in r.stdout  # (the file read through)
    assert set(rep["round_us_read"]) == set(rep["round_us_read_one_checkpoint"]) == {"32", "256"}
    assert all(v > 0 for v in rep["round_us_read"].values())
    assert 0 < rep["round_rss_anon_mb"] <= rep["rss_mb"]["sample_update"]  # (a child of its own)
    assert list(tmp_path.iterdir()) == []  # the bench's files are gone


def test_a_run_given_with_another_number_of_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for n in range(2):
        (run / f"$store$_observation_ckpt.{n}.gz").write_bytes(b"")
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "offline", "--dqn-replay", "--scale",
                        "--slots", "1500", "--checkpoints", "4", "--run", str(run), "--dir", str(work)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    assert f"--run {run} holds 2 checkpoints, not --checkpoints 4" in r.stdout + r.stderr
    assert list(work.iterdir()) == [] and sorted(p.name for p in run.iterdir()) == [
        "$store$_observation_ckpt.0.gz", "$store$_observation_ckpt.1.gz"]  # the run is never written
